"""V with a head dim of its own (MLA: DeepSeek-V3's 192/128 in training and prefill, 576/512 in
absorbed decoding) through every entry point, against the float64 reference by flash-attn's rule.

The reference needs nothing new (P V has V's head dim), so it judges directly: out, lse and
dq, dk, dv for flash_attn_func (causal, GQA, Nq ≠ Nk, rows that see nothing, every variant), the
varlen functions and ``attention``; the KV cache with a v_cache that is a view into k_cache (the
latent cache of absorbed MLA, written by the append through both views); ring attention in
test_ring.py. The default softmax scale stays 1/√(q's head dim).

Grids are small because the interpreter runs each program in numpy: ~40 s on 2 CPU cores.
"""

import pytest
import torch
from helpers import DEVICE, assert_accurate, check_outputs, make_inputs, packed_inputs, references

import flashtile
from flashtile import reference as ref
from flashtile.reference import kvcache_attention_reference


def inputs(batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, head_dim_v, dtype, seed):
    """q, k (head_dim) and v, dO (head_dim_v), requiring grad, from a fixed seed."""
    q, k, _, _ = make_inputs(batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, dtype, seed=seed)
    _, _, v, do = make_inputs(batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim_v, dtype, seed=seed + 1)
    return q, k, v, do


SHAPES = {  # (batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, head_dim_v, dtype)
    "mla-192-128-bf16": (1, 37, 53, 2, 1, 192, 128, torch.bfloat16),
    "96-64-gqa-fp16": (2, 61, 29, 4, 2, 96, 64, torch.float16),  # causal: rows 0..31 see nothing
    "40-72-fp32": (1, 19, 19, 2, 2, 40, 72, torch.float32),  # v wider than q
}
VARIANTS = {
    "plain": {},
    "window-softcap-alibi-scale": dict(window_size=(12, 3), softcap=5.0, softmax_scale=0.2,
                                       alibi_slopes="per-head"),
}


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_flash_attn_func(backend, shape, variant, causal):
    *dims, dtype = shape
    q, k, v, do = inputs(*dims, dtype, seed=1)
    options = dict(VARIANTS[variant], causal=causal)
    if options.get("alibi_slopes") == "per-head":
        options["alibi_slopes"] = torch.linspace(0.5, 0.1, dims[3], device=DEVICE)
    out, lse, _ = flashtile.flash_attn_func(q, k, v, return_attn_probs=True, **options)
    assert out.shape == (*q.shape[:-1], v.shape[-1]) and out.dtype == q.dtype
    grads = torch.autograd.grad(out, (q, k, v), do)
    check_outputs(out, lse, grads, *references(q, k, v, do, **options))


def test_default_scale_is_that_of_q_head_dim(backend):
    q, k, v, _ = inputs(1, 9, 9, 2, 2, 64, 16, torch.float32, seed=2)
    torch.testing.assert_close(flashtile.flash_attn_func(q, k, v), flashtile.flash_attn_func(q, k, v, softmax_scale=0.125))


def test_varlen(backend):
    seqlens_q, seqlens_k = [3, 0, 20, 1], [5, 2, 31, 0]
    (q, k, _), do, cu_q, cu_k = packed_inputs(seqlens_q, seqlens_k, 4, 2, 48, torch.bfloat16, seed=3)
    (_, _, v), do, _, _ = packed_inputs(seqlens_q, seqlens_k, 4, 2, 32, torch.bfloat16, seed=4)
    out = flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(seqlens_q), max(seqlens_k), causal=True)
    assert out.shape == (len(q), 4, 32)
    grads = torch.autograd.grad(out, (q, k, v), do)
    refs = []
    for dtype in (torch.float64, torch.bfloat16):
        qr, kr, vr = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
        ref_out, _ = ref.varlen_attention_forward(qr, kr, vr, cu_q, cu_k, causal=True)
        refs.append([ref_out, *torch.autograd.grad(ref_out, (qr, kr, vr), do.to(dtype))])
    for name, got, r64, rlow, factor in zip(("out", "dq", "dk", "dv"), (out, *grads), *refs, (2, 3, 3, 3)):
        assert got.shape == r64.shape, name
        assert_accurate(name, got, r64, rlow, factor)


