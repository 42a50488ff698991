"""Variable-length (packed) batches and the packed-input conveniences, through the public API.

A packed batch must equal running each sequence alone through ``flash_attn_func``
and the float64 reference (``reference.varlen_attention_forward``), forward and
backward, by flash-attn's rule. The lengths include 0 and 1 and one long sequence
among short ones, with seqlen_q ≠ seqlen_k per sequence. The packed conveniences
(qkv and kv stacked) must give the unpacked call's outputs and gradients exactly,
the gradient packed like the input.

Grids are kept small because the interpreter runs each program in numpy: this file
takes ~25 s on 2 CPU cores (both backends; ~45 s when the cores are shared).
"""

import pytest
import torch
from helpers import DEVICE, assert_accurate, make_inputs, packed_inputs

import flashtile
from flashtile._options import AttentionOptions, AttentionTensors
from flashtile import reference as ref

# one long sequence among short ones; a query length 0 with keys, keys 0 with queries, lengths 1
SEQLENS_Q = [3, 0, 1, 70, 1]
SEQLENS_K = [7, 4, 0, 50, 1]


def _slopes(batch, nheads):
    slopes = 2.0 ** (-8.0 * torch.arange(1, nheads + 1) / nheads) * torch.linspace(1.0, 0.25, batch)[:, None]
    return slopes.float().to(DEVICE)


VARIANTS = {
    "plain": lambda b, h: {},
    "window": lambda b, h: dict(window_size=(6, 2)),
    "softcap": lambda b, h: dict(softcap=2.0),
    "alibi-per-sequence": lambda b, h: dict(alibi_slopes=_slopes(b, h)),
}


def _sequence_options(options, i):
    """The options of sequence i run alone: per-sequence ALiBi slopes become (nheads,)."""
    slopes = options.get("alibi_slopes")
    if slopes is None or slopes.dim() == 1:
        return options
    return {**options, "alibi_slopes": slopes[i]}


def _varlen_references(q, k, v, do, cu_q, cu_k, options):
    """(float64, input-dtype) references: [out, lse, dq, dk, dv] of the packed batch."""
    results = []
    for dtype in (torch.float64, q.dtype):
        qr, kr, vr = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
        out, lse = ref.varlen_attention_forward(qr, kr, vr, cu_q, cu_k, **options)
        results.append([out, lse, *torch.autograd.grad(out, (qr, kr, vr), do.to(dtype))])
    return results


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_varlen_equals_reference_and_each_sequence_alone(backend, variant, causal):
    (q, k, v), do, cu_q, cu_k = packed_inputs(SEQLENS_Q, SEQLENS_K, 2, 1, 40, torch.float16, seed=40)
    options = dict(causal=causal, **VARIANTS[variant](len(SEQLENS_Q), 2))
    out, lse, _ = flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(SEQLENS_Q), max(SEQLENS_K),
                                                   return_attn_probs=True, **options)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (2, len(q)) and lse.dtype == torch.float32
    grads = torch.autograd.grad(out, (q, k, v), do)

    ref64, ref_lowp = _varlen_references(q, k, v, do, cu_q, cu_k, options)
    assert_accurate("out", out, ref64[0], ref_lowp[0], factor=2)
    seen = torch.isfinite(ref64[1])
    assert torch.equal(torch.isneginf(lse), ~seen)
    torch.testing.assert_close(lse[seen].double(), ref64[1][seen], rtol=0, atol=1e-5)
    for name, got, r64, rlow in zip(("dq", "dk", "dv"), grads, ref64[2:], ref_lowp[2:]):
        assert got.shape == r64.shape and got.dtype == q.dtype, name
        assert_accurate(name, got, r64, rlow, factor=3)

    # each sequence alone through flash_attn_func: the same kernels on the same tiles
    for i in range(len(SEQLENS_Q)):
        rows_q, rows_k = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
        q_i, k_i, v_i = (t.detach()[rows][None].requires_grad_() for t, rows in ((q, rows_q), (k, rows_k), (v, rows_k)))
        out_i, lse_i, _ = flashtile.flash_attn_func(q_i, k_i, v_i, return_attn_probs=True,
                                                    **_sequence_options(options, i))
        grads_i = torch.autograd.grad(out_i, (q_i, k_i, v_i), do[rows_q][None])
        torch.testing.assert_close(out[rows_q], out_i[0], rtol=0, atol=0, msg=f"out of sequence {i}")
        torch.testing.assert_close(lse[:, rows_q], lse_i[0], rtol=0, atol=0, msg=f"lse of sequence {i}")
        for name, got, alone, rows in zip(("dq", "dk", "dv"), grads, grads_i, (rows_q, rows_k, rows_k)):
            torch.testing.assert_close(got[rows], alone[0], rtol=0, atol=0, msg=f"{name} of sequence {i}")


