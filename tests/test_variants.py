"""Attention variants through the public API against the float64 reference, by flash-attn's rule.

Sliding window, softcap and ALiBi through ``flash_attn_func``; an additive bias or a
boolean mask through ``flashtile.attention`` (SDPA's ``attn_mask``); dropout through
both and through ``flashtile.ops.attention_forward`` with an explicit seed. Each
variant runs with causal, GQA and seqlen_q ≠ seqlen_k, forward and backward.

Grids are kept small because the interpreter runs each program in numpy: this file
takes ~35 s on 2 CPU cores (both backends; ~50 s when the cores are shared), and
with test_varlen.py and test_reference.py about a minute.
"""

import math

import numpy as np
import pytest
import torch
from helpers import (DEVICE, assert_accurate, check_flash_attn_func, check_outputs, make_inputs, references,
                     to_reference, with_descriptor_loads)

import flashtile
from flashtile import _validate
from flashtile import reference as ref
from flashtile.ops import attention_forward as ops_attention_forward


# ----------------------------------------------------------------------------------------------
# Sliding window, softcap, ALiBi

# (batch, seqlen_q, seqlen_k, nheads_q, nheads_k, head_dim, dtype): GQA with Nq < Nk, and
# Nq > Nk (rows that see nothing under causal) with MQA in bfloat16
SHAPES = {
    "gqa-q61-k97-fp16": (2, 61, 97, 2, 1, 40, torch.float16),
    "mqa-q97-k45-bf16": (1, 97, 45, 2, 1, 64, torch.bfloat16),
}


def _slopes(*shape):
    # ALiBi's geometric slopes, 2^(-8 h / H), and a different set per batch entry
    nheads = shape[-1]
    slopes = 2.0 ** (-8.0 * torch.arange(1, nheads + 1) / nheads)
    if len(shape) == 2:
        slopes = slopes * torch.linspace(1.0, 0.5, shape[0])[:, None]
    return slopes.float().to(DEVICE)


VARIANTS = {
    "window-7-3": lambda b, h: dict(window_size=(7, 3)),
    "window-left-20": lambda b, h: dict(window_size=(20, -1)),
    "window-right-5": lambda b, h: dict(window_size=(-1, 5)),
    "softcap": lambda b, h: dict(softcap=1.5),
    "alibi": lambda b, h: dict(alibi_slopes=_slopes(h)),
    "alibi-per-batch": lambda b, h: dict(alibi_slopes=_slopes(b, h)),
    "all": lambda b, h: dict(window_size=(24, 6), softcap=4.0, alibi_slopes=_slopes(h), softmax_scale=0.3),
}


@with_descriptor_loads
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
@pytest.mark.parametrize("variant", VARIANTS)
def test_variant_against_reference(backend, variant, shape, causal):
    *dims, dtype = shape
    q, k, v, do = make_inputs(*dims, dtype, seed=20)
    check_flash_attn_func(q, k, v, do, causal=causal, **VARIANTS[variant](dims[0], dims[3]))


def test_alibi_in_float32(backend):
    # float32: PyTorch's own error is small, so the bound is tight on the ALiBi term itself
    q, k, v, do = make_inputs(2, 45, 70, 4, 4, 32, torch.float32, seed=21)
    check_flash_attn_func(q, k, v, do, causal=True, alibi_slopes=_slopes(2, 4))


WINDOW_EDGES = {
    "narrower-than-a-block": (2, 1),
    "wider-than-the-sequence": (500, 500),
    "huge-left-causal": (10_000, 0),
    "right-only-narrow": (-1, 1),
}


@pytest.mark.parametrize("window", WINDOW_EDGES.values(), ids=WINDOW_EDGES.keys())
def test_window_edges(backend, window):
    q, k, v, do = make_inputs(1, 150, 140, 1, 1, 32, torch.float16, seed=22)
    check_flash_attn_func(q, k, v, do, window_size=window)


