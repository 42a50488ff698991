"""Attention against a KV cache (decoding, speculative decoding, chunked prefill): split-KV and paged.

``flash_attn_with_kvcache`` has flash-attn 2's signature and semantics:

* new keys/values ``k``, ``v`` (``seqlen_new`` of them per sequence) are first written into
  the cache **in place** at positions ``cache_seqlens[b] ..``; then each sequence ``b``
  attends over its valid prefix of ``seqlen_k[b] = cache_seqlens[b] + seqlen_new`` keys;
* causal masking is aligned to the bottom-right corner of each sequence's own
  ``(seqlen_q, seqlen_k[b])`` rectangle: query ``i`` sees key ``j`` iff ``j ≤ i + seqlen_k[b] − seqlen_q``;
* GQA/MQA: query head ``h`` uses KV head ``h // (nheads_q // nheads_k)``;
* a row that sees no key (``seqlen_k[b] = 0``, or causal with ``seqlen_q > seqlen_k[b]``)
  gets output 0 and log-sum-exp −inf (flash-attn 2 writes +inf there; flashtile keeps
  one convention everywhere);
* the log-sum-exp is (batch, nheads, seqlen_q), float32, natural log.

Algorithm (flash-decoding, ``flashtile.triton.decode``): the query rows that share a KV head
are packed into one block, so the cache is streamed once per KV head; the visible key range is
cut into ``num_splits`` runs whose partial results are merged through their log-sum-exps.
``num_splits=0`` chooses the count so that batch · nheads_k · splits programs fill the GPU
(``flashtile.triton.launch.num_splits_heuristic``). On the CPU path each sequence runs through
the reference (``flashtile.reference.kvcache``) in float32.

Paged cache: ``k_cache`` is (num_blocks, page_size, nheads_k, headdim) and key ``j`` of
sequence ``b`` lives at ``k_cache[block_table[b, j // page_size], j % page_size]``; any page
size works (flash-attn 2 needs multiples of 256).

Index values: ``cache_seqlens[b] + seqlen_new`` must fit the cache, ``cache_batch_idx`` must
name cache rows and the pages of ``block_table`` that a sequence uses must exist. That is checked
with a ValueError wherever reading the values is free (CPU tensors, Python ints) and, for GPU
tensors, with ``FLASHTILE_CHECK_INPUTS=1`` (one sync each). Unchecked values never make a kernel
touch memory outside its tensors: an append outside the cache is dropped, a length is clamped into
the cache, a cache row outside it gives an empty sequence (output 0, log-sum-exp −inf), a page
outside it holds no key. Limits: the append is its own small kernel before the attention kernel
(not fused into it). No backward.
"""

from __future__ import annotations

import math

import torch

from . import _validate, ops, reference
from ._options import cache_capacity

__all__ = ["flash_attn_with_kvcache"]


