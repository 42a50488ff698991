"""Tensors that span more than 2³¹ elements: the kernels index them with 64-bit offsets.

A (1, 524288, 32, 128) tensor is 2³¹ elements; the kernels form their offsets in 32 bits unless a
tensor of the call spans more (``launch.wide_offsets``), and then widen every stride to 64 bits (the
``WIDE`` constexpr; the common path compiles as before). Here the inputs are views into one buffer
of 2³¹ + 4096 float16 elements whose rows lie 2³⁰ elements apart, so the third row of each sits past
2³¹ and any 32-bit offset would wrap. The buffer is allocated but never touched beyond the rows used
(Triton's interpreter works on the tensors' own memory), so this needs a few MB, not 4 GiB.
"""

import pytest
import torch
from helpers import DEVICE, assert_accurate, check_outputs, references

import flashtile
from flashtile.reference import kvcache_attention_reference
from flashtile.triton import launch

SPAN = 2**31 + 4096
ROW = 2**30  # the row stride: row 2 starts at 2³¹


@pytest.fixture(scope="module")
def buffer():
    try:  # 4 GiB of address space; a machine that refuses to reserve it (strict overcommit) cannot run these
        return torch.empty(SPAN, dtype=torch.float16, device=DEVICE)
    except (RuntimeError, MemoryError) as error:
        pytest.skip(f"cannot reserve {SPAN * 2 / 2**30:.1f} GiB: {error}")


def spread(buffer, offset, seqlen, nheads, head_dim, seed):
    """A (1, seqlen ≤ 3, nheads, head_dim) view of ``buffer`` from ``offset`` with rows ROW apart,
    filled with random values (only its own elements are written)."""
    view = buffer.as_strided((1, seqlen, nheads, head_dim), (SPAN, ROW, head_dim, 1), offset)
    view.copy_(torch.randn(view.shape, generator=torch.Generator().manual_seed(seed)))
    return view


def test_wide_only_where_a_tensor_spans_more_than_2_31(buffer):
    q = spread(buffer, 0, 3, 2, 16, seed=0)
    small = torch.empty(1, 3, 2, 16, dtype=torch.float16, device=DEVICE)
    assert launch.wide_offsets(q=q) and launch.wide_offsets(k=small, v=q)
    assert not launch.wide_offsets(q=small, k=small[:, :2]) and not launch.wide_offsets(q=q[:, :2])
    # a head dim that alone spans more than 2³¹: refused, naming the tensor
    with pytest.raises(ValueError, match=r"v of shape \(1, 1, 1, 3\).*its last axis alone"):
        launch.wide_offsets(v=buffer.as_strided((1, 1, 1, 3), (SPAN, SPAN, SPAN, ROW)))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_flash_attn_func_past_2_31_elements(backend, buffer, causal):
    q, k, v = (spread(buffer, offset, 3, 2, 16, seed=offset).detach().requires_grad_()
               for offset in (0, 256, 512))
    do = torch.randn(1, 3, 2, 16, generator=torch.Generator().manual_seed(1)).to(DEVICE, torch.float16)
    out, lse, _ = flashtile.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    grads = torch.autograd.grad(out, (q, k, v), do)
    check_outputs(out, lse, grads, *references(q, k, v, do, causal=causal))


def test_sdpa_layout_and_gqa_past_2_31_elements(backend, buffer):
    # SDPA's (batch, nheads, seqlen, headdim) with the heads 2³⁰ apart: the head offsets are the wide ones
    q = buffer.as_strided((1, 3, 3, 8), (SPAN, ROW, 8, 1), 1024)
    q.copy_(torch.randn(q.shape, generator=torch.Generator().manual_seed(2)))
    k, v = (spread(buffer, offset, 3, 1, 8, seed=offset)[0].transpose(0, 1)[None] for offset in (1536, 1792))
    out = flashtile.attention(q, k, v, is_causal=True, enable_gqa=True)
    expected = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True,
                                                                enable_gqa=True)
    torch.testing.assert_close(out.double(), expected, rtol=0, atol=2e-3)


def test_kvcache_past_2_31_elements(backend, buffer):
    k_cache, v_cache = (spread(buffer, offset, 3, 1, 32, seed=offset) for offset in (2048, 2560))
    q = torch.randn(1, 2, 2, 32, generator=torch.Generator().manual_seed(3)).to(DEVICE, torch.float16)
    new = torch.randn(1, 1, 1, 32, generator=torch.Generator().manual_seed(4)).to(DEVICE, torch.float16)
    out = flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, new, new, cache_seqlens=2, causal=True,
                                            num_splits=2)
    assert torch.equal(k_cache[0, 2], new[0, 0]) and torch.equal(v_cache[0, 2], new[0, 0])  # row 2: past 2³¹
    seqlens = torch.full((1,), 3, dtype=torch.int32, device=DEVICE)
    refs = [kvcache_attention_reference(q, k_cache, v_cache, seqlens, causal=True, compute_dtype=dtype)
            for dtype in (torch.float64, torch.float16)]
    assert_accurate("out", out, refs[0][0], refs[1][0], factor=2)


def test_merge_past_2_31_elements(backend, buffer):
    # two partial results whose outputs are views with rows past 2³¹, merged by their log-sum-exps
    out_a, out_b = (spread(buffer, offset, 3, 2, 16, seed=offset) for offset in (3072, 3584))
    lse_a, lse_b = (torch.randn(1, 2, 3, generator=torch.Generator().manual_seed(seed)).to(DEVICE)
                    for seed in (5, 6))
    out, lse = flashtile.merge_attention_states(out_a, lse_a, out_b, lse_b)
    expected_lse = torch.logaddexp(lse_a, lse_b)
    weights = [torch.exp(part - expected_lse).transpose(1, 2)[..., None] for part in (lse_a, lse_b)]
    torch.testing.assert_close(lse, expected_lse, rtol=0, atol=1e-6)
    torch.testing.assert_close(out.float(), weights[0] * out_a.float() + weights[1] * out_b.float(), rtol=0,
                               atol=2e-3)
