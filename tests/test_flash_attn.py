"""flashtile against the float64 reference, forward and backward, by flash-attn's rule.

On a machine without a GPU the Triton kernels run under the interpreter (conftest);
the CPU tiled path is tested too. Grids are kept small because the interpreter runs
each program in numpy: a few hundred ms per case.
"""

import math
import warnings

import pytest
import torch
import torch.utils.checkpoint
import torch.utils.flop_counter
import triton
from helpers import (DEVICE, DTYPES, assert_accurate, check_flash_attn_func, check_outputs, make_inputs, references,
                     with_descriptor_loads)

import flashtile
from flashtile import cpu, ops
from flashtile._options import AttentionTensors
from flashtile.triton import _host, configs, launch

SEQLENS = [(1, 1), (1, 77), (17, 113), (113, 203), (203, 113), (128, 128)]


@with_descriptor_loads
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seqlens", SEQLENS, ids=lambda s: f"q{s[0]}-k{s[1]}")
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_seqlens_and_dtypes(backend, dtype, seqlens, causal):
    check_flash_attn_func(*make_inputs(1, *seqlens, 2, 2, 64, dtype), causal=causal)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2)], ids=["mha", "gqa-4:2"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_16_bit_calls_that_do_not_return_the_lse(backend, dtype, heads, causal):
    # without return_attn_probs the caller never reads the log-sum-exp: the CPU path then runs PyTorch's
    # 16-bit kernel as SDPA does (its LSE is ~6e-5 off float64, beyond flashtile's 1e-5 contract);
    # outputs and gradients still meet flash-attn's rule
    q, k, v, do = make_inputs(2, 113, 113, *heads, 64, dtype, seed=4)
    out = flashtile.flash_attn_func(q, k, v, causal=causal)
    grads = torch.autograd.grad(out, (q, k, v), do)
    ref64, ref_lowp = references(q, k, v, do, causal=causal)
    assert_accurate("out", out, ref64[0], ref_lowp[0], factor=2)
    for name, got, r64, rlow in zip(("dq", "dk", "dv"), grads, ref64[2:], ref_lowp[2:]):
        assert got.dtype == dtype, name
        assert_accurate(name, got, r64, rlow, factor=3)
    if backend == "torch" and heads[0] == heads[1]:  # the kernel SDPA runs on a CPU, bit for bit
        sdpa = torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)),
                                                                is_causal=causal)
        assert torch.equal(out, sdpa.transpose(1, 2))


@pytest.mark.skipif(DEVICE != "cpu", reason="the CPU path")
@pytest.mark.parametrize("case", ["full", "causal", "qkvpacked", "fp32-lse", "gqa-full", "gqa-causal"])
def test_cpu_path_leaves_gradients_to_pytorchs_autograd(monkeypatch, cpu_16bit_arithmetic, case):
    # where PyTorch's fused CPU kernel computes a call both ways in the inputs' dtype, its own autograd node
    # takes the place of flashtile's Python Function (ops.differentiable): the same kernels on the same
    # tensors, so the same bits. Not for GQA, whose folded or repeated tensors PyTorch's node would keep, nor
    # for 16-bit calls on a CPU without 16-bit arithmetic, whose backward runs in float32
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    dtype = torch.float32 if case == "fp32-lse" else torch.bfloat16
    gqa = case.startswith("gqa")
    q, k, v, do = make_inputs(2, 203, 203, 4, 2 if gqa else 4, 64, dtype, seed=12)
    causal = case.endswith("causal")

    def run():
        if case == "qkvpacked":
            qkv = torch.stack([q, k, v], dim=2).detach().requires_grad_()
            out = flashtile.flash_attn_qkvpacked_func(qkv, causal=causal)
            return out, torch.autograd.grad(out, qkv, do)
        out = flashtile.flash_attn_func(q, k, v, causal=causal, return_attn_probs=case == "fp32-lse")
        out = out[0] if case == "fp32-lse" else out
        return out, torch.autograd.grad(out, (q, k, v), do)

    out, grads = run()
    float32_backward = dtype != torch.float32 and not cpu_16bit_arithmetic
    assert (type(out.grad_fn).__name__ == "FlashAttnFunctionBackward") == (gqa or float32_backward)
    monkeypatch.setattr(flashtile.autograd, "differentiable", lambda *arguments: False)
    function_out, function_grads = run()
    assert type(function_out.grad_fn).__name__ == "FlashAttnFunctionBackward"
    assert torch.equal(out, function_out)
    for got, expected in zip(grads, function_grads):
        assert torch.equal(got, expected) and got.stride() == expected.stride()


