"""Attention against a KV cache: standard attention of each sequence over its valid prefix.

The specification of ``flash_attn_with_kvcache`` (and its CPU path): each sequence's keys
and values are gathered from the cache (non-paged, or paged through a block table) and
attended to by :func:`reference.attention.attention_forward`, so every mask and bias is
relative to that sequence's own length.
"""

from __future__ import annotations

import torch

from .attention import attention_forward

__all__ = ["kvcache_attention_reference"]


def _sequence_kv(k_cache, v_cache, b: int, seqlen: int, cache_batch_idx, block_table):
    """The first ``seqlen`` keys and values of sequence b, [seqlen, Hk, D] each."""
    if block_table is None:
        row = b if cache_batch_idx is None else int(cache_batch_idx[b])
        return k_cache[row, :seqlen], v_cache[row, :seqlen]
    pages = block_table[b, : -(-seqlen // k_cache.shape[1])].long()  # the ⌈seqlen / page_size⌉ pages
    return k_cache[pages].flatten(0, 1)[:seqlen], v_cache[pages].flatten(0, 1)[:seqlen]


def kvcache_attention_reference(q, k_cache, v_cache, seqlens_k, cache_batch_idx=None, block_table=None,
                                softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                alibi_slopes=None, compute_dtype=None):
    """Standard attention of each sequence over its gathered valid prefix (the specification).

    q [B, Sq, Hq, D]; caches [B_cache, S_cache, Hk, D] (rows chosen by cache_batch_idx [B]) or
    paged [num_blocks, page_size, Hk, D] with block_table [B, max_blocks]; seqlens_k [B] the
    valid keys of each sequence; alibi_slopes (Hq,) or (B, Hq). One sequence at a time, so every
    mask and bias is relative to that sequence's own length ``Nk = seqlens_k[b]``:
    scores ``s = q·k · scale``, softcapped ``c · tanh(s / c)``, minus ALiBi
    ``slope · |i + Nk − Nq − j|``; key j visible to query i iff
    ``i + Nk − Nq − left ≤ j ≤ i + Nk − Nq + right`` (causal: right = 0; −1 unbounded).
    Computes in ``compute_dtype`` (default q's dtype); returns (out [B, Sq, Hq, D],
    lse [B, Hq, Sq]) in ``compute_dtype``.
    """
    compute_dtype = compute_dtype or q.dtype
    batch, _, nheads_q, _ = q.shape
    outs, lses = [], []
    for b in range(batch):
        k_b, v_b = _sequence_kv(k_cache, v_cache, b, int(seqlens_k[b]), cache_batch_idx, block_table)  # [Nk, Hk, D]
        slopes = None if alibi_slopes is None else alibi_slopes.expand(batch, nheads_q)[b]
        out, lse, _ = attention_forward(
            *(t.to(compute_dtype).unsqueeze(0).transpose(1, 2) for t in (q[b], k_b, v_b)),  # [1, H, N, D]
            softmax_scale, causal, window_size, softcap, slopes,
        )
        outs.append(out[0].transpose(0, 1))  # [Nq, Hq, D]
        lses.append(lse[0])
    return torch.stack(outs), torch.stack(lses)
