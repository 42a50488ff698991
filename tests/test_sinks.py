"""Attention sinks (``learnable_sink``, gpt-oss's one logit per head) in every entry point.

The specification is the reference's: the sink is one more column of every row's scores, after
scale, softcap, ALiBi, bias and masking, with no value; L = log(exp(sink) + Σ exp(s)); a row
that sees no key gives 0 and L = sink; d sink = −Σ exp(sink − L) · rowsum(dO ∘ O). The first
tests pin that specification to independent forms (a zero key with the sink as its bias; the
no-sink result rescaled); the rest judge flashtile's paths against it by flash-attn's rule,
the sink's gradient included, on rows that see every key, some or none. The KV-cache cases
(split-KV counts the sink once) are in test_decode.py, the transformers model (gpt-oss) in
test_transformers.py.

Grids are small because the interpreter runs each program in numpy: ~40 s on 2 CPU cores.
"""

import math

import pytest
import torch
from helpers import (DEVICE, assert_accurate, make_inputs, packed_inputs, references, to_reference,
                     with_descriptor_loads)

import flashtile
from flashtile import reference as ref
from flashtile.ops import attention_backward, attention_forward


def sinks(nheads, seed=0):
    """float32 (nheads,): spread logits, one that dominates a row (8) and one that all but vanishes (−30)."""
    values = 2.0 * torch.randn(nheads, generator=torch.Generator().manual_seed(seed))
    values[0] = 8.0
    if nheads > 2:
        values[-1] = -30.0
    return values.to(DEVICE)


# ----------------------------------------------------------------------------------------------
# The specification


def test_reference_sink_is_a_key_with_zero_value_and_the_sink_as_its_score():
    q, k, v, _ = (t.detach().double() for t in make_inputs(2, 9, 13, 4, 2, 16, torch.float64, seed=1))
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, N, D]
    sink = sinks(4).double()
    out, lse, _ = ref.attention_forward(q, k, v, softmax_scale=0.4, softcap=3.0, learnable_sink=sink)
    # one more key: k = 0 gives a score of 0, the bias lifts it to the sink; v = 0 adds nothing
    zero = torch.zeros(2, 2, 1, 16, dtype=torch.float64, device=DEVICE)
    bias = torch.zeros(2, 4, 9, 14, dtype=torch.float64, device=DEVICE)
    bias[..., 0] = sink.view(1, 4, 1)
    expected, expected_lse, _ = ref.attention_forward(q, torch.cat([zero, k], 2), torch.cat([zero, v], 2),
                                                      softmax_scale=0.4, softcap=3.0, attn_bias=bias)
    # softcap bends the zero score to 0 too (c · tanh(0) = 0) before the bias is added
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(lse, expected_lse, rtol=0, atol=1e-12)


@pytest.mark.parametrize("options", [dict(causal=True), dict(window_size=(3, 0), alibi_slopes="per-head")],
                         ids=["causal", "window-alibi"])
def test_reference_sink_rescales_the_result_without_it(options):
    # 17 queries, 6 keys, bottom-right causal: rows 0..10 see no key (o = 0, L = sink)
    q, k, v, do = (t.detach().double() for t in make_inputs(1, 17, 6, 4, 4, 8, torch.float64, seed=2))
    q, k, v, do = (t.transpose(1, 2) for t in (q, k, v, do))
    if options.get("alibi_slopes") == "per-head":
        options = {**options, "alibi_slopes": torch.rand(4, generator=torch.Generator().manual_seed(3)).to(DEVICE)}
    sink = sinks(4).double().requires_grad_()
    out, lse, _ = ref.attention_forward(q, k, v, learnable_sink=sink, **options)
    plain_out, plain_lse, _ = ref.attention_forward(q, k, v, **options)
    expected_lse = torch.logaddexp(plain_lse, sink.detach().view(1, 4, 1))
    torch.testing.assert_close(lse, expected_lse, rtol=0, atol=1e-12)
    torch.testing.assert_close(out, plain_out * torch.exp(plain_lse - expected_lse)[..., None], rtol=0, atol=1e-12)
    assert torch.isneginf(plain_lse).any() and (out[torch.isneginf(plain_lse)] == 0).all()
    # the gradient's closed form, as the library computes it, against autograd of the reference
    (dsink,) = torch.autograd.grad(out, sink, do)
    layout = (0, 2, 1, 3)  # output_delta takes flash-attn's layout [B, N, H, D]
    delta = ref.output_delta(do.permute(layout), out.detach().permute(layout), varlen=False)
    closed = ref.sink_gradient(delta, lse.detach(), sink.detach(), False)
    # output_delta forms D = rowsum(dO ∘ O) in float32 (as the kernels do): a few float32 ulps
    torch.testing.assert_close(closed.double(), dsink, rtol=1e-6, atol=1e-9)