def test_window_outside_the_keys_gives_zero_and_neg_inf(backend):
    # seqlen_q = 100 > seqlen_k = 30: query i sees keys [i − 75, i − 67], so rows 0..66 see nothing
    q, k, v, do = make_inputs(1, 100, 30, 2, 1, 32, torch.float16, seed=23)
    out, lse = check_flash_attn_func(q, k, v, do, window_size=(5, 3))
    dq = torch.autograd.grad(flashtile.flash_attn_func(q, k, v, window_size=(5, 3)), q, do)[0]
    assert (out[:, :67] == 0).all() and torch.isneginf(lse[:, :, :67]).all()
    assert torch.isfinite(lse[:, :, 67:]).all() and (dq[:, :67] == 0).all() and torch.isfinite(dq).all()


# ----------------------------------------------------------------------------------------------
# Additive bias and boolean masks: flashtile.attention (SDPA layout)


def _sdpa_inputs(seed, batch=2, nheads=4, nheads_k=2, seqlen_q=45, seqlen_k=77, head_dim=32, dtype=torch.float16):
    q, k, v, do = make_inputs(batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, dtype, seed=seed)
    return q, k, v, do  # flash-attn layout; the test hands transposed views to attention()


def _bias(kind, batch, nheads, seqlen_q, seqlen_k, dtype):
    g = torch.Generator().manual_seed(24)
    if kind == "float-full":
        return torch.randn(batch, nheads, seqlen_q, seqlen_k, generator=g).to(DEVICE, dtype)
    if kind == "float-per-key":  # (Nk,): broadcast over batch, heads and queries
        return torch.randn(seqlen_k, generator=g).to(DEVICE, dtype)
    if kind == "float-per-batch-query":
        return torch.randn(batch, 1, seqlen_q, 1, generator=g).to(DEVICE, dtype)
    if kind == "float-padding":  # SDPA's padding mask: -inf on the last keys of batch entry 1
        bias = torch.zeros(batch, 1, 1, seqlen_k, dtype=dtype)
        bias[1, ..., seqlen_k - 20:] = -math.inf
        return bias.to(DEVICE)
    if kind == "bool":
        return (torch.rand(batch, 1, seqlen_q, seqlen_k, generator=g) > 0.4).to(DEVICE)
    if kind == "bool-padding":  # a key-padding mask (no gradient): broadcast over heads and queries
        keep = torch.ones(batch, 1, 1, seqlen_k, dtype=torch.bool)
        keep[1, ..., seqlen_k - 20:] = False
        return keep.to(DEVICE)
    if kind == "bool-causal-band":  # the mask form of a causal window, with empty rows
        return ref.visible_mask(seqlen_q, seqlen_k, causal=True, window_size=(10, 0), device=DEVICE)
    raise ValueError(kind)


BIASES = ["float-full", "float-per-key", "float-per-batch-query", "float-padding", "bool", "bool-padding",
          "bool-causal-band"]


@with_descriptor_loads
@pytest.mark.parametrize("seqlens", [(45, 77), (77, 45)], ids=lambda s: f"q{s[0]}-k{s[1]}")
@pytest.mark.parametrize("kind", BIASES)
def test_attn_mask_against_reference(backend, kind, seqlens):
    check_attn_mask(kind, *_sdpa_inputs(25, seqlen_q=seqlens[0], seqlen_k=seqlens[1]))


@with_descriptor_loads
@pytest.mark.parametrize("head_dim", [64, 128, 256], ids=lambda d: f"d{d}")
def test_attn_mask_at_each_head_dim_class(backend, head_dim):
    # each head-dim class has its own block config; on the GPU the bias tiles must fit in
    # shared memory beside K and V (hdim 128 once asked for 288 KiB of the H200's 227 KiB)
    check_attn_mask("float-full", *_sdpa_inputs(30, batch=1, seqlen_q=70, seqlen_k=140, head_dim=head_dim,
                                                dtype=torch.bfloat16))