def test_varlen_rows_that_see_nothing(backend):
    # causal with seqlen_q > seqlen_k per sequence: the first rows see no key; a sequence
    # with no keys at all gives 0 and -inf on every row
    seqlens_q, seqlens_k = [10, 6, 4], [4, 0, 4]
    (q, k, v), do, cu_q, cu_k = packed_inputs(seqlens_q, seqlens_k, 2, 2, 16, torch.float32, seed=41)
    out, lse, _ = flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 10, 4, causal=True, return_attn_probs=True)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), do)
    empty = torch.zeros(len(q), dtype=torch.bool, device=DEVICE)
    empty[:6] = True  # sequence 0: rows 0..5 see nothing
    empty[10:16] = True  # sequence 1: no keys
    assert (out[empty] == 0).all() and torch.isneginf(lse[:, empty]).all() and (dq[empty] == 0).all()
    assert torch.isfinite(lse[:, ~empty]).all()
    for t in (out, dq, dk, dv):
        assert torch.isfinite(t).all()


def test_varlen_all_empty(backend):
    (q, k, v), do, cu_q, cu_k = packed_inputs([0, 0], [0, 3], 2, 1, 16, torch.float16, seed=42)
    out, lse, _ = flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 0, 3, return_attn_probs=True)
    assert out.shape == (0, 2, 16) and lse.shape == (2, 0)
    dk, dv = torch.autograd.grad(out, (k, v), do)
    assert (dk == 0).all() and (dv == 0).all()


def test_varlen_dropout_matches_reference_with_the_seed(backend):
    # The dropout counter of a packed batch uses the sequence index as the batch index and
    # positions within the sequence: checked through the custom op, which takes the seed.
    (q, k, v), _, cu_q, cu_k = packed_inputs(SEQLENS_Q, SEQLENS_K, 2, 1, 32, torch.float32, seed=43)
    q, k, v = (t.detach() for t in (q, k, v))
    seed, dropout_p = 2**35 + 17, 0.25
    seed_tensor = torch.tensor([seed], dtype=torch.int64, device=DEVICE)
    tensors = AttentionTensors(dropout_seed=seed_tensor, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    options = AttentionOptions(0.3, window_right=0, dropout_p=dropout_p, max_seqlen_q=max(SEQLENS_Q),
                               max_seqlen_k=max(SEQLENS_K))
    out, lse = torch.ops.flashtile.fwd(q, k, v, *tensors, *options)
    ref_out, ref_lse = ref.varlen_attention_forward(q.double(), k.double(), v.double(), cu_q, cu_k, 0.3,
                                                    causal=True, dropout_p=dropout_p, dropout_seed=seed)
    torch.testing.assert_close(out.double(), ref_out, rtol=0, atol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=0, atol=1e-5)


def test_varlen_dropout_is_reproducible_from_torch_manual_seed(backend):
    seqlens_q, seqlens_k = [9, 1, 30], [17, 1, 30]
    (q, k, v), do, cu_q, cu_k = packed_inputs(seqlens_q, seqlens_k, 2, 1, 16, torch.bfloat16, seed=44)

    def run(seed):
        torch.manual_seed(seed)
        out = flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 30, 30, dropout_p=0.3)
        return (out, *torch.autograd.grad(out, (q, k, v), do))

    first, second = run(5), run(5)
    for a, b in zip(first, second):
        assert torch.equal(a, b)
    assert not torch.equal(first[0], run(6)[0])


def test_varlen_dropout_returns_s_dmask(backend):
    # flash-attn 2's varlen S_dmask: (batch, nheads, max_seqlen_q, max_seqlen_k), each sequence's
    # probabilities in its corner, dropped entries negated, 0 elsewhere; it reproduces the output
    seqlens_q, seqlens_k = [9, 0, 30], [17, 4, 30]
    (q, k, v), _, cu_q, cu_k = packed_inputs(seqlens_q, seqlens_k, 2, 1, 16, torch.float32, seed=45)
    dropout_p = 0.25
    out, _, probs = flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 30, 30, dropout_p=dropout_p, causal=True,
                                                     return_attn_probs=True)
    assert probs.shape == (3, 2, 30, 30) and probs.dtype == q.dtype
    for b, (seqlen_q, seqlen_k) in enumerate(zip(seqlens_q, seqlens_k)):
        corner = probs[b, :, :seqlen_q, :seqlen_k]
        outside = probs[b].clone()
        outside[:, :seqlen_q, :seqlen_k] = 0
        assert (outside == 0).all()
        if seqlen_q == 0:
            continue
        rows_q, rows_k = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        kept = torch.where(torch.signbit(corner), 0.0, corner) / (1 - dropout_p)  # [H, Nq, Nk]
        expected = kept @ v[rows_k].detach().transpose(0, 1).expand(2, seqlen_k, 16)  # MQA: one KV head
        torch.testing.assert_close(out[rows_q].detach(), expected.transpose(0, 1), rtol=0, atol=1e-5)


# ----------------------------------------------------------------------------------------------
# Packed conveniences: the same results as the unpacked call, the gradient packed like the input

OPTIONS = dict(causal=True, window_size=(20, -1), softcap=5.0)


def _assert_same(packed_out, packed_grad, out, grads, stack_dim):
    torch.testing.assert_close(packed_out, out, rtol=0, atol=0)
    torch.testing.assert_close(packed_grad, torch.stack(grads, dim=stack_dim), rtol=0, atol=0)