def test_tiled_reference_matches_the_standard_one():
    q, k, v, _ = (t.detach().float().transpose(1, 2) for t in make_inputs(2, 50, 37, 4, 2, 16, torch.float32, 4))
    sink = sinks(4)
    out, lse, _ = ref.attention_forward(q, k, v, causal=True, learnable_sink=sink)
    tiled_out, tiled_lse = ref.tiled_attention_forward(q, k, v, causal=True, learnable_sink=sink, block_m=16,
                                                       block_n=8)
    torch.testing.assert_close(tiled_out, out, rtol=0, atol=2e-6)
    torch.testing.assert_close(tiled_lse, lse, rtol=0, atol=2e-6)


# ----------------------------------------------------------------------------------------------
# flashtile against the specification


def check_with_sink(out, lse, grads, ref64, ref_lowp):
    """out, lse and the four gradients against the references; every row's lse is finite (the sink)."""
    assert_accurate("out", out, ref64[0], ref_lowp[0], factor=2)
    assert torch.isfinite(lse).all()
    torch.testing.assert_close(lse.double(), ref64[1], rtol=0, atol=1e-5)
    for name, got, r64, rlow in zip(("dq", "dk", "dv", "dsink"), grads, ref64[2:], ref_lowp[2:]):
        assert got.shape == r64.shape, name
        assert_accurate(name, got, r64, rlow, factor=3)


SHAPES = {  # (batch, seqlen_q, seqlen_k, nheads_q, nheads_k, head_dim, dtype)
    "gqa-q61-k97-fp16": (2, 61, 97, 4, 2, 40, torch.float16),
    "mqa-q97-k45-bf16": (1, 97, 45, 4, 1, 64, torch.bfloat16),  # causal: rows 0..51 see nothing
}
VARIANTS = {
    "plain": lambda h: {},
    "window-softcap-alibi": lambda h: dict(window_size=(24, 6), softcap=4.0, softmax_scale=0.3,
                                           alibi_slopes=2.0 ** (-8.0 * torch.arange(1, h + 1) / h).to(DEVICE)),
}


@with_descriptor_loads
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
@pytest.mark.parametrize("variant", VARIANTS)
def test_flash_attn_func_with_sink(backend, variant, shape, causal):
    *dims, dtype = shape
    q, k, v, do = make_inputs(*dims, dtype, seed=5)
    sink = sinks(dims[3]).requires_grad_()
    options = dict(causal=causal, **VARIANTS[variant](dims[3]))
    out, lse, _ = flashtile.flash_attn_func(q, k, v, learnable_sink=sink, return_attn_probs=True, **options)
    grads = torch.autograd.grad(out, (q, k, v, sink), do)
    assert grads[3].dtype == torch.float32
    check_with_sink(out, lse, grads, *references(q, k, v, do, learnable_sink=sink, **options))


def test_rows_that_see_nothing_give_zero_and_the_sink(backend):
    q, k, v, do = make_inputs(1, 12, 4, 2, 2, 16, torch.float32, seed=6)
    sink = sinks(2).requires_grad_()
    out, lse, _ = flashtile.flash_attn_func(q, k, v, causal=True, learnable_sink=sink, return_attn_probs=True)
    dq, dsink = torch.autograd.grad(out, (q, sink), do)
    assert (out[:, :8] == 0).all() and (dq[:, :8] == 0).all()  # bottom-right: rows 0..7 see no key
    torch.testing.assert_close(lse[..., :8], sink.detach().view(1, 2, 1).expand(1, 2, 8), rtol=0, atol=1e-6)
    # no keys at all: the same, and the sink's gradient is 0 (its rows' outputs are constant 0)
    out, lse, _ = flashtile.flash_attn_func(q, k[:, :0], v[:, :0], learnable_sink=sink, return_attn_probs=True)
    (dsink,) = torch.autograd.grad(out, sink, do)
    assert (out == 0).all() and torch.equal(lse, sink.detach().view(1, 2, 1).expand(1, 2, 12))
    assert (dsink == 0).all()