def check_attn_mask(kind, q, k, v, do):
    seqlens = (q.shape[1], k.shape[1])
    mask = _bias(kind, q.shape[0], q.shape[2], *seqlens, q.dtype)
    floating = mask.dtype != torch.bool
    if floating:
        mask.requires_grad_()
    out = flashtile.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                              scale=0.2, enable_gqa=True).transpose(1, 2)
    inputs = (q, k, v, mask) if floating else (q, k, v)
    grads = torch.autograd.grad(out, inputs, do)
    results = []
    for dtype in (torch.float64, q.dtype):
        qr, kr, vr = (to_reference(t, dtype).requires_grad_() for t in (q, k, v))
        bias = mask.detach().to(dtype).requires_grad_() if floating else mask
        ref_out, _, _ = ref.attention_forward(qr, kr, vr, softmax_scale=0.2, attn_bias=bias)
        ref_grads = torch.autograd.grad(ref_out, (qr, kr, vr, bias) if floating else (qr, kr, vr),
                                        do.transpose(1, 2).to(dtype))
        results.append([ref_out.transpose(1, 2)] + [g.transpose(1, 2) for g in ref_grads[:3]] + list(ref_grads[3:]))
    ref64, ref_lowp = results
    assert_accurate("out", out, ref64[0], ref_lowp[0], factor=2)
    for name, got, r64, rlow in zip(("dq", "dk", "dv", "dmask"), grads, ref64[1:], ref_lowp[1:]):
        assert got.shape == r64.shape and got.dtype == rlow.dtype, name
        assert torch.isfinite(got).all(), name
        assert_accurate(name, got, r64, rlow, factor=3)


def test_attn_mask_matches_torch_sdpa(backend):
    q, k, v, _ = _sdpa_inputs(26, seqlen_q=33, seqlen_k=50, dtype=torch.float32)
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    for mask in (_bias("float-full", 2, 4, 33, 50, torch.float32), _bias("bool", 2, 4, 33, 50, torch.float32)):
        out = flashtile.attention(qt, kt, vt, attn_mask=mask, enable_gqa=True)
        expected = torch.nn.functional.scaled_dot_product_attention(
            qt.double(), kt.double(), vt.double(), attn_mask=mask if mask.dtype == torch.bool else mask.double(),
            enable_gqa=True)
        torch.testing.assert_close(out.double(), expected, rtol=0, atol=1e-5)


@pytest.mark.skipif(DEVICE != "cpu", reason="the CPU path")
def test_cpu_gqa_padding_mask_reaches_the_kernel_unrepeated(monkeypatch):
    # the CPU path folds each GQA group's query heads into the rows of its KV head (cpu._Layout); a mask of
    # one row (a key-padding mask, as transformers' decoding steps pass) is broadcast over the folded rows
    # by PyTorch's kernel itself: no copy of it per call, and the same bits as the same mask written out
    # row by row, which is repeated over the group. Batch entry 1 sees no key at all.
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q, k, v, do = make_inputs(2, 3, 40, 8, 2, 32, torch.float32, seed=31)
    padding = torch.ones(2, 1, 1, 40, dtype=torch.bool)
    padding[0, ..., :15] = False
    padding[1] = False

    def run(mask):
        out = flashtile.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                  enable_gqa=True)
        return out, torch.autograd.grad(out, (q, k, v), do.transpose(1, 2))

    with torch.profiler.profile() as profile:
        out, grads = run(padding)
    assert "aten::repeat" not in {event.name for event in profile.events()}
    expected_out, expected_grads = run(padding.expand(2, 1, 3, 40).contiguous())
    assert torch.equal(out, expected_out) and (out[1] == 0).all()
    for got, expected in zip(grads, expected_grads):
        assert torch.equal(got, expected)