def test_qkvpacked_equals_unpacked(backend):
    g = torch.Generator().manual_seed(45)
    qkv = torch.randn(2, 57, 3, 2, 32, generator=g).to(DEVICE, torch.float16).requires_grad_()
    do = torch.randn(2, 57, 2, 32, generator=g).to(DEVICE, torch.float16)
    out, lse, _ = flashtile.flash_attn_qkvpacked_func(qkv, return_attn_probs=True, **OPTIONS)
    (dqkv,) = torch.autograd.grad(out, qkv, do)
    assert dqkv.shape == qkv.shape
    q, k, v = (t.detach().clone().requires_grad_() for t in qkv.unbind(2))
    ref_out, ref_lse, _ = flashtile.flash_attn_func(q, k, v, return_attn_probs=True, **OPTIONS)
    _assert_same(out, dqkv, ref_out, torch.autograd.grad(ref_out, (q, k, v), do), stack_dim=2)
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=0)


def test_kvpacked_equals_unpacked(backend):
    q, k, v, do = make_inputs(2, 41, 66, 4, 2, 32, torch.bfloat16, seed=46)
    kv = torch.stack((k.detach(), v.detach()), dim=2).requires_grad_()  # [B, Nk, 2, Hk, D]
    out = flashtile.flash_attn_kvpacked_func(q, kv, **OPTIONS)
    dq_packed, dkv = torch.autograd.grad(out, (q, kv), do)
    assert dkv.shape == kv.shape
    ref_out = flashtile.flash_attn_func(q, k, v, **OPTIONS)
    dq, dk, dv = torch.autograd.grad(ref_out, (q, k, v), do)
    _assert_same(out, dkv, ref_out, (dk, dv), stack_dim=2)
    torch.testing.assert_close(dq_packed, dq, rtol=0, atol=0)


def test_varlen_qkvpacked_equals_unpacked(backend):
    seqlens = [5, 1, 40, 0, 12]
    (q, k, v), do, cu, _ = packed_inputs(seqlens, seqlens, 2, 2, 24, torch.float16, seed=47)
    qkv = torch.stack([t.detach() for t in (q, k, v)], dim=1).requires_grad_()  # [total, 3, H, D]
    out = flashtile.flash_attn_varlen_qkvpacked_func(qkv, cu, max(seqlens), **OPTIONS)
    (dqkv,) = torch.autograd.grad(out, qkv, do)
    assert dqkv.shape == qkv.shape
    ref_out = flashtile.flash_attn_varlen_func(q, k, v, cu, cu, max(seqlens), max(seqlens), **OPTIONS)
    _assert_same(out, dqkv, ref_out, torch.autograd.grad(ref_out, (q, k, v), do), stack_dim=1)


def test_varlen_kvpacked_equals_unpacked(backend):
    (q, k, v), do, cu_q, cu_k = packed_inputs(SEQLENS_Q, SEQLENS_K, 4, 2, 24, torch.float16, seed=48)
    kv = torch.stack((k.detach(), v.detach()), dim=1).requires_grad_()  # [total_k, 2, Hk, D]
    out, lse, _ = flashtile.flash_attn_varlen_kvpacked_func(q, kv, cu_q, cu_k, max(SEQLENS_Q), max(SEQLENS_K),
                                                            return_attn_probs=True, **OPTIONS)
    dq_packed, dkv = torch.autograd.grad(out, (q, kv), do)
    assert dkv.shape == kv.shape and lse.shape == (4, len(q))
    ref_out, ref_lse, _ = flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(SEQLENS_Q), max(SEQLENS_K),
                                                           return_attn_probs=True, **OPTIONS)
    dq, dk, dv = torch.autograd.grad(ref_out, (q, k, v), do)
    _assert_same(out, dkv, ref_out, (dk, dv), stack_dim=1)
    torch.testing.assert_close(dq_packed, dq, rtol=0, atol=0)
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=0)


@pytest.mark.parametrize(
    "make, error, message",
    [
        (lambda cu: dict(cu_seqlens_q=cu.long()), TypeError, "cu_seqlens_q must be a 1-D int32 tensor"),
        (lambda cu: dict(cu_seqlens_k=cu[:-1]), ValueError, "same length"),
        (lambda cu: dict(max_seqlen_q=2.5), TypeError, "max_seqlen_q"),
        (lambda cu: dict(window_size=(1, -3)), ValueError, "window_size"),
        (lambda cu: dict(alibi_slopes=torch.ones(3, 2, device=DEVICE)), ValueError, "alibi_slopes"),
    ],
    ids=["cu-dtype", "cu-length", "max-seqlen-float", "window", "alibi-batch"],
)
def test_varlen_bad_arguments_raise(make, error, message):
    (q, k, v), _, cu, _ = packed_inputs([3, 4], [3, 4], 2, 2, 16, torch.float16, seed=49)
    kwargs = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=4, max_seqlen_k=4)
    kwargs.update(make(cu))
    with pytest.raises(error, match=message):
        flashtile.flash_attn_varlen_func(q, k, v, **kwargs)
    assert torch.isfinite(flashtile.flash_attn_varlen_func(q, k, v, cu, cu, 4, 4)).all()