@pytest.mark.skipif(DEVICE != "cpu", reason="the CPU path")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_cpu_16bit_backward_of_long_sequences(monkeypatch, cpu_16bit_arithmetic, dtype, causal):
    # past cpu.SHORT_BACKWARD_SEQLEN the backward runs in the inputs' dtype where the CPU has the arithmetic,
    # in float32 where it does not (6-10x faster there): both within flash-attn's rule
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    calls = []
    kernel = cpu._BACKWARD  # flashtile's own call of PyTorch's backward kernel (its Function's route)
    monkeypatch.setattr(cpu, "_BACKWARD", lambda *args, **kwargs: calls.append(args[0].dtype) or kernel(*args, **kwargs))
    q, k, v, do = make_inputs(1, 150, 150, 2, 2, 64, dtype, seed=14)
    out = flashtile.flash_attn_func(q, k, v, causal=causal)  # no log-sum-exp asked: 16-bit where it pays
    grads = torch.autograd.grad(out, (q, k, v), do)
    # 16-bit both ways: PyTorch's own autograd node runs the kernel; else flashtile's Function, in float32
    assert calls == ([] if cpu_16bit_arithmetic else [torch.float32]), calls
    ref64, ref_lowp = references(q, k, v, do, causal=causal)
    for name, got, r64, rlow in zip(("dq", "dk", "dv"), grads, ref64[2:], ref_lowp[2:]):
        assert got.dtype == dtype, name
        assert_accurate(name, got, r64, rlow, factor=3)


@pytest.mark.skipif(DEVICE != "cpu", reason="the CPU path")
def test_cpu_gradients_route_does_not_depend_on_modes(monkeypatch, cpu_16bit_arithmetic):
    # a non-reentrant checkpoint recomputes the forward outside the mode (or profiler) that the first
    # forward ran under and compares what the two saved: the route to PyTorch's autograd must not change
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q, k, v, do = make_inputs(1, 150, 150, 2, 2, 32, torch.bfloat16, seed=13)

    def attend(q, k, v):
        return flashtile.flash_attn_func(q, k, v, causal=True)

    with torch.utils.flop_counter.FlopCounterMode(display=False):
        out = torch.utils.checkpoint.checkpoint(attend, q, k, v, use_reentrant=False)
    grads = torch.autograd.grad(out, (q, k, v), do)
    expected = torch.autograd.grad(attend(q, k, v), (q, k, v), do)
    for got, want in zip(grads, expected):
        assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_non_reentrant_checkpoint(backend, dtype):
    # a non-reentrant checkpoint lets the backward unpack each saved tensor once; it then recomputes the
    # forward, so the gradients are those of the call without it
    q, k, v, do = make_inputs(1, 17, 40, 2, 1, 32, dtype, seed=21)

    def attend(q, k, v):
        return flashtile.flash_attn_func(q, k, v, causal=True)

    grads = torch.autograd.grad(torch.utils.checkpoint.checkpoint(attend, q, k, v, use_reentrant=False),
                                (q, k, v), do)
    expected = torch.autograd.grad(attend(q, k, v), (q, k, v), do)
    for got, want in zip(grads, expected):
        assert torch.equal(got, want)


