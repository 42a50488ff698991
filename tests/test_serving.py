"""The call shapes inference engines use: paged varlen prefill (vLLM's flash_attn_varlen_func with
block_table and seqused_k) and varlen queries against a KV cache (SGLang's flash_attn_with_kvcache
with cu_seqlens_q), on mixed batches: decode rows of one query beside prefill chunks.

The specification is ``kvcache_attention_reference`` per sequence: sequence b's queries attend to
its first seqused_k[b] cache slots (after any append), causal aligned bottom-right per sequence, so
a chunk of new queries sees the whole cached prefix. Judged against float64 by flash-attn's rule.

Grids are small because the interpreter runs each program in numpy: ~30 s on 2 CPU cores.
"""

import importlib.util
import math
import sys
import types
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl
from helpers import DEVICE, assert_accurate

import flashtile
from flashtile import ops
from flashtile._options import AttentionOptions
from flashtile.reference import kvcache_attention_reference
from flashtile.triton import configs, launch, plans
from flashtile.triton.decode import quantise_float8

SEQLENS_Q = [1, 37, 1, 5, 0, 3]  # decode rows, a prefill chunk, a prompt from scratch, an idle slot
SEQUSED_K = [20, 60, 1, 5, 9, 3]  # keys per sequence, the new queries' own included


def paged_cache(seqused_k, page_size, nheads_k, head_dim, dtype, g, spare_pages=2):
    """(k_cache, v_cache) (num_pages, page_size, nheads_k, head_dim) and a block table whose pages are
    shuffled through the pool (plus pages nobody owns)."""
    pages_per_seq = max(1, math.ceil(max(seqused_k) / page_size))
    num_pages = len(seqused_k) * pages_per_seq + spare_pages
    k_cache, v_cache = (torch.randn(num_pages, page_size, nheads_k, head_dim, generator=g).to(DEVICE, dtype)
                        for _ in range(2))
    order = torch.randperm(num_pages, generator=g)[: len(seqused_k) * pages_per_seq]
    return k_cache, v_cache, order.view(len(seqused_k), pages_per_seq).to(DEVICE, torch.int32)


def cumulative(lengths):
    return torch.tensor([0] + lengths, device=DEVICE).cumsum(0).to(torch.int32)


def per_sequence_reference(q, k_cache, v_cache, cu_seqlens_q, seqlens_k, block_table, dtype, **options):
    """(out (total_q, H, Dv), lse (H, total_q)) of each sequence through kvcache_attention_reference."""
    outs, lses = [], []
    for b in range(len(seqlens_k)):
        rows = slice(int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1]))
        table = None if block_table is None else block_table[b:b + 1]
        cache_rows = (k_cache, v_cache) if table is not None else (k_cache[b:b + 1], v_cache[b:b + 1])
        slopes = options.get("alibi_slopes")
        out, lse = kvcache_attention_reference(
            q[rows][None], *cache_rows, seqlens_k[b:b + 1], None, table, compute_dtype=dtype,
            **dict(options, alibi_slopes=None if slopes is None else slopes.expand(len(seqlens_k), -1)[b]))
        outs.append(out[0])
        lses.append(lse[0])
    return torch.cat(outs), torch.cat(lses, dim=1)


VARIANTS = {
    "causal": dict(causal=True),
    "full": dict(causal=False),
    "window-softcap": dict(causal=True, window_size=(8, 0), softcap=3.0),
    "alibi-sink": dict(causal=True, alibi_slopes="per-sequence", learnable_sink="per-head"),
}


def _options(variant, batch, nheads, g):
    options = dict(VARIANTS[variant])
    if options.get("alibi_slopes") == "per-sequence":
        options["alibi_slopes"] = torch.rand(batch, nheads, generator=g).to(DEVICE)
    if options.get("learnable_sink") == "per-head":
        options["learnable_sink"] = torch.randn(nheads, generator=g).to(DEVICE)
    return options


def _check(out, lse, refs):
    assert out.shape == refs[0][0].shape and lse.shape == refs[0][1].shape
    assert_accurate("out", out, refs[0][0], refs[1][0], factor=2)
    seen = torch.isfinite(refs[0][1])
    assert torch.equal(torch.isneginf(lse), ~seen)
    torch.testing.assert_close(lse[seen].double(), refs[0][1][seen].double(), rtol=0, atol=1e-5)


@pytest.fixture(params=["kvcache-kernel", "forward-kernel"])
def paged_route(request, backend, monkeypatch):
    """Which Triton kernel takes packed queries against a paged cache: the KV-cache kernel, or (every
    batch counting as a prefill here) the forward kernel with IS_PAGED; the PyTorch path has one route."""
    if request.param == "forward-kernel":
        if backend == "torch":
            pytest.skip("the PyTorch path has one route")
        monkeypatch.setattr(configs, "PAGED_PREFILL_MIN_QUERIES", 1)
    return request.param


# pages of 8 narrow the forward kernel's key blocks to 32 keys (configs.paged_fwd_config)
@pytest.mark.parametrize("page_size", [1, 8, 16, 256], ids=lambda p: f"page{p}")
@pytest.mark.parametrize("variant", VARIANTS)
def test_paged_varlen_prefill(paged_route, variant, page_size):
    g = torch.Generator().manual_seed(page_size)
    nheads, nheads_k, head_dim, dtype = 4, 2, 32, torch.bfloat16
    k_cache, v_cache, block_table = paged_cache(SEQUSED_K, page_size, nheads_k, head_dim, dtype, g)
    q = torch.randn(sum(SEQLENS_Q), nheads, head_dim, generator=g).to(DEVICE, dtype)
    cu_seqlens_q, seqused_k = cumulative(SEQLENS_Q), torch.tensor(SEQUSED_K, dtype=torch.int32, device=DEVICE)
    options = _options(variant, len(SEQLENS_Q), nheads, g)
    out, lse, _ = flashtile.flash_attn_varlen_func(
        q, k_cache, v_cache, cu_seqlens_q, None, max(SEQLENS_Q), max(SEQUSED_K), block_table=block_table,
        seqused_k=seqused_k, return_attn_probs=True, **options)
    refs = [per_sequence_reference(q, k_cache, v_cache, cu_seqlens_q, seqused_k, block_table, dt, **options)
            for dt in (torch.float64, dtype)]
    _check(out, lse, refs)