def flash_attn_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    cache_seqlens: int | torch.Tensor | None = None,
    cache_batch_idx: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    num_splits: int = 0,
    return_softmax_lse: bool = False,
    learnable_sink: torch.Tensor | None = None,
    cu_seqlens_q: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    *,
    rotary_cos: torch.Tensor | None = None,
    rotary_sin: torch.Tensor | None = None,
    rotary_interleaved: bool = True,
    cache_leftpad: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
):
    """Attention of q against a KV cache, appending new keys/values first; flash-attn 2's semantics.

    Arguments:
        q: (batch, seqlen_q, nheads, headdim), float16 / bfloat16 / float32; seqlen_q = 1 for
            decoding, more for speculative decoding or chunked prefill. headdim ≤ 576.
        k_cache, v_cache: (batch_cache, seqlen_cache, nheads_k, headdim) and (…, headdim_v), or
            with block_table paged caches (num_blocks, page_size, nheads_k, headdim or headdim_v),
            any page size. headdim_v ≤ 512 may differ from headdim: MLA, whose absorbed decoding
            has headdim 576 and a v_cache that is the first 512 channels of the latent cache
            (``v_cache = k_cache[..., :512]``, a view: no copy). Updated in place when k, v are given.
        k, v: optional new keys/values (batch, seqlen_new, nheads_k, headdim or headdim_v),
            written into the cache at positions cache_seqlens[b] .. cache_seqlens[b] + seqlen_new − 1
            (v after k, so a v_cache viewing k_cache ends up holding v).
        cache_seqlens: int or (batch,) int32: the number of valid cached keys per sequence before
            the append. None means the whole cache is valid (then k, v must be None).
        cache_batch_idx: optional (batch,) int32: the cache row of each sequence (non-paged only).
        block_table: optional (batch, max_blocks) int32: the pages of each sequence, in order.
        softmax_scale: defaults to 1 / sqrt(headdim) (q's).
        causal: causal mask aligned to the bottom-right of each sequence's own rectangle: with
            seqlen_q = 2 and 4 valid keys (after the append), query 0 sees keys 0..2, query 1
            keys 0..3.
        window_size: (left, right) sliding window: query i sees key j iff
            i + Nk − Nq − left ≤ j ≤ i + Nk − Nq + right, with Nk the sequence's valid length;
            −1 is unbounded; combined with causal (which sets right = 0). Keys outside the
            window are skipped, not loaded.
        softcap: if > 0, scores become softcap · tanh(scores / softcap) (Gemma 2).
        alibi_slopes: (nheads,) or (batch, nheads) float32: adds −slope · |i + Nk − Nq − j|.
        num_splits: split the key range over this many programs, merged by log-sum-exp;
            0 chooses a count that fills the GPU; 1 disables splitting.
        return_softmax_lse: also return the log-sum-exp.
        learnable_sink: optional (nheads,) float32: one logit per query head that joins every
            row's softmax denominator and adds no value (gpt-oss's attention sinks; FA4's name),
            not scaled by softmax_scale; counted once whatever num_splits is.
        cu_seqlens_q, max_seqlen_q: optional (batch + 1,) int32 and int (FA3's names): q is packed
            (total_q, nheads, headdim), sequence b's queries at rows [cu_seqlens_q[b],
            cu_seqlens_q[b + 1]), as are the new k, v (total_q, nheads_k, headdim): chunked
            prefill and speculative decoding of a mixed batch in one call. Causal aligns each
            sequence's queries to the end of its keys (its new ones included).
        rotary_cos, rotary_sin: keyword only, optional (seqlen_ro, rotary_dim / 2), seqlen_ro at least
            the cache's length (as flash-attn 2 requires), flash-attn 2's
            rotary embedding of the first rotary_dim channels: the new k at positions
            cache_seqlens[b] + i, and q at the same positions when causal or windowed, else all
            at cache_seqlens[b]. Fused: the kernels rotate the tiles as they load them, and no
            rotated copy is written (q and the appended k; head dims up to 256, as flash-attn 2).
        rotary_interleaved: keyword only: rotate pairs (2j, 2j + 1) (GPT-J; flash-attn's default)
            rather than (j, j + rotary_dim / 2) (GPT-NeoX).
        cache_leftpad: keyword only, optional (batch,) int32: sequence b's keys are cache slots
            [cache_leftpad[b], cache_seqlens[b] + seqlen_new), 0 ≤ cache_leftpad[b] ≤ cache_seqlens[b]
            (cache_seqlens stays the absolute end; rotary positions stay slot indices). Not with
            block_table (as in flash-attn).
        k_descale, v_descale: keyword only, optional (batch, nheads_k) float32, for a float8 cache
            (float8_e4m3fn or float8_e5m2; q in float16/bfloat16): the keys and values are the stored
            values times these scales (default 1); appended k, v are stored divided by them, clamped
            to the format's range and rounded to nearest. Accumulation stays float32.
        out: keyword only, optional: a tensor of the output's shape and q's dtype (any strides) that
            the kernel writes the result into (an engine's preallocated buffer); returned.

    Returns:
        out (batch, seqlen_q, nheads, headdim_v) in q's dtype, and with return_softmax_lse the
        log-sum-exp (batch, nheads, seqlen_q), float32, natural log, the sink included (−inf for a
        row that sees no key, or the sink's logit with one; the output is 0 there). With
        cu_seqlens_q: out (total_q, nheads, headdim_v) and lse (nheads, total_q); tokens outside
        every sequence get 0 and −inf.
    """
    batch = _validate.check_kvcache_inputs(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table,
                                           cu_seqlens_q, max_seqlen_q)
    packed = cu_seqlens_q is not None
    if packed:  # the packed rule (reference.packed_rows), read by the rotary positions, append and attention
        cu_seqlens_q = reference.nondecreasing(cu_seqlens_q)
    nheads_q, head_dim = q.shape[-2:]
    capacity = cache_capacity(k_cache, block_table)
    options = _validate.kvcache_options(head_dim, softmax_scale, causal, window_size, softcap, capacity)
    _validate.check_rotary(rotary_cos, rotary_sin, head_dim, q.device, capacity, appends=k is not None)
    cache_leftpad = _validate.check_cache_leftpad(cache_leftpad, batch, block_table, q.device, cache_seqlens,
                                                  capacity)
    k_descale, v_descale = _validate.check_descale(k_descale, v_descale, k_cache, batch, q.device)
    out = _validate.check_out(out, ops.out_shape(q, v_cache), q.dtype, q.device)
    alibi_slopes = _validate.check_alibi(alibi_slopes, batch, nheads_q, q.device)
    learnable_sink = _validate.check_learnable_sink(learnable_sink, nheads_q, q.device)
    num_splits = _validate.check_num_splits(num_splits)

    if cache_seqlens is None:
        cache_seqlens = torch.full((batch,), capacity, dtype=torch.int32, device=q.device)
    elif isinstance(cache_seqlens, int):
        cache_seqlens = torch.full((batch,), cache_seqlens, dtype=torch.int32, device=q.device)
    seqlens_k = cache_seqlens
    if k is not None:
        ops.kvcache_append(k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table,
                           cu_seqlens_q if packed else None, max_seqlen_q or 0, k_descale, v_descale,
                           rotary_cos, rotary_sin, rotary_interleaved)
        seqlens_k = cache_seqlens + (_packed_lengths(cu_seqlens_q, k.shape[0]) if packed else k.shape[1])

    if q.numel() == 0 or batch == 0:
        out = q.new_zeros(ops.out_shape(q, v_cache)) if out is None else out.zero_()
        lse_shape = (nheads_q, q.shape[0]) if packed else (batch, nheads_q, q.shape[1])
        lse = torch.full(lse_shape, -math.inf, dtype=torch.float32, device=q.device)
    else:
        out, lse = ops.kvcache_attention(q, k_cache, v_cache, seqlens_k, cache_batch_idx, block_table, options,
                                         alibi_slopes, num_splits, learnable_sink, cu_seqlens_q if packed else None,
                                         max_seqlen_q or 0, cache_leftpad, k_descale, v_descale, out,
                                         rotary_cos, rotary_sin, cache_seqlens, rotary_interleaved)
    return (out, lse) if return_softmax_lse else out


def _packed_lengths(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Each sequence's row count in a packed axis of ``total`` rows, its bounds clamped into the axis as the
    kernels clamp them (on the device: no sync)."""
    start = cu_seqlens[:-1].clamp(0, total)
    return (torch.maximum(cu_seqlens[1:].clamp(max=total), start) - start).to(torch.int32)