class _DropsGradient(torch.autograd.Function):
    """The identity, whose backward gives its input no gradient (an undefined one, not zeros)."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return None


def test_output_whose_gradient_is_undefined(backend):
    # every gradient that reaches out is undefined: the backward still runs (q gets one from elsewhere) and
    # gives q, k, v none of its own
    q, k, v, _ = make_inputs(1, 17, 17, 2, 2, 32, torch.float32, seed=22)
    out = flashtile.flash_attn_func(q, k, v, causal=True)
    (_DropsGradient.apply(out).sum() + q.sum()).backward()
    assert torch.equal(q.grad, torch.ones_like(q))
    assert k.grad is None and v.grad is None


@pytest.mark.skipif(DEVICE != "cpu", reason="the CPU path")
def test_cpu_path_builds_a_bias_free_layout_once_per_key(monkeypatch):
    # a layer's repeated calls reuse one layout; a call that differs in shape or options gets its own
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    flashtile.cpu._bias_free_layout.cache_clear()
    q, k, v, _ = make_inputs(1, 64, 64, 2, 2, 32, torch.bfloat16, seed=14)
    q, k, v = (t.detach() for t in (q, k, v))
    for _ in range(2):
        flashtile.flash_attn_func(q, k, v)
    assert flashtile.cpu._bias_free_layout.cache_info()[:2] == (1, 1)  # (hits, misses)
    for causal, (q_n, k_n, v_n) in ((True, (q, k, v)), (False, (q[:, :40], k, v))):
        out = flashtile.flash_attn_func(q_n, k_n, v_n, causal=causal)
        sdpa = torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q_n, k_n, v_n)),
                                                                is_causal=causal)
        assert torch.equal(out, sdpa.transpose(1, 2))
    assert flashtile.cpu._bias_free_layout.cache_info()[:2] == (1, 3)


@pytest.mark.skipif(DEVICE != "cpu", reason="the CPU path")
def test_cpu_path_key_holds_v_head_dim(monkeypatch):
    # the path of a call without optional tensors is decided once per key; PyTorch's kernel takes no v head dim
    # but q's, so an MLA call with the same q and k as a fused one must not take its decision
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    flashtile.cpu._bias_free_layout.cache_clear()
    q, k, v, _ = make_inputs(1, 32, 32, 2, 2, 32, torch.float32, seed=15)
    v_mla = make_inputs(1, 32, 32, 2, 2, 32, torch.float32, seed=16, head_dim_v=16)[2]
    with torch.no_grad():
        for values in (v, v_mla):
            out = flashtile.flash_attn_func(q, k, values)
            expected = torch.nn.functional.scaled_dot_product_attention(
                *(t.transpose(1, 2).double() for t in (q, k, values))).transpose(1, 2)
            torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=0)


@pytest.mark.skipif(DEVICE != "cpu", reason="the CPU path")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_cpu_path_returns_a_contiguous_lse(monkeypatch, dtype):
    # the fused path leaves a log-sum-exp that nobody reads as PyTorch's kernel lays it out ([B, Nq, H] in
    # memory); one the caller asks for comes contiguous, with or without gradients
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q, k, v, _ = make_inputs(2, 24, 24, 4, 4, 32, dtype, seed=17)
    for grad in (False, True):
        with torch.set_grad_enabled(grad):
            _, lse, _ = flashtile.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
        assert lse.is_contiguous(), lse.stride()


@with_descriptor_loads
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [1, 16, 40, 64, 80, 96, 128, 160, 192, 256], ids=lambda d: f"d{d}")
def test_head_dims(backend, head_dim, causal):
    # 40, 80, 96, 160 and 192: the backward kernels hold these head dims in two chunks (configs.bwd_head_dim_chunks),
    # 160 and 192 with tiles of their own (configs._BWD_16BIT_TWO_CHUNKS)
    check_flash_attn_func(*make_inputs(2, 67, 45, 2, 2, head_dim, torch.bfloat16, seed=1), causal=causal)


@pytest.mark.parametrize("deterministic", [False, True], ids=["bwd", "deterministic-bwd"])
@pytest.mark.parametrize("head_dim", [40, 64, 96, 128, 192, 256], ids=lambda d: f"d{d}")
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_one_query_against_one_key(backend, dtype, head_dim, deterministic):
    # P = 1, so the exact dS = P ∘ (dP − D), dq and dk are 0, and PyTorch's own ones are 0 too: the rule
    # leaves only its floor of 8 float32 ulps. D summed in another order than dP's matmul missed that floor at
    # head dims 192-256 on the GPU (benchmarks/NOTES.md, twenty-fourth session); on sm_90 deterministic=False takes
    # the fused Gluon backward at 64/128 and the Triton one elsewhere, deterministic=True the Triton one everywhere.
    q, k, v, do = make_inputs(2, 1, 1, 4, 4, head_dim, dtype, seed=11)
    out, lse, _ = flashtile.flash_attn_func(q, k, v, deterministic=deterministic, return_attn_probs=True)
    check_outputs(out, lse, torch.autograd.grad(out, (q, k, v), do), *references(q, k, v, do))


@pytest.mark.parametrize("head_dim", [64, 192], ids=lambda d: f"d{d}")
def test_backward_of_an_out_in_float32(backend, head_dim):
    # ops.attention_backward's out may be a larger attention's (ring attention) in another dtype than dout's; D =
    # rowsum(dO ∘ O) is then summed elementwise in float32 (the matmul form of 16-bit calls needs one dtype)
    q, k, v, do = make_inputs(1, 17, 113, 2, 2, head_dim, torch.bfloat16, seed=5)
    out, lse, _ = flashtile.flash_attn_func(q, k, v, return_attn_probs=True)
    grads = ops.attention_backward(do, q.detach(), k.detach(), v.detach(), out.detach().float(), lse.detach(),
                                   head_dim ** -0.5, False)
    check_outputs(out, lse, grads, *references(q, k, v, do))


@with_descriptor_loads
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("heads", [(6, 2), (4, 1)], ids=["gqa-6:2", "mqa-4:1"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_gqa_mqa(backend, dtype, heads, causal):
    check_flash_attn_func(*make_inputs(2, 70, 93, *heads, 40, dtype, seed=2), causal=causal)


def test_softmax_scale(backend):
    check_flash_attn_func(*make_inputs(1, 33, 50, 2, 2, 32, torch.float16, seed=3), causal=True, softmax_scale=0.3)


@pytest.mark.parametrize("scale", [0.0, -0.2], ids=["scale0", "scale-neg"])
def test_non_positive_softmax_scale(backend, scale):
    # 0 averages the visible values; masked (causal, out-of-range) keys must stay out either way
    check_flash_attn_func(*make_inputs(1, 33, 50, 2, 2, 32, torch.float16, seed=3), causal=True, softmax_scale=scale)


@with_descriptor_loads
def test_non_contiguous_inputs(backend):
    # q, k, v as views into one packed (batch, seqlen, 3, nheads, headdim) tensor, and a
    # transposed dO: strides are honoured, nothing is copied to contiguous first.
    g = torch.Generator().manual_seed(4)
    qkv = torch.randn(2, 59, 3, 4, 48, generator=g).to(DEVICE, torch.float16)
    q, k, v = (t.requires_grad_() for t in qkv.unbind(2))
    assert not q.is_contiguous()
    do = torch.randn(2, 4, 59, 48, generator=g).to(DEVICE, torch.float16).transpose(1, 2)
    check_flash_attn_func(q, k, v, do, causal=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_inputs_strided_in_the_head_dim(backend, dtype):
    # k transposed from (batch, nheads, headdim, seqlen), v a step-2 slice of its head dim, and GQA 4:2
    # without causality (the CPU path folds the group into rows): PyTorch's CPU kernel assumes unit stride in
    # the head dim, and the output comes back contiguous, as flash-attn's does
    g = torch.Generator().manual_seed(6)
    q = torch.randn(2, 23, 4, 16, generator=g).to(DEVICE, dtype).requires_grad_()
    k = torch.randn(2, 2, 16, 31, generator=g).to(DEVICE, dtype).permute(0, 3, 1, 2).requires_grad_()
    v = torch.randn(2, 31, 2, 32, generator=g).to(DEVICE, dtype)[..., ::2].requires_grad_()
    assert k.stride(-1) != 1 and v.stride(-1) != 1
    do = torch.randn(2, 23, 4, 16, generator=g).to(DEVICE, dtype)
    for causal in (False, True):
        check_flash_attn_func(q, k, v, do, causal=causal)
        with torch.no_grad():
            out = flashtile.flash_attn_func(q, k, v, causal=causal)
        assert out.is_contiguous(), out.stride()


def test_sdpa_layout_matches_torch_sdpa(backend):
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 8, 75, 40, generator=g).to(DEVICE)
    k = torch.randn(2, 2, 75, 40, generator=g).to(DEVICE)
    v = torch.randn(2, 2, 75, 40, generator=g).to(DEVICE)
    for is_causal in (False, True):
        out = flashtile.attention(q, k, v, is_causal=is_causal, scale=0.2, enable_gqa=True)
        expected = torch.nn.functional.scaled_dot_product_attention(
            q.double(), k.double(), v.double(), is_causal=is_causal, scale=0.2, enable_gqa=True)
        assert out.shape == q.shape
        torch.testing.assert_close(out.double(), expected, rtol=0, atol=1e-5)


@with_descriptor_loads
def test_fully_masked_rows(backend):
    # causal with seqlen_q > seqlen_k: the first seqlen_q - seqlen_k rows see no key
    q, k, v, do = make_inputs(1, 100, 30, 2, 2, 32, torch.float16, seed=6)
    out, lse, _ = flashtile.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), do)
    assert (out[:, :70] == 0).all() and torch.isneginf(lse[:, :, :70]).all()
    assert (dq[:, :70] == 0).all()
    for t in (out, lse[:, :, 70:], dq, dk, dv):
        assert torch.isfinite(t).all()
    check_flash_attn_func(q, k, v, do, causal=True)


def test_rows_that_see_nothing_raise_no_numeric_warning(backend):
    # the interpreter evaluates both sides of tl.where in numpy: the kernels must not take log2(0)
    # or similar on rows that see no key (causal with seqlen_q > seqlen_k), nor in decoding and merging
    q, k, v, do = make_inputs(1, 40, 9, 2, 1, 16, torch.float16, seed=10)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        out = flashtile.flash_attn_func(q, k, v, causal=True)
        torch.autograd.grad(out, (q, k, v), do)
        cache = k.detach().expand(2, 9, 1, 16).contiguous()
        flashtile.flash_attn_with_kvcache(q.detach()[:, :3].expand(2, 3, 2, 16), cache, cache.clone(),
                                          cache_seqlens=torch.tensor([0, 5], dtype=torch.int32, device=DEVICE),
                                          causal=True, num_splits=3)


def test_deterministic_backward_is_bitwise(backend):
    # the fused sm_90 backward sums dQ with atomics: deterministic=True keeps gradients bitwise equal
    q, k, v, do = make_inputs(2, 150, 150, 4, 2, 64, torch.bfloat16, seed=7)
    first = torch.autograd.grad(flashtile.flash_attn_func(q, k, v, causal=True, deterministic=True), (q, k, v), do)
    second = torch.autograd.grad(flashtile.flash_attn_func(q, k, v, causal=True, deterministic=True), (q, k, v), do)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


@pytest.mark.parametrize("shape", [(0, 5, 5), (2, 0, 5), (2, 5, 0)], ids=["batch0", "seqlen_q0", "seqlen_k0"])
def test_empty_inputs(backend, shape):
    batch, seqlen_q, seqlen_k = shape
    q, k, v, do = make_inputs(batch, seqlen_q, seqlen_k, 2, 2, 16, torch.float32)
    out, lse, _ = flashtile.flash_attn_func(q, k, v, return_attn_probs=True)
    assert out.shape == q.shape and lse.shape == (batch, 2, seqlen_q)
    assert (out == 0).all() and torch.isneginf(lse).all()
    grads = torch.autograd.grad(out, (q, k, v), do)
    assert all(g.shape == t.shape and (g == 0).all() for g, t in zip(grads, (q, k, v)))


def test_default_scale_is_inverse_sqrt_head_dim(backend):
    q, k, v, _ = make_inputs(1, 20, 20, 1, 1, 36, torch.float32, seed=8)
    torch.testing.assert_close(flashtile.flash_attn_func(q, k, v),
                               flashtile.flash_attn_func(q, k, v, softmax_scale=1 / math.sqrt(36)))


def test_backward_of_a_slice_with_strided_lse(backend):
    # Ring attention runs the backward of a block of rows against the global out and lse:
    # the lse slice is strided, and the result must equal the one on dense copies.
    q, k, v, do = make_inputs(1, 40, 40, 2, 2, 16, torch.float32, seed=9)
    out, lse = ops.attention_forward(q.detach(), k.detach(), v.detach(), 0.25, False)
    rows = slice(13, 40)
    strided = ops.attention_backward(do[:, rows], q[:, rows].detach(), k.detach(), v.detach(),
                                               out[:, rows], lse[:, :, rows], 0.25, False)
    dense = ops.attention_backward(*(t.contiguous() for t in (do[:, rows], q[:, rows].detach())),
                                             k.detach(), v.detach(), out[:, rows].contiguous(),
                                             lse[:, :, rows].contiguous(), 0.25, False)
    for a, b in zip(strided, dense):
        assert torch.equal(a, b)


def test_descriptor_loads_only_where_they_apply():
    long, short = configs.TMA_MIN_SEQLEN, configs.TMA_MIN_SEQLEN - 1
    aligned = torch.randn(2, 8, 4, 64, device=DEVICE).to(torch.bfloat16)
    odd_head_dim = torch.randn(2, 8, 4, 17, device=DEVICE).to(torch.bfloat16)  # 34-byte rows
    broadcast = aligned[:, :, :1].expand(2, 8, 4, 64)  # head stride 0
    plain = AttentionTensors()
    packed = AttentionTensors(cu_seqlens_q=torch.tensor([0, 8], device=DEVICE))
    assert launch.tma_usable(plain, long, long, aligned, aligned)
    assert not launch.tma_usable(plain, long, short, aligned, aligned)
    assert not launch.tma_usable(plain, long, long, aligned, odd_head_dim)
    assert not launch.tma_usable(plain, long, long, aligned, broadcast)
    assert not launch.tma_usable(packed, long, long, aligned, aligned)


def test_launcher_integer_math_matches_triton():
    # the launchers size grids and blocks with flashtile.triton._host's plain-int versions of these
    for n in [*range(1, 300), 1023, 1024, 1025, 2**31 - 1]:
        assert _host.next_power_of_2(n) == triton.next_power_of_2(n), n
        for block in (1, 16, 64, 128, 176):
            assert _host.cdiv(n, block) == triton.cdiv(n, block), (n, block)


def test_backward_head_dim_chunks_cover_the_head_dim_with_less_padding():
    for head_dim in range(1, 257):
        first, second = configs.bwd_head_dim_chunks(head_dim)
        padded = configs.block_d(head_dim)
        assert first == triton.next_power_of_2(first) and first >= 16, (head_dim, first)
        if second == 0:
            assert first == padded, head_dim
            continue
        # the first chunk is whole (its loads need no head-dim mask), the second a power of two ≥ 16 (tl.dot's
        # least) that reaches the head dim, and the two together pad less than one chunk would
        assert second == triton.next_power_of_2(second) and 16 <= second < first < head_dim, (head_dim, second)
        assert head_dim <= first + second < padded, head_dim
    assert [configs.bwd_head_dim_chunks(d) for d in (96, 192, 224)] == [(64, 32), (128, 64), (256, 0)]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_tensors_on_a_gpu_that_is_not_the_current_one():
    # Triton launches on the current device; a model spread over GPUs calls with cuda:0 current
    q, k, v, do = make_inputs(2, 97, 130, 4, 2, 64, torch.bfloat16, seed=21)
    out0 = flashtile.flash_attn_func(q, k, v, causal=True)
    grads0 = torch.autograd.grad(out0, (q, k, v), do)
    q1, k1, v1 = (t.detach().to("cuda:1").requires_grad_() for t in (q, k, v))
    with torch.cuda.device(0):
        out1 = flashtile.flash_attn_func(q1, k1, v1, causal=True)
        grads1 = torch.autograd.grad(out1, (q1, k1, v1), do.to("cuda:1"))
    assert out1.device == torch.device("cuda:1")
    for a, b in zip((out0, *grads0), (out1, *grads1)):
        assert torch.equal(a.cpu(), b.cpu())
