"""Attention against a KV cache: standard attention of each sequence over its valid prefix.

The specification of ``flash_attn_with_kvcache`` (and its CPU path): each sequence's keys
and values are gathered from the cache (non-paged, or paged through a block table) and
attended to by :func:`reference.attention.attention_forward`, so every mask and bias is
relative to that sequence's own length. Index values outside the cache follow the kernels' rule
(``flashtile.triton.decode``): lengths are clamped into the cache, a cache row outside it gives an
empty sequence, a page id outside it holds no key, and an append outside it is dropped.
"""

from __future__ import annotations

import torch

from .attention import attention_forward

__all__ = ["kvcache_append_reference", "kvcache_attention_reference"]


def _sequence_kv(k_cache, v_cache, b: int, seqlen: int, cache_batch_idx, block_table):
    """The first ``seqlen`` keys and values of sequence b, [seqlen, Hk, D] each, and which of them
    exist, [seqlen] bool: a page id outside the cache holds no key (as in the kernel, which never
    dereferences it). The caller has clamped ``seqlen`` into the cache."""
    cache_rows, page_size = k_cache.shape[:2]
    if block_table is None:
        row = b if cache_batch_idx is None else int(cache_batch_idx[b])
        exists = torch.full((seqlen,), 0 <= row < cache_rows, device=k_cache.device)
        row = min(max(row, 0), cache_rows - 1)
        return k_cache[row, :seqlen], v_cache[row, :seqlen], exists
    pages = block_table[b, : -(-seqlen // page_size)].long()  # the ⌈seqlen / page_size⌉ pages
    exists = ((pages >= 0) & (pages < cache_rows)).repeat_interleave(page_size)[:seqlen]
    pages = pages.clamp(0, cache_rows - 1)
    return k_cache[pages].flatten(0, 1)[:seqlen], v_cache[pages].flatten(0, 1)[:seqlen], exists


def kvcache_attention_reference(q, k_cache, v_cache, seqlens_k, cache_batch_idx=None, block_table=None,
                                softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                alibi_slopes=None, compute_dtype=None, learnable_sink=None):
    """Standard attention of each sequence over its gathered valid prefix (the specification).

    q [B, Sq, Hq, D]; caches [B_cache, S_cache, Hk, D or Dv] (rows chosen by cache_batch_idx [B]) or
    paged [num_blocks, page_size, Hk, D or Dv] with block_table [B, max_blocks]; seqlens_k [B] the
    valid keys of each sequence; alibi_slopes (Hq,) or (B, Hq). One sequence at a time, so every
    mask and bias is relative to that sequence's own length ``Nk = seqlens_k[b]``:
    scores ``s = q·k · scale``, softcapped ``c · tanh(s / c)``, minus ALiBi
    ``slope · |i + Nk − Nq − j|``; key j visible to query i iff
    ``i + Nk − Nq − left ≤ j ≤ i + Nk − Nq + right`` (causal: right = 0; −1 unbounded);
    learnable_sink (Hq,) joins every row's denominator once. Computes in ``compute_dtype`` (default
    q's dtype); returns (out [B, Sq, Hq, Dv], lse [B, Hq, Sq]) in ``compute_dtype``.
    """
    compute_dtype = compute_dtype or q.dtype
    batch, _, nheads_q, _ = q.shape
    capacity = block_table.shape[1] * k_cache.shape[1] if block_table is not None else k_cache.shape[1]
    outs, lses = [], []
    for b in range(batch):
        seqlen = min(max(int(seqlens_k[b]), 0), capacity)  # as the kernel clamps it
        k_b, v_b, exists = _sequence_kv(k_cache, v_cache, b, seqlen, cache_batch_idx, block_table)  # [Nk, Hk, D]
        slopes = None if alibi_slopes is None else alibi_slopes.expand(batch, nheads_q)[b]
        out, lse, _ = attention_forward(
            *(t.to(compute_dtype).unsqueeze(0).transpose(1, 2) for t in (q[b], k_b, v_b)),  # [1, H, N, D]
            softmax_scale, causal, window_size, softcap, slopes, attn_bias=None if exists.all() else exists,
            learnable_sink=learnable_sink,
        )
        outs.append(out[0].transpose(0, 1))  # [Nq, Hq, D]
        lses.append(lse[0])
    return torch.stack(outs), torch.stack(lses)


def kvcache_append_reference(k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx=None, block_table=None) -> None:
    """Write k, v [B, Sn, Hk, D] into the caches in place at positions cache_seqlens[b] + 0..Sn-1.

    A write lands only where it is inside the cache, as the kernel's (``triton.decode``): position in
    [0, capacity), cache row or page id in [0, k_cache.shape[0]); any other is dropped. (Boolean
    indexing reads the mask on the host: this is the CPU path.)"""
    batch, seqlen_new = k.shape[:2]
    cache_rows, page_size = k_cache.shape[:2]
    capacity = block_table.shape[1] * page_size if block_table is not None else page_size
    positions = cache_seqlens.long()[:, None] + torch.arange(seqlen_new, device=k.device)  # [B, Sn]
    valid = (positions >= 0) & (positions < capacity)
    positions = positions.where(valid, 0)
    if block_table is None:
        rows = torch.arange(batch, device=k.device) if cache_batch_idx is None else cache_batch_idx.long()
        rows = rows[:, None].expand(batch, seqlen_new)  # [B, Sn]
        slots = positions
    else:
        rows = torch.gather(block_table.long(), 1, positions // page_size)  # [B, Sn]: the pages
        slots = positions % page_size
    valid &= (rows >= 0) & (rows < cache_rows)
    k_cache[rows[valid], slots[valid]] = k[valid]
    v_cache[rows[valid], slots[valid]] = v[valid]