@pytest.mark.skipif(DEVICE != "cpu", reason="the CPU path")
@pytest.mark.parametrize("case, is_sdpas", [
    ("padding-gqa", True), ("padding-gqa-grad", False), ("head-mask-gqa", True), ("causal-square", True),
    ("causal-q1", True), ("causal-q3-k40", False), ("float-mask-grad", False), ("float-mask-other-dtype", False),
    ("dropout", False), ("sink", False), ("padding-bf16-grad", False), ("long-bf16-grad", True),
    ("short-bf16-grad", False),
])
def test_cpu_attention_is_sdpas_own_call_where_that_computes_it(monkeypatch, cpu_16bit_arithmetic, case, is_sdpas):
    # flashtile.attention on the CPU path hands a call to PyTorch's SDPA where SDPA computes it as flashtile
    # does (cpu.sdpa_attention): a padded decoding step costs SDPA's time. Bottom-right causal with one
    # query is SDPA's full attention; the other cases keep flashtile's own path. Either way the result is
    # flashtile's: checked against the float64 reference.
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda *args, **kwargs: calls.append(args) or sdpa(*args, **kwargs))
    seqlen_q = {"causal-q1": 1, "causal-q3-k40": 3, "causal-square": 40}.get(case, 3)
    nheads_k = 2 if "gqa" in case else 8
    # 16-bit calls that want gradients stay SDPA's only where flashtile's backward runs in 16 bits too: no
    # mask, sequences longer than cpu.SHORT_BACKWARD_SEQLEN, a CPU with 16-bit arithmetic
    is_sdpas = is_sdpas and (cpu_16bit_arithmetic or case != "long-bf16-grad")
    seqlen_k = 200 if case.startswith("long") else 40
    seqlen_q = 200 if case.startswith("long") else seqlen_q
    dtype = torch.bfloat16 if "bf16" in case else torch.float32
    q, k, v, _ = make_inputs(2, seqlen_q, seqlen_k, 8, nheads_k, 32, dtype, seed=32)
    qt, kt, vt = (t.detach().transpose(1, 2).requires_grad_(case.endswith("grad")) for t in (q, k, v))
    mask = torch.ones(2, 1, 1, 40, dtype=torch.bool)
    mask[0, ..., :15] = False
    kwargs = dict(attn_mask=None, is_causal=case.startswith("causal"))
    if case.startswith(("padding", "float")):
        kwargs["attn_mask"] = mask
    if case == "head-mask-gqa":  # a mask per query head: not the same for a group's heads, so not folded
        kwargs["attn_mask"] = torch.rand(1, 8, seqlen_q, 40, generator=torch.Generator().manual_seed(3)) > 0.3
    if case.startswith("float"):
        bias = torch.zeros(2, 1, 1, 40).masked_fill(~mask, -math.inf) + 0.5
        kwargs["attn_mask"] = bias.half() if case == "float-mask-other-dtype" else bias.requires_grad_()
    if case == "dropout":
        kwargs["dropout_p"] = 0.1
    if case == "sink":
        kwargs["learnable_sink"] = torch.zeros(8)
    out = flashtile.attention(qt, kt, vt, enable_gqa=True, **kwargs)
    assert (len(calls) == 1) == is_sdpas
    if case == "dropout":
        return
    mask = kwargs["attn_mask"]
    bias = None if mask is None else (torch.zeros(mask.shape).masked_fill(~mask, -math.inf) if mask.dtype == torch.bool
                                      else mask.detach().float())
    group = 8 // nheads_k
    expected, _, _ = ref.attention_forward(
        qt.detach().double(), kt.detach().double().repeat_interleave(group, 1),
        vt.detach().double().repeat_interleave(group, 1), 32 ** -0.5,
        window_size=(-1, 0) if kwargs["is_causal"] else (-1, -1),
        attn_bias=None if bias is None else bias.double().expand(2, 8, seqlen_q, 40),
        learnable_sink=kwargs.get("learnable_sink"))
    # float32: the kernels' error; bfloat16: one rounding of outputs below 1 in magnitude (2⁻⁸) on top
    atol = 1e-5 if dtype == torch.float32 else 2 ** -8 + 1e-5
    torch.testing.assert_close(out.detach().double(), expected, rtol=0, atol=atol)


