"""Merging attention states: exact, associative, order-free, and neutral on empty parts.

Each test runs the Triton merge kernel (the interpreter on CPU, the GPU under CUDA) and,
off the GPU, the PyTorch path too. The partial results over disjoint key ranges are the
float64 reference's, rounded as an attention kernel delivers them (output in the input
dtype, log-sum-exp in float32), so these tests judge the merge alone.
"""

import math

import pytest
import torch
from helpers import DEVICE, DTYPES, assert_accurate

import flashtile
from flashtile import reference as ref
from flashtile.merge import merge_attention_states, merge_split_attention_states




def qkv(batch, seqlen_q, seqlen_k, nheads, head_dim, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, n, nheads, head_dim, generator=g).to(DEVICE, dtype)
            for n in (seqlen_q, seqlen_k, seqlen_k)]


def attend(q, k, v):
    """Attention over one key range → (out [B, Nq, H, D] in q's dtype, lse [B, H, Nq] float32)."""
    out, lse, _ = ref.attention_forward(*(t.transpose(1, 2).double() for t in (q, k, v)))
    return out.transpose(1, 2).to(q.dtype), lse.float()


def random_states(parts, seed, shape=(2, 9, 3, 40)):
    """P partial states with [B, S, H, D] outputs and plausible log-sum-exps [B, H, S]."""
    g = torch.Generator().manual_seed(seed)
    batch, seqlen, nheads, head_dim = shape
    outs = torch.randn(parts, *shape, generator=g).to(DEVICE)
    lses = (3 * torch.randn(parts, batch, nheads, seqlen, generator=g)).to(DEVICE)
    return outs, lses


def assert_states_close(a, b):
    torch.testing.assert_close(a[0], b[0], rtol=0, atol=2e-6)
    torch.testing.assert_close(a[1], b[1], rtol=0, atol=2e-6)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_halves_of_key_range_equal_whole_range(backend, dtype):
    q, k, v = qkv(2, 17, 113, 3, 40, dtype, seed=0)
    out_a, lse_a = attend(q, k[:, :50], v[:, :50])
    out_b, lse_b = attend(q, k[:, 50:], v[:, 50:])
    out, lse = merge_attention_states(out_a, lse_a, out_b, lse_b)
    assert out.dtype == dtype and lse.dtype == torch.float32
    ref64 = ref.attention_forward(*(t.transpose(1, 2).double() for t in (q, k, v)))
    ref_lowp = ref.attention_forward(*(t.transpose(1, 2) for t in (q, k, v)))
    assert_accurate("out", out, ref64[0].transpose(1, 2), ref_lowp[0].transpose(1, 2), factor=2)
    torch.testing.assert_close(lse.double(), ref64[1], rtol=0, atol=1e-5)


def test_split_form_over_many_ranges(backend):
    # five uneven key ranges stacked on the split dimension, one of them a single key
    q, k, v = qkv(1, 9, 130, 2, 64, torch.float32, seed=1)
    bounds = [0, 1, 40, 41, 100, 130]
    parts = [attend(q, k[:, a:b], v[:, a:b]) for a, b in zip(bounds, bounds[1:])]
    out, lse = merge_split_attention_states(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]))
    out64, lse64, _ = ref.attention_forward(*(t.transpose(1, 2).double() for t in (q, k, v)))
    torch.testing.assert_close(out.double(), out64.transpose(1, 2), rtol=0, atol=1e-5)
    torch.testing.assert_close(lse.double(), lse64, rtol=0, atol=1e-5)


def test_associative(backend):
    outs, lses = random_states(3, seed=2)
    a, b, c = zip(outs, lses)
    left = merge_attention_states(*merge_attention_states(*a, *b), *c)
    right = merge_attention_states(*a, *merge_attention_states(*b, *c))
    assert_states_close(left, right)
    assert_states_close(left, merge_split_attention_states(outs, lses))


def test_order_free(backend):
    outs, lses = random_states(4, seed=3)
    expected = merge_split_attention_states(outs, lses)
    for perm in ([3, 2, 1, 0], [1, 3, 0, 2]):
        assert_states_close(merge_split_attention_states(outs[perm], lses[perm]), expected)


def test_part_with_neg_inf_lse_contributes_nothing(backend):
    outs, lses = random_states(3, seed=4)
    lses[1] = -math.inf  # outs[1] holds junk that must be ignored
    lses[2, :, 1] = -math.inf  # and part 2 is empty for head 1 only
    got = merge_split_attention_states(outs, lses)
    keep = [0, 2]
    assert_states_close(got, merge_split_attention_states(outs[keep], lses[keep]))
    # head 1 sees part 0 alone: its output and log-sum-exp come through unchanged
    torch.testing.assert_close(got[0][:, :, 1], outs[0][:, :, 1], rtol=0, atol=1e-6)
    torch.testing.assert_close(got[1][:, 1], lses[0][:, 1], rtol=0, atol=1e-6)