def test_paged_prefill_route():
    # the forward kernel takes a batch of prefills (64 queries a sequence on average, or more), and
    # leaves decoding rows and the KV-cache kernel's own features to it
    table, cu = torch.zeros(2, 4, dtype=torch.int32), torch.tensor([0, 80, 128], dtype=torch.int32)
    cache, q = torch.empty(8, 16, 2, 64, dtype=torch.bfloat16), torch.empty(128, 4, 64, dtype=torch.bfloat16)

    def usable(q=q, cache=cache, table=table, cu=cu, **features):
        arguments = {**dict(cache_batch_idx=None, cache_leftpad=None, k_descale=None, rotary_cos=None), **features}
        return launch.paged_prefill_usable(q, cache, cache, block_table=table, cu_seqlens_q=cu, **arguments)

    assert configs.PAGED_PREFILL_MIN_QUERIES == 64 and usable()
    assert not usable(q=q[:127])  # 63.5 queries a sequence: decoding rows among them
    assert not usable(table=None) and not usable(cu=None)
    assert not usable(k_descale=torch.ones(2, 2)) and not usable(cache_leftpad=torch.zeros(2, dtype=torch.int32))
    assert not usable(rotary_cos=torch.ones(4, 8)) and not usable(config=dict(BLOCK_N=32))
    assert not usable(q=torch.empty(128, 4, 288, dtype=torch.bfloat16),
                      cache=torch.empty(8, 16, 2, 288, dtype=torch.bfloat16))  # beyond the forward kernel's 256