# ----------------------------------------------------------------------------------------------
# Dropout


def _keep_from_probs(probs):
    """flash-attn's S_dmask marks dropped entries by negating them: keep = sign bit clear."""
    return ~torch.signbit(probs)


@with_descriptor_loads
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("variant", ["plain", "plain-d96", "window-softcap-alibi"])
def test_dropout_exact_with_the_returned_mask(backend, variant, causal):
    # d96: the backward kernels hold the head dim in two chunks (64 + 32), the dropped P multiplying both
    head_dim = 96 if variant == "plain-d96" else 32
    q, k, v, do = make_inputs(2, 53, 70, 4, 2, head_dim, torch.float16, seed=27)
    options = {} if variant.startswith("plain") else dict(window_size=(16, 8), softcap=3.0, alibi_slopes=_slopes(4))
    dropout_p = 0.17
    torch.manual_seed(0)
    out, lse, probs = flashtile.flash_attn_func(q, k, v, dropout_p=dropout_p, causal=causal, return_attn_probs=True,
                                                **options)
    grads = torch.autograd.grad(out, (q, k, v), do)
    assert probs.shape == (2, 4, 53, 70)
    keep = _keep_from_probs(probs)
    ref64, ref_lowp = references(q, k, v, do, keep=keep, dropout_p=dropout_p, causal=causal, **options)
    # the returned probabilities are the undropped ones
    _, _, p64 = ref.attention_forward(*(to_reference(t, torch.float64) for t in (q, k, v)), causal=causal, **options)
    torch.testing.assert_close(probs.abs().double(), p64, rtol=0, atol=1e-3)
    check_outputs(out, lse, grads, ref64, ref_lowp)


def test_dropout_with_explicit_seed_matches_reference_mask(backend):
    q, k, v, do = make_inputs(2, 40, 57, 4, 2, 32, torch.float32, seed=28)
    seed, dropout_p = 2**33 + 12345, 0.3
    for causal in (False, True):
        out, lse = ops_attention_forward(q.detach(), k.detach(), v.detach(), 0.25, causal, dropout_p=dropout_p,
                                         dropout_seed=seed)
        ref_out, ref_lse, _ = ref.attention_forward(*(to_reference(t, torch.float64) for t in (q, k, v)), 0.25, causal,
                                                    dropout_p=dropout_p, dropout_seed=seed)
        torch.testing.assert_close(out.double(), ref_out.transpose(1, 2), rtol=0, atol=1e-5)
        torch.testing.assert_close(lse.double(), ref_lse, rtol=0, atol=1e-5)


def test_dropout_is_reproducible_from_torch_manual_seed(backend):
    q, k, v, do = make_inputs(1, 37, 64, 2, 1, 32, torch.bfloat16, seed=29)

    def run(seed):
        torch.manual_seed(seed)
        out = flashtile.flash_attn_func(q, k, v, dropout_p=0.4, causal=True)
        return (out, *torch.autograd.grad(out, (q, k, v), do))

    first, second, other = run(1), run(1), run(2)
    for a, b in zip(first, second):
        assert torch.equal(a, b)
    assert not torch.equal(first[0], other[0])