def test_all_parts_neg_inf_give_zero_and_neg_inf(backend):
    outs, lses = random_states(3, seed=5)
    lses[:, 0] = -math.inf  # batch 0: no part saw a key
    out, lse = merge_split_attention_states(outs, lses)
    assert (out[0] == 0).all() and torch.isneginf(lse[0]).all()
    assert torch.isfinite(out).all() and torch.isfinite(lse[1]).all()


def test_pos_inf_lse_is_an_empty_part(backend):
    # flash-attn 2 writes +inf as the log-sum-exp of a row that saw no key: an empty part, not NaN
    outs, lses = random_states(3, seed=9)
    marked = lses.clone()
    marked[1] = math.inf
    emptied = lses.clone()
    emptied[1] = -math.inf
    assert_states_close(merge_split_attention_states(outs, marked), merge_split_attention_states(outs, emptied))


def test_leading_dims_and_non_contiguous_inputs(backend):
    # a split-KV layout: outs [P, B, S, H, D] as a strided view, and no leading dims at all
    outs, lses = random_states(2, seed=6, shape=(3, 5, 4, 24))
    strided = outs.transpose(2, 3).contiguous().transpose(2, 3)
    assert not strided.is_contiguous()
    assert_states_close(merge_split_attention_states(strided, lses), merge_split_attention_states(outs, lses))
    single = merge_split_attention_states(outs[:, 0], lses[:, 0])
    assert_states_close(single, tuple(t[0] for t in merge_split_attention_states(outs, lses)))


def test_inputs_that_require_grad_stay_differentiable(backend):
    outs, lses = random_states(2, seed=7)
    outs.requires_grad_()
    out, _ = merge_split_attention_states(outs, lses)
    (grad,) = torch.autograd.grad(out.sum(), outs)
    # d out / d outs[p] is the weight of part p, and the weights sum to 1
    torch.testing.assert_close(grad.sum(0), torch.ones_like(grad[0]))


def test_bad_shapes_raise_clear_errors():
    outs, lses = random_states(2, seed=8)
    with pytest.raises(ValueError, match=r"lses must be \[P, \.\.\., nheads, seqlen\]"):
        merge_split_attention_states(outs, lses.transpose(-1, -2))
    with pytest.raises(ValueError, match="outs must be"):
        merge_split_attention_states(outs[:, 0, 0], lses[:, 0, 0])
    with pytest.raises(TypeError, match="floating-point"):
        merge_split_attention_states(outs.int(), lses)
    with pytest.raises(ValueError, match=r"outs must hold at least one partial result \(P ≥ 1\)"):
        merge_split_attention_states(outs[:0], lses[:0])
    with pytest.raises(TypeError, match="outs must be float16, bfloat16 or float32, got torch.float64"):
        merge_split_attention_states(outs.double(), lses)
    with pytest.raises(ValueError, match=r"out_a \(2, 9, 3, 40\) and out_b \(2, 8, 3, 40\) must have the same shape"):
        merge_attention_states(outs[0], lses[0], outs[1][:, :8], lses[1][..., :8])