def test_sink_without_grad_and_packed_inputs(backend):
    q, k, v, do = make_inputs(2, 19, 19, 4, 4, 16, torch.bfloat16, seed=7)
    sink = sinks(4)  # a constant: no gradient asked for it
    out = flashtile.flash_attn_func(q, k, v, causal=True, learnable_sink=sink)
    grads = torch.autograd.grad(out, (q, k, v), do)
    qkv = torch.stack([q, k, v], dim=2).detach().requires_grad_()
    packed = flashtile.flash_attn_qkvpacked_func(qkv, causal=True, learnable_sink=sink)
    assert torch.equal(packed, out)
    assert torch.equal(torch.autograd.grad(packed, qkv, do)[0], torch.stack(grads, dim=2))
    kv = torch.stack([k, v], dim=2).detach()
    assert torch.equal(flashtile.flash_attn_kvpacked_func(q, kv, causal=True, learnable_sink=sink), out)


def test_varlen_with_sink(backend):
    # sequences with no keys (rows give 0 and L = sink) and with no queries, causal, GQA
    seqlens_q, seqlens_k = [3, 0, 5, 40, 1], [7, 4, 0, 30, 1]
    (q, k, v), do, cu_q, cu_k = packed_inputs(seqlens_q, seqlens_k, 4, 2, 24, torch.float16, seed=8)
    sink = sinks(4).requires_grad_()
    out, lse, _ = flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(seqlens_q), max(seqlens_k), causal=True,
                                                   learnable_sink=sink, return_attn_probs=True)
    grads = torch.autograd.grad(out, (q, k, v, sink), do)
    refs = []
    for dtype in (torch.float64, torch.float16):
        qr, kr, vr = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
        sr = sink.detach().to(dtype).requires_grad_()
        ref_out, ref_lse = ref.varlen_attention_forward(qr, kr, vr, cu_q, cu_k, causal=True, learnable_sink=sr)
        refs.append([ref_out, ref_lse, *torch.autograd.grad(ref_out, (qr, kr, vr, sr), do.to(dtype))])
    check_with_sink(out, lse, grads, *refs)
    assert (out[3:8] == 0).all()  # the sequence with no keys


def test_dropout_leaves_the_sink_undropped(backend):
    # through the operators, which take the seed: forward and backward against the reference's mask
    q, k, v, do = (t.detach() for t in make_inputs(1, 33, 40, 2, 1, 16, torch.float32, seed=9))
    sink, seed, dropout_p = sinks(2), 2**33 + 5, 0.3
    out, lse = attention_forward(q, k, v, 0.25, True, dropout_p=dropout_p, dropout_seed=seed, learnable_sink=sink)
    grads = attention_backward(do, q, k, v, out, lse, 0.25, True, dropout_p=dropout_p, dropout_seed=seed)
    qr, kr, vr = (to_reference(t, torch.float64).requires_grad_() for t in (q, k, v))
    ref_out, ref_lse, _ = ref.attention_forward(qr, kr, vr, 0.25, True, dropout_p=dropout_p, dropout_seed=seed,
                                                learnable_sink=sink.double())
    ref_grads = torch.autograd.grad(ref_out, (qr, kr, vr), do.transpose(1, 2).double())
    torch.testing.assert_close(out.double(), ref_out.transpose(1, 2), rtol=0, atol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=0, atol=1e-5)
    for name, got, expected in zip(("dq", "dk", "dv"), grads, ref_grads):
        torch.testing.assert_close(got.double(), expected.transpose(1, 2), rtol=0, atol=1e-5, msg=name)