def test_dropout_keeps_one_minus_p_and_is_unbiased(backend):
    # Many independent masks in few calls: each batch entry of a call draws its own mask
    # (the Philox counter includes the batch index), and the calls use fixed seeds.
    replicas, calls, dropout_p = 32, 4, 0.3
    base = make_inputs(1, 16, 48, 1, 1, 16, torch.float32, seed=30)[:3]
    q, k, v = (t.detach().expand(replicas, *t.shape[1:]) for t in base)
    expected = flashtile.flash_attn_func(*base).detach()[0, :, 0].double()  # [16, 16]
    outs, kept, visible = [], 0, 0
    for call in range(calls):
        torch.manual_seed(100 + call)
        out, _, probs = flashtile.flash_attn_func(q, k, v, dropout_p=dropout_p, return_attn_probs=True)
        outs.append(out)
        kept += _keep_from_probs(probs).sum().item()
        visible += probs.numel()
    n = replicas * calls
    # kept fraction: binomial, within 6 standard deviations
    assert abs(kept / visible - (1 - dropout_p)) <= 6 * math.sqrt(dropout_p * (1 - dropout_p) / visible)
    # E[out] = undropped out; Var[out_id] = p / (1 − p) · Σ_j P_ij² v_jd², so the mean of n
    # independent outputs is within 6 of its standard deviations of the expectation
    _, _, p = ref.attention_forward(*(to_reference(t, torch.float64) for t in base))
    variance = dropout_p / (1 - dropout_p) * (p[0, 0] ** 2) @ (to_reference(base[2], torch.float64)[0, 0] ** 2)
    mean = torch.cat(outs).double().mean(0)[:, 0]  # [16, 16]
    assert ((mean - expected).abs() <= 6 * (variance / n).sqrt() + 1e-6).all()


def test_dropout_through_attention_with_mask(backend):
    q, k, v, do = _sdpa_inputs(31, seqlen_q=30, seqlen_k=41)
    mask = _bias("bool", 2, 4, 30, 41, q.dtype)
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    torch.manual_seed(3)
    first = flashtile.attention(qt, kt, vt, attn_mask=mask, dropout_p=0.2, enable_gqa=True)
    torch.manual_seed(3)
    again = flashtile.attention(qt, kt, vt, attn_mask=mask, dropout_p=0.2, enable_gqa=True)
    plain = flashtile.attention(qt, kt, vt, attn_mask=mask, enable_gqa=True)
    assert torch.equal(first, again) and not torch.equal(first, plain)
    assert torch.isfinite(first).all()


# ----------------------------------------------------------------------------------------------
# Validation


def _small():
    return make_inputs(2, 16, 16, 4, 2, 32, torch.float16)[:3]


def test_window_accepts_integer_like_bounds(backend):
    # flash-attn's own tests draw window_size as integer tensors; numpy ints count too
    q, k, v = _small()
    expected = flashtile.flash_attn_func(q, k, v, window_size=(3, 1))
    for window in ((torch.tensor(3), torch.tensor(1)), (np.int64(3), np.int32(1)), [3, 1]):
        torch.testing.assert_close(flashtile.flash_attn_func(q, k, v, window_size=window), expected, rtol=0, atol=0)


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(window_size=(3,)), ValueError, "window_size"),
        (dict(window_size=(-2, 0)), ValueError, "window_size"),
        (dict(window_size=(1.5, 2)), ValueError, "window_size"),
        (dict(window_size=4), ValueError, "window_size"),
        (dict(alibi_slopes=torch.ones(5)), ValueError, r"alibi_slopes must have shape \(4,\) or \(2, 4\)"),
        (dict(alibi_slopes=torch.ones(2, 4, 1)), ValueError, "alibi_slopes"),
        (dict(alibi_slopes=torch.ones(4, dtype=torch.float16)), TypeError, "alibi_slopes"),
        (dict(softcap=-1.0), ValueError, "softcap"),
        (dict(dropout_p=-0.1), ValueError, "dropout_p"),
        (dict(dropout_p=1.0), ValueError, "dropout_p"),
        (dict(window_size=(True, 0)), ValueError, "window_size"),
        (dict(softcap=math.nan), ValueError, "softcap must be finite"),
        (dict(softcap=None), TypeError, "softcap must be a number, got NoneType"),
        (dict(softmax_scale=math.nan), ValueError, "softmax_scale must be finite"),
        (dict(softmax_scale=math.inf), ValueError, "softmax_scale must be finite"),
        (dict(softmax_scale="x"), TypeError, "softmax_scale must be a number, got str"),
        (dict(softmax_scale=1e300), ValueError, "softmax_scale must be at most"),
        (dict(softmax_scale=3e38), ValueError, "softmax_scale must be at most"),
        (dict(softcap=-1e300), ValueError, "softcap must be at most"),
        (dict(softcap=1e-40), ValueError, "softmax_scale / softcap must be at most"),
        (dict(dropout_p=None), TypeError, "dropout_p must be a number"),
        (dict(causal="no"), TypeError, "causal must be a bool, got 'no'"),
        (dict(causal=2), TypeError, "causal must be a bool, got 2"),
    ],
    ids=["window-len1", "window-below-minus-1", "window-float", "window-int", "alibi-length", "alibi-rank",
         "alibi-dtype", "softcap-negative", "dropout-negative", "dropout-one", "window-bool", "softcap-nan",
         "softcap-none", "scale-nan", "scale-inf", "scale-str", "scale-beyond-float32", "scale-times-log2e-beyond-float32",
         "softcap-beyond-float32", "softcap-tiny",
         "dropout-none", "causal-str", "causal-two"],
)
def test_bad_variant_arguments_raise(kwargs, error, message):
    if isinstance(kwargs.get("alibi_slopes"), torch.Tensor):
        kwargs = {**kwargs, "alibi_slopes": kwargs["alibi_slopes"].to(DEVICE)}
    with pytest.raises(error, match=message):
        flashtile.flash_attn_func(*_small(), **kwargs)