def test_flash_attn_combine_in_fa3_layouts(backend):
    # FA3's combine: out_partial (splits, batch, seqlen, nheads, headdim), lse_partial (splits, batch,
    # seqlen, nheads); the same merge as merge_split_attention_states, in those layouts
    outs, lses = random_states(3, seed=10)  # outs [P, B, S, H, D], lses [P, B, H, S]
    lses[:, 0, :, 2] = -math.inf  # batch 0, row 2: every split empty
    expected_out, expected_lse = merge_split_attention_states(outs, lses)
    out, lse = flashtile.flash_attn_combine(outs, lses.transpose(-1, -2))
    assert_states_close((out, lse.transpose(-1, -2)), (expected_out, expected_lse))
    assert lse.shape == outs.shape[1:4] and (out[0, 2] == 0).all() and torch.isneginf(lse[0, 2]).all()
    buffer = torch.empty(outs.shape[1:], dtype=torch.float16, device=DEVICE)
    written, _ = flashtile.flash_attn_combine(outs, lses.transpose(-1, -2), out=buffer)
    assert written is buffer and torch.equal(buffer, expected_out.half())
    assert flashtile.flash_attn_combine(outs, lses.transpose(-1, -2), out_dtype=torch.bfloat16)[0].dtype == torch.bfloat16
    with pytest.raises(ValueError, match=r"lse_partial must be \(num_splits, batch, seqlen, nheads\)"):
        flashtile.flash_attn_combine(outs, lses)
    with pytest.raises(TypeError, match="out_dtype must be torch.float16, torch.bfloat16 or torch.float32"):
        flashtile.flash_attn_combine(outs, lses.transpose(-1, -2), out_dtype=torch.int32)
    with pytest.raises(TypeError, match="out must be float16, bfloat16 or float32, got torch.int32"):
        flashtile.flash_attn_combine(outs, lses.transpose(-1, -2), out=buffer.int())
    with pytest.raises(TypeError, match="out_dtype torch.float32 differs from out's dtype torch.float16"):
        flashtile.flash_attn_combine(outs, lses.transpose(-1, -2), out=buffer, out_dtype=torch.float32)
    with pytest.raises(ValueError, match=r"out_partial must hold at least one split"):
        flashtile.flash_attn_combine(outs[:0], lses[:0].transpose(-1, -2))
    with pytest.raises(TypeError, match="out_partial must be float16, bfloat16 or float32, got torch.float64"):
        flashtile.flash_attn_combine(outs.double(), lses.transpose(-1, -2))
    with pytest.raises(TypeError, match="lse_partial must be a floating-point tensor, got torch.int32"):
        flashtile.flash_attn_combine(outs, lses.transpose(-1, -2).int())
    with pytest.raises(ValueError, match="out must not overlap itself"):
        flashtile.flash_attn_combine(outs, lses.transpose(-1, -2), out=buffer[:1].expand_as(buffer))
    if DEVICE == "cuda":
        with pytest.raises(ValueError, match="out must be on out_partial's device"):
            flashtile.flash_attn_combine(outs, lses.transpose(-1, -2), out=buffer.cpu())
        with pytest.raises(ValueError, match="out_partial and lse_partial must be on one device"):
            flashtile.flash_attn_combine(outs, lses.transpose(-1, -2).cpu())


@pytest.mark.parametrize("empty_axis", [1, 2, 3, 4], ids=["batch", "seqlen", "nheads", "headdim"])
def test_flash_attn_combine_of_empty_shapes(backend, empty_axis):
    # a size-0 axis gives an empty result of the right shapes (and the log-sum-exps of a head dim of 0,
    # which the partials' log-sum-exps alone decide), not a reshape that cannot infer its size
    shape = [3, 2, 5, 2, 16]
    shape[empty_axis] = 0
    g = torch.Generator().manual_seed(13)
    outs = torch.randn(*shape, generator=g).to(DEVICE)
    lses = torch.randn(*shape[:4], generator=g).to(DEVICE)
    out, lse = flashtile.flash_attn_combine(outs, lses)
    assert out.shape == outs.shape[1:] and lse.shape == lses.shape[1:]
    torch.testing.assert_close(lse, torch.logsumexp(lses, dim=0), rtol=0, atol=2e-6)


def test_flash_attn_combine_out_is_seen_by_autograd(backend):
    # out= written in place: a graph that saved out sees the write (its version moves), and an out that is a
    # leaf needing grad is refused, as an in-place copy into it would be
    outs, lses = random_states(2, seed=12)
    out = torch.zeros(outs.shape[1:], device=DEVICE)
    weight = torch.ones((), device=DEVICE, requires_grad=True)
    saved = (weight * out).sum()  # saves out for its backward
    flashtile.flash_attn_combine(outs, lses.transpose(-1, -2), out=out)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        saved.backward()
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        flashtile.flash_attn_combine(outs, lses.transpose(-1, -2), out=out.clone().requires_grad_())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_flash_attn_combine_into_float32_keeps_float32_precision(backend, dtype):
    # 16-bit partials merged into a float32 result (out_dtype or out=) are summed in float32 and rounded
    # once, to float32, as FA3's combine does: not merged in the partials' dtype and widened after (~4e-3
    # off in bf16)
    outs, lses = random_states(3, seed=11)
    outs = outs.to(dtype)
    weights = torch.softmax(lses.double(), dim=0).transpose(-1, -2)[..., None]  # [P, B, S, H, 1]
    exact = (weights * outs.double()).sum(0)
    out, _ = flashtile.flash_attn_combine(outs, lses.transpose(-1, -2), out_dtype=torch.float32)
    buffer = torch.empty(outs.shape[1:], device=DEVICE)
    written, _ = flashtile.flash_attn_combine(outs, lses.transpose(-1, -2), out=buffer)
    assert written is buffer
    for result in (out, buffer):
        assert result.dtype == torch.float32
        torch.testing.assert_close(result.double(), exact, rtol=0, atol=1e-5)
