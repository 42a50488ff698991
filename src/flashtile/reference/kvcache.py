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

from .._options import cache_capacity
from .attention import attention_forward
from .varlen import packed_rows

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
                                alibi_slopes=None, compute_dtype=None, learnable_sink=None, cu_seqlens_q=None,
                                cache_leftpad=None, k_descale=None, v_descale=None):
    """Standard attention of each sequence over its gathered valid prefix (the specification).

    q [B, Sq, Hq, D]; caches [B_cache, S_cache, Hk, D or Dv] (rows chosen by cache_batch_idx [B]) or
    paged [num_blocks, page_size, Hk, D or Dv] with block_table [B, max_blocks]; seqlens_k [B] the
    valid keys of each sequence; alibi_slopes (Hq,) or (B, Hq). One sequence at a time, so every
    mask and bias is relative to that sequence's own length ``Nk = seqlens_k[b]``:
    scores ``s = q·k · scale``, softcapped ``c · tanh(s / c)``, minus ALiBi
    ``slope · |i + Nk − Nq − j|``; key j visible to query i iff
    ``i + Nk − Nq − left ≤ j ≤ i + Nk − Nq + right`` (causal: right = 0; −1 unbounded);
    learnable_sink (Hq,) joins every row's denominator once; cache_leftpad [B]: sequence b's keys start
    at that slot (the slots before it are not keys; masks and ALiBi stay in slot indices, aligned to
    the end as always); k_descale, v_descale [B, Hk]: a float8 cache's values are the stored ones times
    these scales. Computes in ``compute_dtype`` (default
    q's dtype); returns (out [B, Sq, Hq, Dv], lse [B, Hq, Sq]) in ``compute_dtype``.

    With ``cu_seqlens_q`` (int32 [B + 1]) q is packed (total_q, Hq, D), sequence b's queries at rows
    [cu_seqlens_q[b], cu_seqlens_q[b + 1]) by the packed rule (``varlen.packed_rows``), and the result is
    (out (total_q, Hq, Dv), lse (Hq, total_q)), 0 and −inf for tokens outside every sequence.
    """
    compute_dtype = compute_dtype or q.dtype
    if cu_seqlens_q is not None:
        return _packed_queries(q, k_cache, v_cache, seqlens_k, cache_batch_idx, block_table, cu_seqlens_q,
                               compute_dtype, dict(softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                                                   softcap=softcap, learnable_sink=learnable_sink), alibi_slopes,
                               cache_leftpad, k_descale, v_descale)
    batch, _, nheads_q, _ = q.shape
    capacity = cache_capacity(k_cache, block_table)
    outs, lses = [], []
    for b in range(batch):
        seqlen = min(max(int(seqlens_k[b]), 0), capacity)  # as the kernel clamps it
        k_b, v_b, exists = _sequence_kv(k_cache, v_cache, b, seqlen, cache_batch_idx, block_table)  # [Nk, Hk, D]
        if cache_leftpad is not None:
            exists[:min(max(int(cache_leftpad[b]), 0), seqlen)] = False  # as the kernel clamps it
        if k_descale is not None:  # a float8 cache, dequantised: [Nk, Hk, D] · [Hk, 1]
            k_b = k_b.to(compute_dtype) * k_descale[b].to(compute_dtype)[:, None]
            v_b = v_b.to(compute_dtype) * v_descale[b].to(compute_dtype)[:, None]
        # a key that does not exist holds nothing, whatever its memory holds (NaN would pass a −inf score)
        k_b, v_b = (torch.where(exists[:, None, None], t.to(compute_dtype), 0) for t in (k_b, v_b))
        slopes = None if alibi_slopes is None else alibi_slopes.expand(batch, nheads_q)[b]
        out, lse, _ = attention_forward(
            *(t.to(compute_dtype).unsqueeze(0).transpose(1, 2) for t in (q[b], k_b, v_b)),  # [1, H, N, D]
            softmax_scale, causal, window_size, softcap, slopes, attn_bias=None if exists.all() else exists,
            learnable_sink=learnable_sink,
        )
        outs.append(out[0].transpose(0, 1))  # [Nq, Hq, D]
        lses.append(lse[0])
    return torch.stack(outs), torch.stack(lses)


def _one(t, b: int, default):
    """Row b of a per-sequence index tensor as a [1] tensor; ``default`` where there is none."""
    return default if t is None else t[b:b + 1]


def _packed_queries(q, k_cache, v_cache, seqlens_k, cache_batch_idx, block_table, cu_seqlens_q, compute_dtype,
                    options, alibi_slopes, cache_leftpad, k_descale, v_descale):
    total_q, nheads_q, _ = q.shape
    batch = len(seqlens_k)
    out = torch.zeros((total_q, nheads_q, v_cache.shape[-1]), dtype=compute_dtype, device=q.device)
    lse = torch.full((nheads_q, total_q), float("-inf"), dtype=compute_dtype, device=q.device)
    for b, rows in enumerate(packed_rows(cu_seqlens_q, total_q)):
        # the non-paged cache's row b, named as such for a call of one sequence
        row_b = torch.tensor([b], dtype=torch.int32, device=q.device) if block_table is None else None
        slopes = None if alibi_slopes is None else alibi_slopes.expand(batch, nheads_q)[b]
        out_b, lse_b = kvcache_attention_reference(
            q[rows][None], k_cache, v_cache, seqlens_k[b:b + 1], _one(cache_batch_idx, b, row_b),
            _one(block_table, b, None), alibi_slopes=slopes, compute_dtype=compute_dtype,
            cache_leftpad=_one(cache_leftpad, b, None), k_descale=_one(k_descale, b, None),
            v_descale=_one(v_descale, b, None), **options)
        out[rows], lse[:, rows] = out_b[0], lse_b[0]
    return out, lse


def kvcache_append_reference(k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx=None, block_table=None,
                             cu_seqlens_new=None, k_descale=None, v_descale=None) -> None:
    """Write k, v [B, Sn, Hk, D] into the caches in place at positions cache_seqlens[b] + 0..Sn-1; with
    ``cu_seqlens_new`` k, v are packed (total_new, Hk, D), sequence b's rows as in
    :func:`kvcache_attention_reference`'s packed queries. A float8 cache stores x / descale[b, h], clamped
    to the format's largest finite value and rounded to nearest.

    A write lands only where it is inside the cache, as the kernel's (``triton.decode``): position in
    [0, capacity), cache row or page id in [0, k_cache.shape[0]); any other is dropped. (Boolean
    indexing reads the mask on the host: this is the CPU path.)"""
    if cu_seqlens_new is not None:
        for b, rows in enumerate(packed_rows(cu_seqlens_new, k.shape[0])):
            row_b = torch.tensor([b], dtype=torch.int32, device=k.device) if block_table is None else None
            kvcache_append_reference(k_cache, v_cache, k[rows][None], v[rows][None], cache_seqlens[b:b + 1],
                                     _one(cache_batch_idx, b, row_b), _one(block_table, b, None), None,
                                     _one(k_descale, b, None), _one(v_descale, b, None))
        return
    if k_descale is not None:  # [B, Sn, Hk, D] / [B, 1, Hk, 1]
        limit = torch.finfo(k_cache.dtype).max
        k = (k.float() / k_descale[:, None, :, None]).clamp(-limit, limit).to(k_cache.dtype)
        v = (v.float() / v_descale[:, None, :, None]).clamp(-limit, limit).to(v_cache.dtype)
    batch, seqlen_new = k.shape[:2]
    cache_rows, page_size = k_cache.shape[:2]
    capacity = cache_capacity(k_cache, block_table)
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