@pytest.mark.parametrize("packed", [False, True], ids=["batch", "varlen"])
def test_returned_dropout_probabilities_are_those_the_output_used(backend, packed):
    # S_dmask holds the probabilities the output was computed with, so out = (S⁺ / (1 − p)) V: with a sink
    # its share of each row is not among the keys' (the rows sum to 1 − exp(sink − L), not to 1)
    q, k, v, _ = (t.detach() for t in make_inputs(1, 7, 9, 2, 2, 16, torch.float32, seed=11))
    sink, dropout_p = torch.tensor([3.0, -1.0], device=DEVICE), 0.2
    if packed:
        cu = torch.tensor([0, 7], dtype=torch.int32, device=DEVICE)
        cu_k = torch.tensor([0, 9], dtype=torch.int32, device=DEVICE)
        out, lse, probs = flashtile.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu_k, 7, 9, dropout_p=dropout_p,
                                                           learnable_sink=sink, return_attn_probs=True)
        out, lse = out[None], lse[None]
    else:
        out, lse, probs = flashtile.flash_attn_func(q, k, v, dropout_p=dropout_p, learnable_sink=sink,
                                                    return_attn_probs=True)
    torch.testing.assert_close(probs.abs().sum(-1), 1 - torch.exp(sink[:, None] - lse), rtol=0, atol=1e-5)
    recomposed = (probs.clamp(min=0) / (1 - dropout_p)) @ v.transpose(1, 2)  # [B, H, Nq, D]
    torch.testing.assert_close(out, recomposed.transpose(1, 2), rtol=0, atol=1e-5)


def test_attention_takes_the_sink_by_keyword(backend):
    q, k, v, do = (t.transpose(1, 2) for t in make_inputs(2, 14, 21, 4, 2, 16, torch.float32, seed=10))
    mask = torch.rand(14, 21, generator=torch.Generator().manual_seed(11)).to(DEVICE) > 0.3
    mask[3] = False  # a row that sees nothing: 0, and the sink alone in its denominator
    sink = sinks(4).requires_grad_()
    out = flashtile.attention(q, k, v, attn_mask=mask, enable_gqa=True, learnable_sink=sink)
    grads = torch.autograd.grad(out, (q, k, v, sink), do)
    qr, kr, vr = (t.detach().double().requires_grad_() for t in (q, k, v))
    sr = sink.detach().double().requires_grad_()
    expected, _, _ = ref.attention_forward(qr, kr, vr, attn_bias=mask, learnable_sink=sr)
    expected_grads = torch.autograd.grad(expected, (qr, kr, vr, sr), do.double())
    torch.testing.assert_close(out.double(), expected, rtol=0, atol=1e-5)
    assert (out[:, :, 3] == 0).all()
    for name, got, r in zip(("dq", "dk", "dv", "dsink"), grads, expected_grads):
        torch.testing.assert_close(got.double(), r, rtol=0, atol=1e-4, msg=name)


@pytest.mark.parametrize(
    "sink, error, message",
    [(torch.zeros(4, dtype=torch.float16), TypeError, "learnable_sink must be a float32 tensor"),
     ([0.0] * 4, TypeError, "learnable_sink must be a float32 tensor"),
     (torch.zeros(2), ValueError, r"learnable_sink must have shape \(4,\)"),
     (torch.zeros(1, 4), ValueError, r"learnable_sink must have shape \(4,\)")],
    ids=["float16", "list", "per-kv-head", "2-d"],
)
def test_bad_sinks_raise_clear_errors(sink, error, message):
    q, k, v, _ = make_inputs(1, 5, 5, 4, 2, 16, torch.float16)
    sink = sink.to(DEVICE) if isinstance(sink, torch.Tensor) else sink
    with pytest.raises(error, match=message):
        flashtile.flash_attn_func(q, k, v, learnable_sink=sink)
    with pytest.raises(error, match=message):
        flashtile.flash_attn_with_kvcache(q.detach(), k.detach(), v.detach(), learnable_sink=sink)
    with pytest.raises(error, match=message):
        flashtile.flash_attn_varlen_func(q[0], k[0], v[0], *[torch.tensor([0, 5], dtype=torch.int32, device=DEVICE)] * 2,
                                         5, 5, learnable_sink=sink)


def test_sink_gradient_is_the_closed_form_sum():
    # one row, one head: d sink = −exp(sink − L) · (dO · O), by hand
    out = torch.tensor([[[[0.5, -1.0]]]])  # [B=1, N=1, H=1, D=2]
    dout = torch.tensor([[[[2.0, 3.0]]]])
    lse = torch.tensor([[[1.25]]])
    sink = torch.tensor([0.5])
    expected = -math.exp(0.5 - 1.25) * (0.5 * 2.0 - 1.0 * 3.0)
    delta = ref.output_delta(dout, out, varlen=False)
    torch.testing.assert_close(ref.sink_gradient(delta, lse, sink, varlen=False), torch.tensor([expected]))