def test_causal_takes_bool_likes():
    # what a caller may hold for a yes/no option: numpy's and torch's bools, the ints 0 and 1
    q, k, v = _small()
    expected = flashtile.flash_attn_func(q, k, v, causal=True)
    for causal in (1, np.True_, torch.tensor(True)):
        assert torch.equal(flashtile.flash_attn_func(q, k, v, causal=causal), expected), repr(causal)
    assert torch.equal(flashtile.flash_attn_func(q, k, v, causal=np.False_), flashtile.flash_attn_func(q, k, v))


def test_options_validated_once_are_not_lent_to_look_alikes():
    # plain options are validated once per distinct set; values that compare equal to valid ones
    # (True == 1) must still be refused after those were seen, and the global deterministic switch read
    q, k, v = _small()
    flashtile.flash_attn_func(q, k, v, window_size=(1, 0), softcap=1.0)
    with pytest.raises(ValueError, match="window_size"):
        flashtile.flash_attn_func(q, k, v, window_size=(True, 0), softcap=1.0)
    with pytest.raises(TypeError, match="softcap must be a number, got bool"):
        flashtile.flash_attn_func(q, k, v, window_size=(1, 0), softcap=True)
    assert not _validate.attention_options(32, None, False, (1, 0), 1.0).deterministic
    torch.use_deterministic_algorithms(True)
    try:
        assert _validate.attention_options(32, None, False, (1, 0), 1.0).deterministic
    finally:
        torch.use_deterministic_algorithms(False)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(attn_mask=(2, 4, 16, 17)), r"attn_mask of shape \(2, 4, 16, 17\) does not broadcast"),
        (dict(attn_mask=(3, 1, 16, 16)), "attn_mask"),
        (dict(attn_mask=(16, 16), is_causal=True), "is_causal"),
        (dict(dropout_p=1.5), "dropout_p"),
    ],
    ids=["mask-keys", "mask-batch", "mask-with-is-causal", "dropout-above-one"],
)
def test_bad_sdpa_arguments_raise(kwargs, message):
    q, k, v = (t.transpose(1, 2) for t in _small())
    if "attn_mask" in kwargs:
        kwargs = {**kwargs, "attn_mask": torch.zeros(kwargs["attn_mask"], device=DEVICE, dtype=q.dtype)}
    with pytest.raises(ValueError, match=message):
        flashtile.attention(q, k, v, enable_gqa=True, **kwargs)