def test_page_ids_outside_the_cache_hide_their_keys_on_both_routes(monkeypatch):
    # the KV-cache kernel's rule, which the forward kernel repeats: such a page's keys are invisible
    g = torch.Generator().manual_seed(3)
    k_cache, v_cache, block_table = paged_cache(SEQUSED_K, 16, 2, 32, torch.float32, g)
    block_table[1, 1], block_table[3, 0] = -1, k_cache.shape[0] + 5
    q = torch.randn(sum(SEQLENS_Q), 4, 32, generator=g).to(DEVICE)
    cu_seqlens_q, seqused_k = cumulative(SEQLENS_Q), torch.tensor(SEQUSED_K, dtype=torch.int32, device=DEVICE)
    results = []
    for min_queries in (configs.PAGED_PREFILL_MIN_QUERIES, 1):
        monkeypatch.setattr(configs, "PAGED_PREFILL_MIN_QUERIES", min_queries)
        plans.clear()
        # the operator itself: the public function refuses such a table where it can read it (here, on a CPU)
        results.append(ops.kvcache_attention(q, k_cache, v_cache, seqused_k, None, block_table,
                                             AttentionOptions(32 ** -0.5, window_right=0), cu_seqlens_q=cu_seqlens_q,
                                             max_seqlen_q=max(SEQLENS_Q)))
    for by_kvcache, by_forward in zip(*results):
        torch.testing.assert_close(by_forward, by_kvcache, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("page_size", [16, 64, 256], ids=lambda p: f"page{p}")
def test_paged_prefill_over_many_key_blocks(paged_route, page_size):
    # sequences of several 64-key blocks: blocks that start inside a page, whole (unmasked) blocks, a page
    # id outside the cache among them, and cache memory that no sequence owns (spare pages, slots past a
    # sequence's keys) holding NaN, which must reach no output
    g = torch.Generator().manual_seed(page_size)
    seqlens_q, seqused = [70, 130], [300, 130]
    k_cache, v_cache, block_table = paged_cache(seqused, page_size, 1, 32, torch.bfloat16, g)
    block_table[0, 1] = -1  # keys [page_size, 2 · page_size) of sequence 0 are hidden
    owned = torch.zeros(k_cache.shape[:2], dtype=torch.bool)
    for b, used in enumerate(seqused):
        for j in range(used):
            page = int(block_table[b, j // page_size])
            if page >= 0:
                owned[page, j % page_size] = True
    k_cache[~owned.to(DEVICE)], v_cache[~owned.to(DEVICE)] = float("nan"), float("nan")
    q = torch.randn(sum(seqlens_q), 2, 32, generator=g).to(DEVICE, torch.bfloat16)
    cu_seqlens_q, seqused_k = cumulative(seqlens_q), torch.tensor(seqused, dtype=torch.int32, device=DEVICE)
    # the operator itself: the public function refuses such a table where it can read it (here, on a CPU)
    out, lse = ops.kvcache_attention(q, k_cache, v_cache, seqused_k, None, block_table,
                                     AttentionOptions(32 ** -0.5, window_right=0), cu_seqlens_q=cu_seqlens_q,
                                     max_seqlen_q=max(seqlens_q))
    refs = [per_sequence_reference(q, k_cache, v_cache, cu_seqlens_q, seqused_k, block_table, dt, causal=True)
            for dt in (torch.float64, torch.bfloat16)]
    _check(out, lse, refs)


def test_paged_varlen_lengths_from_cu_seqlens_k(backend):
    # flash-attn 2's form: no seqused_k, the keys of sequence b are cu_seqlens_k[b + 1] − cu_seqlens_k[b]
    g = torch.Generator().manual_seed(1)
    k_cache, v_cache, block_table = paged_cache(SEQUSED_K, 16, 1, 16, torch.float16, g)
    q = torch.randn(sum(SEQLENS_Q), 2, 16, generator=g).to(DEVICE, torch.float16)
    cu_seqlens_q, cu_seqlens_k = cumulative(SEQLENS_Q), cumulative(SEQUSED_K)
    out = flashtile.flash_attn_varlen_func(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, max(SEQLENS_Q),
                                           max(SEQUSED_K), causal=True, block_table=block_table)
    seqused_k = torch.tensor(SEQUSED_K, dtype=torch.int32, device=DEVICE)
    expected = flashtile.flash_attn_varlen_func(q, k_cache, v_cache, cu_seqlens_q, None, max(SEQLENS_Q),
                                                max(SEQUSED_K), causal=True, block_table=block_table,
                                                seqused_k=seqused_k)
    assert torch.equal(out, expected)


@pytest.mark.parametrize("num_splits", [1, 3], ids=lambda s: f"splits{s}")
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_kvcache_varlen_queries_with_append(backend, paged, num_splits):
    # chunked prefill and speculative decoding in one call: each sequence appends its new tokens
    # (packed like q) at cache_seqlens[b], then its queries attend to the cache, causal per sequence
    g = torch.Generator().manual_seed(2)
    seqlens_new, cache_seqlens = [1, 12, 4, 0], [30, 0, 17, 5]
    nheads, nheads_k, head_dim, dtype, capacity = 4, 1, 24, torch.float16, 64
    if paged:
        k_cache, v_cache, block_table = paged_cache([capacity] * 4, 16, nheads_k, head_dim, dtype, g)
    else:
        k_cache, v_cache = (torch.randn(4, capacity, nheads_k, head_dim, generator=g).to(DEVICE, dtype)
                            for _ in range(2))
        block_table = None
    total = sum(seqlens_new)
    q = torch.randn(total, nheads, head_dim, generator=g).to(DEVICE, dtype)
    k, v = (torch.randn(total, nheads_k, head_dim, generator=g).to(DEVICE, dtype) for _ in range(2))
    cu_seqlens_q = cumulative(seqlens_new)
    cache_seqlens_t = torch.tensor(cache_seqlens, dtype=torch.int32, device=DEVICE)
    k_expected, v_expected = k_cache.clone(), v_cache.clone()
    for b, (start, n) in enumerate(zip(cache_seqlens, seqlens_new)):
        for t in range(n):
            position, row = start + t, int(cu_seqlens_q[b]) + t
            where = ((int(block_table[b, position // 16]), position % 16) if paged else (b, position))
            k_expected[where], v_expected[where] = k[row], v[row]
    out, lse = flashtile.flash_attn_with_kvcache(
        q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens_t, block_table=block_table, causal=True,
        cu_seqlens_q=cu_seqlens_q, max_seqlen_q=max(seqlens_new), num_splits=num_splits, return_softmax_lse=True)
    assert torch.equal(k_cache, k_expected) and torch.equal(v_cache, v_expected)
    seqlens_k = cache_seqlens_t + torch.tensor(seqlens_new, dtype=torch.int32, device=DEVICE)
    refs = [per_sequence_reference(q, k_cache, v_cache, cu_seqlens_q, seqlens_k, block_table, dt, causal=True)
            for dt in (torch.float64, dtype)]
    _check(out, lse, refs)


def test_tokens_outside_every_sequence_give_zero(backend):
    # cu_seqlens_q covering 6 of 8 query tokens: the last two get 0 and -inf, as in the packed kernels
    g = torch.Generator().manual_seed(3)
    k_cache, v_cache, block_table = paged_cache([10, 10], 16, 1, 16, torch.float32, g)
    q = torch.randn(8, 2, 16, generator=g).to(DEVICE)
    out, lse, _ = flashtile.flash_attn_varlen_func(
        q, k_cache, v_cache, cumulative([3, 3]), None, 3, 10, block_table=block_table, return_attn_probs=True,
        seqused_k=torch.tensor([10, 4], dtype=torch.int32, device=DEVICE))
    assert (out[6:] == 0).all() and torch.isneginf(lse[:, 6:]).all() and torch.isfinite(lse[:, :6]).all()


@pytest.mark.parametrize(
    "change, error, message",
    [(dict(requires_grad=True), NotImplementedError, "no backward"),
     (dict(dropout_p=0.1), NotImplementedError, "dropout"),
     (dict(seqused_k="without block_table"), NotImplementedError, "seqused_k"),
     (dict(block_table="2-D float"), TypeError, "block_table must be int32")],
    ids=["grad", "dropout", "seqused-k-alone", "float-table"],
)
def test_paged_varlen_refuses_what_it_cannot_do(change, error, message):
    g = torch.Generator().manual_seed(4)
    k_cache, v_cache, block_table = paged_cache([10, 10], 16, 1, 16, torch.float16, g)
    q = torch.randn(4, 2, 16, generator=g).to(DEVICE, torch.float16)
    seqused_k = torch.tensor([10, 4], dtype=torch.int32, device=DEVICE)
    kwargs = dict(block_table=block_table, seqused_k=seqused_k)
    if change.get("requires_grad"):
        q.requires_grad_()
    if "dropout_p" in change:
        kwargs["dropout_p"] = change["dropout_p"]
    if change.get("seqused_k"):
        kwargs.pop("block_table")
    if change.get("block_table"):
        kwargs["block_table"] = block_table.float()
    with pytest.raises(error, match=message):
        flashtile.flash_attn_varlen_func(q, k_cache, v_cache, cumulative([2, 2]), None, 2, 10, **kwargs)


def rotate(x, positions, freqs, interleaved):
    """The rotary embedding by its definition, independent of the library's: each channel pair as a
    complex number times e^{i · position · freq}; x (..., nheads, headdim), positions x's leading shape."""
    rotary_dim = 2 * freqs.numel()
    pairs = x[..., :rotary_dim].double()
    if interleaved:
        real, imag = pairs[..., 0::2], pairs[..., 1::2]
    else:
        real, imag = pairs[..., :rotary_dim // 2], pairs[..., rotary_dim // 2:]
    angle = positions.double()[..., None, None] * freqs.double().to(DEVICE)  # [..., 1, rotary_dim / 2]
    turned = torch.complex(real, imag) * torch.polar(torch.ones_like(angle), angle)
    parts = (turned.real, turned.imag)
    rotated = torch.stack(parts, -1).flatten(-2) if interleaved else torch.cat(parts, -1)
    return torch.cat((rotated.to(x.dtype), x[..., rotary_dim:]), dim=-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "neox"])
def test_rotary_on_q_and_the_appended_k(backend, interleaved, causal, dtype):
    g = torch.Generator().manual_seed(5)
    batch, seqlen_new, nheads, nheads_k, head_dim, capacity = 2, 3, 4, 2, 32, 40
    freqs = 1.0 / 100.0 ** (torch.arange(8, dtype=torch.float64) / 8)  # rotary_dim 16 of 32: half pass through
    angles = torch.arange(64, dtype=torch.float64)[:, None] * freqs  # [seqlen_ro, rotary_dim / 2]
    cos, sin = angles.cos().float().to(DEVICE), angles.sin().float().to(DEVICE)
    k_cache, v_cache = (torch.randn(batch, capacity, nheads_k, head_dim, generator=g).to(DEVICE, dtype)
                        for _ in range(2))
    q = torch.randn(batch, seqlen_new, nheads, head_dim, generator=g).to(DEVICE, dtype)
    k, v = (torch.randn(batch, seqlen_new, nheads_k, head_dim, generator=g).to(DEVICE, dtype) for _ in range(2))
    cache_seqlens = torch.tensor([7, 30], dtype=torch.int32, device=DEVICE)
    positions = cache_seqlens.long()[:, None] + torch.arange(seqlen_new, device=DEVICE)  # [B, S]
    k_expected, v_expected = k_cache.double(), v_cache.clone()  # k exact (float64), v copied bit for bit
    k_rotated = rotate(k.double(), positions, freqs, interleaved)
    for b in range(batch):
        k_expected[b, cache_seqlens[b]:cache_seqlens[b] + seqlen_new] = k_rotated[b]
        v_expected[b, cache_seqlens[b]:cache_seqlens[b] + seqlen_new] = v[b]
    q_positions = positions if causal else cache_seqlens.long()[:, None].expand_as(positions)
    out = flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens, causal=causal,
                                            rotary_cos=cos, rotary_sin=sin, rotary_interleaved=interleaved)
    # the rotation in float32, rounded once to the cache's dtype: within float32's error, or within one
    # bfloat16 step (2⁻⁷ relative) of the exact value: the GPU rounds to nearest (half a step), Triton's
    # interpreter truncates float32 to bfloat16 (up to 0.0074 relative measured here)
    rounding = dict(rtol=0, atol=1e-6) if dtype == torch.float32 else dict(rtol=2 ** -7, atol=1e-6)
    torch.testing.assert_close(k_cache.double(), k_expected, **rounding)
    assert torch.equal(v_cache, v_expected)
    q_rotated = rotate(q, q_positions, freqs, interleaved)
    refs = [kvcache_attention_reference(q_rotated, k_cache, v_cache, cache_seqlens + seqlen_new, causal=causal,
                                        compute_dtype=compute)[0] for compute in (torch.float64, dtype)]
    assert_accurate("out", out, *refs, factor=2)


@pytest.mark.parametrize("num_splits", [1, 3], ids=lambda s: f"splits{s}")
def test_cache_leftpad(backend, num_splits):
    # sequence b's keys are slots [leftpad[b], cache_seqlens[b] + new): the same as a cache that starts there
    g = torch.Generator().manual_seed(6)
    leftpad, cache_seqlens, seqlen_new = [3, 0, 30, 5], [8, 5, 40, 5], 2
    batch, nheads, head_dim, capacity = 4, 2, 16, 64
    k_cache, v_cache = (torch.randn(batch, capacity, 1, head_dim, generator=g).to(DEVICE, torch.bfloat16)
                        for _ in range(2))
    q = torch.randn(batch, seqlen_new, nheads, head_dim, generator=g).to(DEVICE, torch.bfloat16)
    k, v = (torch.randn(batch, seqlen_new, 1, head_dim, generator=g).to(DEVICE, torch.bfloat16) for _ in range(2))
    options = dict(causal=True, window_size=(20, 0), alibi_slopes=torch.tensor([0.3, 0.1], device=DEVICE))
    out, lse = flashtile.flash_attn_with_kvcache(
        q, k_cache, v_cache, k, v, cache_seqlens=torch.tensor(cache_seqlens, dtype=torch.int32, device=DEVICE),
        cache_leftpad=torch.tensor(leftpad, dtype=torch.int32, device=DEVICE), num_splits=num_splits,
        return_softmax_lse=True, **options)
    assert torch.isfinite(lse).all()  # sequence 3 (leftpad = cache_seqlens): only its 2 new keys
    refs = []
    for dtype in (torch.float64, torch.bfloat16):
        outs = []
        for b in range(batch):
            end = cache_seqlens[b] + seqlen_new
            keys = slice(leftpad[b], end)
            ref_out, _ = kvcache_attention_reference(
                q[b:b + 1], k_cache[b:b + 1, keys], v_cache[b:b + 1, keys],
                torch.tensor([end - leftpad[b]], dtype=torch.int32, device=DEVICE), compute_dtype=dtype, **options)
            outs.append(ref_out)
        refs.append(torch.cat(outs))
    assert_accurate("out", out, refs[0], refs[1], factor=2)


def test_rotary_with_a_window_as_long_as_the_cache_is_not_local(backend):
    # flash-attn 2's rule: a window side at least as long as the cache becomes −1, so the call is not "local"
    # and every query is rotated at cache_seqlens, as without a window (the mask is the same either way)
    g = torch.Generator().manual_seed(8)
    q = torch.randn(1, 3, 2, 16, generator=g).to(DEVICE)
    cache = [torch.randn(1, 16, 2, 16, generator=g).to(DEVICE) for _ in range(2)]
    k, v = (torch.randn(1, 3, 2, 16, generator=g).to(DEVICE) for _ in range(2))
    angles = torch.rand(16, 8, generator=g).to(DEVICE) * 6
    cache_seqlens = torch.tensor([4], dtype=torch.int32, device=DEVICE)
    outs = [flashtile.flash_attn_with_kvcache(q, *(t.clone() for t in cache), k, v, cache_seqlens=cache_seqlens,
                                              rotary_cos=angles.cos(), rotary_sin=angles.sin(), window_size=window)
            for window in ((-1, -1), (100, 100), (16, -1))]
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_rotary_and_leftpad_validation():
    q = torch.zeros(1, 1, 2, 16, device=DEVICE)
    cache = torch.zeros(1, 8, 1, 16, device=DEVICE)
    new = dict(k=torch.zeros(1, 1, 1, 16, device=DEVICE), v=torch.zeros(1, 1, 1, 16, device=DEVICE), cache_seqlens=0)
    with pytest.raises(ValueError, match="pass k and v to append as well"):  # flash-attn 2 refuses it too
        flashtile.flash_attn_with_kvcache(q, cache, cache, rotary_cos=torch.zeros(8, 4, device=DEVICE),
                                          rotary_sin=torch.zeros(8, 4, device=DEVICE))
    with pytest.raises(ValueError, match=r"rotary_dim = 2 · 9 must be in 1..headdim \(16\)"):
        flashtile.flash_attn_with_kvcache(q, cache, cache, rotary_cos=torch.zeros(8, 9, device=DEVICE),
                                          rotary_sin=torch.zeros(8, 9, device=DEVICE), **new)
    with pytest.raises(ValueError, match="must share one shape"):
        flashtile.flash_attn_with_kvcache(q, cache, cache, rotary_cos=torch.zeros(8, 4, device=DEVICE),
                                          rotary_sin=torch.zeros(7, 4, device=DEVICE), **new)
    wide = torch.zeros(1, 8, 1, 288, device=DEVICE)
    with pytest.raises(ValueError, match="rotary embeddings take head dims up to 256"):
        flashtile.flash_attn_with_kvcache(wide[:, :1].expand(1, 1, 2, 288), wide, wide, wide[:, :1], wide[:, :1],
                                          cache_seqlens=0, rotary_cos=torch.zeros(8, 4, device=DEVICE),
                                          rotary_sin=torch.zeros(8, 4, device=DEVICE))
    with pytest.raises(ValueError, match="need a row for each of the KV cache's 8 positions"):
        flashtile.flash_attn_with_kvcache(q, cache, cache, rotary_cos=torch.zeros(7, 4, device=DEVICE),
                                          rotary_sin=torch.zeros(7, 4, device=DEVICE), **new)
    with pytest.raises(TypeError, match="rotary_sin must be a float tensor"):
        flashtile.flash_attn_with_kvcache(q, cache, cache, rotary_cos=torch.zeros(8, 4, device=DEVICE), **new)
    with pytest.raises(TypeError, match="cache_leftpad must be int32"):
        flashtile.flash_attn_with_kvcache(q, cache, cache, cache_leftpad=torch.zeros(1, device=DEVICE))
    with pytest.raises(NotImplementedError, match="cache_leftpad cannot be combined with block_table"):
        flashtile.flash_attn_with_kvcache(q, cache, cache, cache_leftpad=torch.zeros(1, dtype=torch.int32,
                                                                                     device=DEVICE),
                                          block_table=torch.zeros(1, 1, dtype=torch.int32, device=DEVICE))


def test_rotary_with_packed_queries_equals_the_batch_form(backend):
    # two sequences of 3 new tokens: packed with cu_seqlens_q, or as a (2, 3, ...) batch: the same call
    g = torch.Generator().manual_seed(7)
    angles = torch.arange(32, dtype=torch.float64)[:, None] * torch.tensor([1.0, 0.3, 0.1, 0.01], dtype=torch.float64)
    cos, sin = angles.cos().float().to(DEVICE), angles.sin().float().to(DEVICE)
    caches = [torch.randn(2, 24, 1, 16, generator=g).to(DEVICE) for _ in range(2)]
    q = torch.randn(2, 3, 2, 16, generator=g).to(DEVICE)
    k, v = (torch.randn(2, 3, 1, 16, generator=g).to(DEVICE) for _ in range(2))
    cache_seqlens = torch.tensor([4, 19], dtype=torch.int32, device=DEVICE)
    batch_caches = [t.clone() for t in caches]
    expected = flashtile.flash_attn_with_kvcache(q, *batch_caches, k, v, cache_seqlens=cache_seqlens, causal=True,
                                                 rotary_cos=cos, rotary_sin=sin, rotary_interleaved=False)
    out = flashtile.flash_attn_with_kvcache(q.flatten(0, 1), *caches, k.flatten(0, 1), v.flatten(0, 1),
                                            cache_seqlens=cache_seqlens, causal=True, rotary_cos=cos, rotary_sin=sin,
                                            rotary_interleaved=False, cu_seqlens_q=cumulative([3, 3]), max_seqlen_q=3)
    assert all(torch.equal(a, b) for a, b in zip(caches, batch_caches))
    torch.testing.assert_close(out, expected.flatten(0, 1), rtol=0, atol=1e-6)


FLOAT8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


@triton.jit
def _quantise_float8_kernel(X, Y, descale, N: tl.constexpr, FP8_MAX: tl.constexpr, MANTISSA: tl.constexpr,
                            MIN_EXPONENT: tl.constexpr):
    offsets = tl.arange(0, N)
    tl.store(Y + offsets, quantise_float8(tl.load(X + offsets), descale, FP8_MAX, MANTISSA, MIN_EXPONENT))


@pytest.mark.parametrize("fmt", FLOAT8)
def test_appended_values_are_quantised_as_torch_quantises_them(fmt):
    # the append kernel's rounding to float8 (before the store's conversion, which is then exact on a GPU) against
    # the CPU path's (x / descale).clamp(-max, max).to(float8), bit for bit: ties, subnormals, values beyond the
    # format, the sign of zero and NaN (which a clamp without NaN propagation and the bit arithmetic made finite)
    dtype8 = FLOAT8[fmt]
    info = torch.finfo(dtype8)
    g = torch.Generator().manual_seed(5)
    special = [0.0, -0.0, -1e-9, 1e-9, info.tiny / 3, -info.tiny / 2, info.tiny * 1.0625, float("nan"),
               float("inf"), float("-inf"), info.max * 1.01, -info.max * 4, 1.0 + info.eps / 2, -(1.0 + 1.5 * info.eps)]
    x = torch.cat([torch.tensor(special), torch.randn(1024 - len(special), generator=g) * 4.0 ** torch.randint(
        -8, 8, (1024 - len(special),), generator=g)]).to(DEVICE)
    y = torch.empty_like(x)
    _quantise_float8_kernel[(1,)](x, y, 0.75, N=1024, FP8_MAX=info.max, MANTISSA=round(-math.log2(info.eps)),
                                  MIN_EXPONENT=round(math.log2(info.tiny)))
    expected = (x / 0.75).clamp(-info.max, info.max).to(dtype8).float()
    assert torch.equal(y.isnan(), expected.isnan())
    numbers = ~expected.isnan()
    assert torch.equal(y[numbers], expected[numbers]) and torch.equal(y.signbit()[numbers], expected.signbit()[numbers])


@pytest.mark.parametrize("num_splits", [1, 3], ids=lambda s: f"splits{s}")
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("fmt", FLOAT8)
def test_fp8_kv_cache(backend, fmt, paged, num_splits):
    dtype8 = FLOAT8[fmt]
    g = torch.Generator().manual_seed(8)
    batch, seqlen_new, nheads, nheads_k, head_dim, capacity = 3, 2, 4, 2, 32, 48
    if paged:
        k_cache, v_cache, block_table = paged_cache([capacity] * batch, 16, nheads_k, head_dim, torch.float32, g)
    else:
        k_cache, v_cache = (torch.randn(batch, capacity, nheads_k, head_dim, generator=g).to(DEVICE)
                            for _ in range(2))
        block_table = None
    k_cache, v_cache = (3 * k_cache).to(dtype8), (3 * v_cache).to(dtype8)
    q = torch.randn(batch, seqlen_new, nheads, head_dim, generator=g).to(DEVICE, torch.bfloat16)
    k, v = (torch.randn(batch, seqlen_new, nheads_k, head_dim, generator=g).to(DEVICE, torch.bfloat16)
            for _ in range(2))
    k_descale, v_descale = ((torch.rand(batch, nheads_k, generator=g) + 0.5).to(DEVICE) for _ in range(2))
    cache_seqlens = torch.tensor([0, 17, 46], dtype=torch.int32, device=DEVICE)
    expected_caches = (k_cache.clone(), v_cache.clone())
    flashtile.reference.kvcache_append_reference(*expected_caches, k, v, cache_seqlens, None, block_table,
                                                 k_descale=k_descale, v_descale=v_descale)
    out = flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens,
                                            block_table=block_table, causal=True, num_splits=num_splits,
                                            k_descale=k_descale, v_descale=v_descale)
    # the same float8 values: the kernel rounds to nearest even before it converts, as PyTorch's cast rounds
    for actual, expected in zip((k_cache, v_cache), expected_caches):
        assert torch.equal(actual.float(), expected.float())
    # the attention, judged on the cache as written: the reference dequantises it
    refs = [kvcache_attention_reference(q, k_cache, v_cache, cache_seqlens + seqlen_new, None, block_table,
                                        causal=True, compute_dtype=dtype, k_descale=k_descale, v_descale=v_descale)
            for dtype in (torch.float64, torch.bfloat16)]
    assert_accurate("out", out, refs[0][0], refs[1][0], factor=2)


Q_MAGNITUDES = {  # (the scale of q's heads, softmax_scale): far outside float16's range either way, heads
    "large": ([2.0 ** 20] * 4, 2.0 ** -20 / 8),  # of very different sizes in one block, an inf in one head
    "small": ([2.0 ** -26] * 4, 2.0 ** 24 / 8),
    "mixed-heads": ([2.0 ** 20] + [2.0 ** -14] * 3, 2.0 ** 12),
    "inf-in-one-head": ([math.inf] + [1.0] * 3, 0.125),
}


@pytest.mark.parametrize("case", Q_MAGNITUDES)
def test_fp8_kv_cache_q_magnitudes(backend, case):
    # bfloat16 q against a float8 cache: the kernel's dots run in float16, each row of q divided by a power
    # of two that fits it; the judged heads (the small ones; those without the inf) must be as exact as usual
    g = torch.Generator().manual_seed(10)
    scales, softmax_scale = Q_MAGNITUDES[case]
    k_cache, v_cache = ((2 * torch.randn(2, 40, 1, 64, generator=g)).to(DEVICE, torch.float8_e4m3fn) for _ in range(2))
    q = torch.randn(2, 1, 4, 64, generator=g)
    for head, scale in enumerate(scales):
        if math.isinf(scale):
            q[:, :, head, 0] = math.inf
        else:
            q[:, :, head] *= scale
    q = q.to(DEVICE, torch.bfloat16)
    descale = torch.full((2, 1), 0.75, device=DEVICE)
    seqlens = torch.tensor([40, 23], dtype=torch.int32, device=DEVICE)
    out = flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, k_descale=descale,
                                            v_descale=descale, softmax_scale=softmax_scale)
    refs = [kvcache_attention_reference(q, k_cache, v_cache, seqlens, None, None, compute_dtype=dtype,
                                        k_descale=descale, v_descale=descale, softmax_scale=softmax_scale)[0]
            for dtype in (torch.float64, torch.bfloat16)]
    heads = slice(1, None) if case in ("mixed-heads", "inf-in-one-head") else slice(None)
    assert_accurate("out", out[:, :, heads], refs[0][:, :, heads], refs[1][:, :, heads], factor=2)


def test_fp8_paged_varlen_prefill(backend):
    # vLLM's call with a float8 cache: scales per (sequence, KV head)
    g = torch.Generator().manual_seed(9)
    k_cache, v_cache, block_table = paged_cache(SEQUSED_K, 16, 2, 32, torch.float32, g)
    k_cache, v_cache = (2 * k_cache).to(torch.float8_e4m3fn), (2 * v_cache).to(torch.float8_e4m3fn)
    q = torch.randn(sum(SEQLENS_Q), 4, 32, generator=g).to(DEVICE, torch.float16)
    k_descale, v_descale = ((torch.rand(len(SEQUSED_K), 2, generator=g) + 0.5).to(DEVICE) for _ in range(2))
    cu_seqlens_q, seqused_k = cumulative(SEQLENS_Q), torch.tensor(SEQUSED_K, dtype=torch.int32, device=DEVICE)
    out, lse, _ = flashtile.flash_attn_varlen_func(
        q, k_cache, v_cache, cu_seqlens_q, None, max(SEQLENS_Q), max(SEQUSED_K), causal=True, block_table=block_table,
        seqused_k=seqused_k, k_descale=k_descale, v_descale=v_descale, return_attn_probs=True)
    refs = []
    for dtype in (torch.float64, torch.float16):
        refs.append(kvcache_attention_reference(q, k_cache, v_cache, seqused_k, None, block_table, causal=True,
                                                compute_dtype=dtype, cu_seqlens_q=cu_seqlens_q, k_descale=k_descale,
                                                v_descale=v_descale))
    _check(out, lse, refs)


def test_fp8_validation():
    q = torch.zeros(1, 1, 2, 16, device=DEVICE, dtype=torch.bfloat16)
    cache8 = torch.zeros(1, 8, 1, 16, device=DEVICE, dtype=torch.float8_e4m3fn)
    with pytest.raises(TypeError, match="a float8 KV cache needs float16 or bfloat16 queries"):
        flashtile.flash_attn_with_kvcache(q.float(), cache8, cache8)
    with pytest.raises(ValueError, match=r"k_descale must have shape \(batch, nheads_k\) = \(1, 1\)"):
        flashtile.flash_attn_with_kvcache(q, cache8, cache8, k_descale=torch.ones(2, 1, device=DEVICE))
    with pytest.raises(ValueError, match="scale a float8 KV cache"):
        flashtile.flash_attn_with_kvcache(q, cache8.bfloat16(), cache8.bfloat16(), k_descale=torch.ones(1, 1,
                                                                                                       device=DEVICE))
    with pytest.raises(TypeError, match="v_cache must be a 4-D torch.float8_e4m3fn tensor"):
        flashtile.flash_attn_with_kvcache(q, cache8, cache8.to(torch.float8_e5m2))


def test_continuous_batching_example_runs():
    # the engine-loop example, briefly: it raises if any request's attention differs from eager attention
    path = Path(__file__).parents[1] / "examples" / "continuous_batching.py"
    spec = importlib.util.spec_from_file_location("continuous_batching", path)
    example = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = example  # its dataclasses look their module up there
    spec.loader.exec_module(example)
    result = example.main(["--device", DEVICE, "--dtype", "float32", "--requests", "4", "--chunk", "8",
                           "--page-size", "4"])
    assert result["requests"] == 4 and result["free_pages"] == 64
    assert result["max_error"] <= result["tolerance"]


@pytest.mark.parametrize("num_splits", [1, 3], ids=lambda s: f"splits{s}")
def test_out_is_written_in_place(backend, num_splits):
    # an engine's preallocated output, strided (a slice of a wider buffer): written, returned, equal to the
    # result without out; tokens outside every sequence get 0 there too
    g = torch.Generator().manual_seed(10)
    k_cache, v_cache, block_table = paged_cache(SEQUSED_K, 16, 2, 32, torch.bfloat16, g)
    total = sum(SEQLENS_Q) + 2  # two trailing tokens that no sequence covers
    q = torch.randn(total, 4, 32, generator=g).to(DEVICE, torch.bfloat16)
    cu_seqlens_q, seqused_k = cumulative(SEQLENS_Q), torch.tensor(SEQUSED_K, dtype=torch.int32, device=DEVICE)
    call = dict(causal=True, block_table=block_table, seqused_k=seqused_k)
    expected = flashtile.flash_attn_varlen_func(q, k_cache, v_cache, cu_seqlens_q, None, max(SEQLENS_Q),
                                                max(SEQUSED_K), **call)
    buffer = torch.full((total, 4, 48), 7.0, device=DEVICE, dtype=torch.bfloat16)
    out = buffer[..., 8:40]
    returned = flashtile.flash_attn_varlen_func(q, k_cache, v_cache, cu_seqlens_q, None, max(SEQLENS_Q),
                                                max(SEQUSED_K), out=out, **call)
    assert returned.data_ptr() == out.data_ptr() and torch.equal(out, expected)
    assert (out[-2:] == 0).all() and (buffer[..., :8] == 7).all() and (buffer[..., 40:] == 7).all()
    # flash_attn_with_kvcache, batched, with splits
    q4 = q[:2 * 3].view(2, 3, 4, 32)
    caches = [t[:, :, :, :].clone() for t in (k_cache, v_cache)]
    lengths = torch.tensor([20, 37], dtype=torch.int32, device=DEVICE)
    expected = flashtile.flash_attn_with_kvcache(q4, *caches, cache_seqlens=lengths, block_table=block_table[:2],
                                                 num_splits=num_splits)
    out = torch.empty_like(expected)
    returned = flashtile.flash_attn_with_kvcache(q4, *caches, cache_seqlens=lengths, block_table=block_table[:2],
                                                 num_splits=num_splits, out=out)
    assert returned is out and torch.equal(out, expected)
    with pytest.raises(ValueError, match=r"out must have shape \(2, 3, 4, 32\)"):
        flashtile.flash_attn_with_kvcache(q4, *caches, cache_seqlens=lengths, block_table=block_table[:2],
                                          out=out[:1])


def test_paged_varlen_names_seqused_k_in_its_errors(monkeypatch):
    monkeypatch.setenv("FLASHTILE_CHECK_INPUTS", "1")  # a GPU's index tensors are read only when asked
    g = torch.Generator().manual_seed(11)
    k_cache, v_cache, block_table = paged_cache([10, 10], 16, 1, 16, torch.float16, g)
    q = torch.randn(4, 2, 16, generator=g).to(DEVICE, torch.float16)
    too_long = torch.tensor([10, 17], dtype=torch.int32, device=DEVICE)  # pages hold 16 slots
    with pytest.raises(ValueError, match=r"seqused_k\[1\]=17 \(\+ 0 new\) does not fit a cache of 16"):
        flashtile.flash_attn_varlen_func(q, k_cache, v_cache, cumulative([2, 2]), None, 2, 17,
                                         block_table=block_table, seqused_k=too_long)


def test_paged_varlen_checks_cu_seqlens_k_by_its_own_name(monkeypatch):
    # flash-attn 2's form (keys per sequence from cu_seqlens_k): a decreasing cu_seqlens_k or one of the wrong
    # length is refused as cu_seqlens_k, as without a block table, not silently read as 0 keys
    monkeypatch.setenv("FLASHTILE_CHECK_INPUTS", "1")
    g = torch.Generator().manual_seed(12)
    k_cache, v_cache, block_table = paged_cache([10, 10], 16, 1, 16, torch.float16, g)
    q = torch.randn(4, 2, 16, generator=g).to(DEVICE, torch.float16)
    for cu_seqlens_k, message in ((cumulative([9, 0]) - torch.tensor([0, 0, 4], dtype=torch.int32, device=DEVICE),
                                   "cu_seqlens_k must be non-decreasing"),
                                  (cumulative([5]), r"cu_seqlens_k must have cu_seqlens_q's shape \(batch \+ 1,\) = \(3,\)"),
                                  (cumulative([10, 17]), r"key count of cu_seqlens_k\[1\]=17 \(\+ 0 new\) does not fit")):
        with pytest.raises(ValueError, match=message):
            flashtile.flash_attn_varlen_func(q, k_cache, v_cache, cumulative([2, 2]), cu_seqlens_k, 2, 17,
                                             block_table=block_table)


@pytest.mark.parametrize("capability, by_ptx", [((8, 0), False), ((8, 6), False), ((8, 9), True), ((9, 0), True)],
                         ids=["sm80", "sm86", "sm89", "sm90"])
def test_float8_v_is_widened_by_ptx_only_where_the_instruction_exists(monkeypatch, capability, by_ptx):
    # cvt.rn.f16x2.e4m3x2/e5m2x2 need sm_89: on an A100 or A10 (e5m2 caches work there) ptxas refuses the
    # kernel with them, so those GPUs keep the tile's .to(); CPU tensors (the interpreter) keep it too
    properties = types.SimpleNamespace(major=capability[0], minor=capability[1])
    monkeypatch.setattr(launch, "cuda_properties", lambda device: properties)
    assert launch._converts_float8_by_ptx(torch.device("cuda", 0)) == by_ptx
    assert not launch._converts_float8_by_ptx(torch.device("cpu"))