def test_attention_sdpa_layout(backend):
    q, k, v, do = (t.transpose(1, 2) for t in inputs(2, 14, 22, 4, 2, 24, 40, torch.float32, seed=5))
    mask = torch.rand(14, 22, generator=torch.Generator().manual_seed(6)).to(DEVICE) > 0.4
    out = flashtile.attention(q, k, v, attn_mask=mask, enable_gqa=True)
    expected = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask,
                                                                enable_gqa=True)
    assert out.shape == (2, 4, 14, 40)
    torch.testing.assert_close(out.double(), expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("num_splits", [1, 3], ids=lambda s: f"splits{s}")
def test_absorbed_mla_decoding_with_a_latent_cache(backend, num_splits):
    # DeepSeek-V3's absorbed decode: q/k head dim 576 (512 latent + 64 rotary), one KV head, v the
    # first 512 channels of the cached latent (a view, no copy); paged, with a 2-token append
    g = torch.Generator().manual_seed(7)
    batch, nheads, page_size, num_pages = 2, 4, 16, 9

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(DEVICE, torch.bfloat16)

    latent = rand(num_pages, page_size, 1, 576)
    block_table = torch.randperm(num_pages, generator=g)[:8].view(batch, 4).to(DEVICE, torch.int32)
    q, new = rand(batch, 2, nheads, 576), rand(batch, 2, 1, 576)
    cache_seqlens = torch.tensor([0, 45], dtype=torch.int32, device=DEVICE)
    expected_latent = latent.clone()
    for b in range(batch):
        for t in range(2):
            position = int(cache_seqlens[b]) + t
            expected_latent[block_table[b, position // page_size], position % page_size] = new[b, t]
    out, lse = flashtile.flash_attn_with_kvcache(
        q, latent, latent[..., :512], new, new[..., :512], cache_seqlens=cache_seqlens, block_table=block_table,
        causal=True, num_splits=num_splits, return_softmax_lse=True)
    assert torch.equal(latent, expected_latent)
    assert out.shape == (batch, 2, nheads, 512)
    refs = [kvcache_attention_reference(q, latent, latent[..., :512], cache_seqlens + 2, None, block_table,
                                        causal=True, compute_dtype=dtype) for dtype in (torch.float64, torch.bfloat16)]
    assert_accurate("out", out, refs[0][0], refs[1][0], factor=2)
    torch.testing.assert_close(lse.double(), refs[0][1], rtol=0, atol=1e-5)
    assert (refs[0][1][0, :, 0] > -float("inf")).all()  # sequence 0 sees its first new key


def test_kvcache_192_128_with_append(backend):
    g = torch.Generator().manual_seed(8)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(DEVICE, torch.float16)

    k_cache, v_cache = rand(3, 40, 2, 192), rand(3, 40, 2, 128)
    q, k, v = rand(2, 3, 4, 192), rand(2, 3, 2, 192), rand(2, 3, 2, 128)
    cache_seqlens = torch.tensor([10, 33], dtype=torch.int32, device=DEVICE)
    cache_batch_idx = torch.tensor([2, 0], dtype=torch.int32, device=DEVICE)
    out = flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens,
                                            cache_batch_idx=cache_batch_idx, num_splits=2)
    assert torch.equal(v_cache[2, 10:13], v[0]) and torch.equal(k_cache[0, 33:36], k[1])
    refs = [kvcache_attention_reference(q, k_cache, v_cache, cache_seqlens + 3, cache_batch_idx, compute_dtype=dtype)
            for dtype in (torch.float64, torch.float16)]
    assert out.shape == (2, 3, 4, 128)
    assert_accurate("out", out, refs[0][0], refs[1][0], factor=2)


@pytest.mark.parametrize(
    "shapes, message",
    [(((1, 5, 2, 64), (1, 5, 2, 64), (1, 6, 2, 32)), "same shape but for the head dim"),
     (((1, 5, 2, 64), (1, 5, 2, 64), (1, 5, 2, 257)), r"head dim of v must be in 1\.\.256"),
     (((1, 5, 2, 64), (1, 5, 2, 48), (1, 5, 2, 48)), "head dims of q and k differ")],
    ids=["seqlen", "v-too-wide", "q-k"],
)
def test_bad_shapes_raise_clear_errors(shapes, message):
    q, k, v = (torch.zeros(shape, device=DEVICE, dtype=torch.float16) for shape in shapes)
    with pytest.raises(ValueError, match=message):
        flashtile.flash_attn_func(q, k, v)


@pytest.mark.parametrize(
    "head_dims, message",
    [((577, 512), r"head dim must be in 1\.\.576"), ((576, 513), r"head dim of v_cache must be in 1\.\.512")],
    ids=["qk-577", "v-513"],
)
def test_kvcache_head_dim_limits(head_dims, message):
    head_dim, head_dim_v = head_dims
    q = torch.zeros(1, 1, 2, head_dim, device=DEVICE, dtype=torch.bfloat16)
    k_cache = torch.zeros(1, 8, 1, head_dim, device=DEVICE, dtype=torch.bfloat16)
    v_cache = torch.zeros(1, 8, 1, head_dim_v, device=DEVICE, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=message):
        flashtile.flash_attn_with_kvcache(q, k_cache, v_cache)
    # and a new v whose head dim is not v_cache's
    k_cache, v_cache = k_cache[..., :64], v_cache[..., :32]
    with pytest.raises(ValueError, match=r"v must be \(batch, seqlen_new, nheads_k, headdim_v\)"):
        flashtile.flash_attn_with_kvcache(q[..., :64], k_cache, v_cache, k_cache[:, :1], k_cache[:, :1], cache_seqlens=1)
