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

Algorithm (flash-decoding). One program per (block of query rows, batch · KV head, split).
The query rows of a program are the ``seqlen_q × group_size`` (position, query head) pairs
that share one KV head, packed into the M dimension of the dots (flash-attn's
"seqlenq_ngroups_swapped"): K/V are read from memory once per KV head, not once per query
head, which is what decoding — a pass that only streams the cache — is limited by. The
visible key range of a program (causal/window aware, per sequence) is cut into
``num_splits`` runs of whole key blocks; each split runs the online softmax of the main
forward kernel (``flashtile.kernels``; base 2 with ``log2 e`` folded into the scale) over its
run and writes a normalised partial output and its log-sum-exp, which
``flashtile.merge`` combines. With one split the kernel writes the final result directly.
``num_splits=0`` chooses the count so that batch · nheads_k · splits programs fill the GPU
(:func:`num_splits_heuristic`).

Variants, with the main kernels' helpers from ``flashtile.scores`` and each sequence's own
length as Nk: softcap ``c · tanh(s / c)``, ALiBi ``−slope · |i + Nk − Nq − j|``, and the
sliding window ``i + Nk − Nq − left ≤ j ≤ i + Nk − Nq + right`` (causal sets right = 0);
key blocks outside the window are skipped, not loaded.

Paged cache: ``k_cache`` is (num_blocks, page_size, nheads_k, headdim) and key ``j`` of
sequence ``b`` lives at ``k_cache[block_table[b, j // page_size], j % page_size]``; the
kernel gathers rows through the block table, so any page size works (flash-attn 2 needs
multiples of 256).

Limits: the append is done by PyTorch indexing before the kernel (a few small launches; not
fused into the attention kernel). The caller guarantees capacity: ``cache_seqlens[b] +
seqlen_new`` must not exceed the cache length (or the pages of ``block_table``), which is not
checked for tensor ``cache_seqlens`` because that would need a device-to-host sync. No backward.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from . import reference
from ._host import cdiv, cuda_properties, launch_device, next_power_of_2
from .interface import _FLOAT_DTYPES, MAX_HEAD_DIM
from .kernels import LOG2E, _block_d, _dot_precision  # importing kernels also patches the interpreter's bf16 dot
from .merge import merge_states_into
from .ops import uses_triton
from .scores import _key_range, _scores_log2, _visible

__all__ = ["flash_attn_with_kvcache", "kvcache_attention_forward", "kvcache_attention_reference",
           "append_to_kvcache", "num_splits_heuristic", "split_plan"]


@triton.jit
def _kvcache_attn_fwd_kernel(
    Q, K, V, Out, Lse, SeqlensK, CacheBatchIdx, BlockTable, AlibiSlopes,
    stride_qb, stride_qs, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_op, stride_ob, stride_os, stride_oh, stride_od,
    stride_lp, stride_lb, stride_lh, stride_ls,
    stride_tb, stride_tn, stride_ab, stride_ah,
    nheads_k, group_size, seqlen_q, num_splits, page_size,
    qk_scale, softcap_scale, softcap_log2, window_left, window_right,
    IS_PAGED: tl.constexpr, HAS_BATCH_IDX: tl.constexpr,
    MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    i_m = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_split = tl.program_id(2)
    i_b = i_bh // nheads_k
    i_hk = i_bh % nheads_k

    # row r of the block is query position r // group_size, query head i_hk·group_size + r % group_size
    o_r = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    o_q = o_r // group_size
    o_hq = i_hk * group_size + o_r % group_size
    o_n = tl.arange(0, BLOCK_N)
    o_d = tl.arange(0, BLOCK_D)
    m_r = o_r < seqlen_q * group_size
    m_d = o_d < HEAD_DIM

    p_q = Q + i_b.to(tl.int64) * stride_qb + o_q[:, None] * stride_qs + o_hq[:, None] * stride_qh + o_d[None, :] * stride_qd
    b_q = tl.load(p_q, mask=m_r[:, None] & m_d[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
    alibi_slope_log2 = 0.0
    if HAS_ALIBI:
        b_slope = tl.load(AlibiSlopes + i_b * stride_ab + o_hq * stride_ah, mask=m_r, other=0.0)  # [BLOCK_M]
        alibi_slope_log2 = b_slope[:, None] * 1.4426950408889634  # * log2(e), for base-2 scores

    if IS_PAGED:
        k_base = K + i_hk * stride_kh
        v_base = V + i_hk * stride_vh
        table_base = BlockTable + i_b.to(tl.int64) * stride_tb
    else:
        if HAS_BATCH_IDX:
            i_cache = tl.load(CacheBatchIdx + i_b).to(tl.int64)
        else:
            i_cache = i_b.to(tl.int64)
        k_base = K + i_cache * stride_kb + i_hk * stride_kh
        v_base = V + i_cache * stride_vb + i_hk * stride_vh

    # -- the keys this block of rows can see, [lo, hi), cut into num_splits runs of whole blocks
    seqlen_k = tl.load(SeqlensK + i_b)
    diagonal = seqlen_k - seqlen_q  # bottom-right alignment, per sequence
    first_q = (i_m * BLOCK_M) // group_size
    last_q = tl.minimum((i_m * BLOCK_M + BLOCK_M - 1) // group_size, seqlen_q - 1)
    lo, hi = _key_range(first_q, last_q + 1, diagonal, seqlen_k, window_left, window_right,
                        MASK_LEFT, MASK_RIGHT, BLOCK_N)
    blocks_per_split = tl.cdiv(tl.cdiv(tl.maximum(hi - lo, 0), BLOCK_N), num_splits)
    split_lo = lo + i_split * blocks_per_split * BLOCK_N
    split_hi = tl.minimum(hi, split_lo + blocks_per_split * BLOCK_N)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for start_n in range(split_lo, split_hi, BLOCK_N):
        cols = start_n + o_n
        m_n = cols < split_hi
        if IS_PAGED:
            # key j lives in page block_table[b, j // page_size], row j % page_size
            b_page = tl.load(table_base + (cols // page_size) * stride_tn, mask=m_n, other=0).to(tl.int64)
            k_rows = b_page * stride_kb + (cols % page_size) * stride_ks  # [BLOCK_N]
            v_rows = b_page * stride_vb + (cols % page_size) * stride_vs
        else:
            k_rows = cols * stride_ks
            v_rows = cols * stride_vs
        b_k = tl.load(k_base + k_rows[:, None] + o_d[None, :] * stride_kd,
                      mask=m_n[:, None] & m_d[None, :], other=0.0)  # [BLOCK_N, BLOCK_D]
        b_v = tl.load(v_base + v_rows[:, None] + o_d[None, :] * stride_vd,
                      mask=m_n[:, None] & m_d[None, :], other=0.0)  # [BLOCK_N, BLOCK_D]
        qk = tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N]
        s = _scores_log2(qk, o_q[:, None], cols[None, :], diagonal, qk_scale, softcap_scale, softcap_log2,
                         alibi_slope_log2, HAS_SOFTCAP, HAS_ALIBI)
        visible = m_n[None, :] & _visible(o_q[:, None], cols[None, :], diagonal, window_left, window_right,
                                          MASK_LEFT, MASK_RIGHT)
        s = tl.where(visible, s, float("-inf"))
        # -- update m_i and l_i (a row with no visible key yet keeps m = -inf)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_safe[:, None])  # [BLOCK_M, BLOCK_N]
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        # -- rescale the unnormalised output and add this block
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(b_v.dtype), b_v, acc, input_precision=DOT_PRECISION)
        m_i = m_new

    # a split that saw no key writes output 0 and lse -inf: the merge gives it weight 0
    seen = l_i > 0.0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, (m_i + tl.math.log2(l_i)) * 0.6931471805599453, float("-inf"))  # * ln 2
    out_base = Out + i_split * stride_op + i_b.to(tl.int64) * stride_ob
    p_o = out_base + o_q[:, None] * stride_os + o_hq[:, None] * stride_oh + o_d[None, :] * stride_od
    tl.store(p_o, out.to(Out.dtype.element_ty), mask=m_r[:, None] & m_d[None, :])
    lse_base = Lse + i_split * stride_lp + i_b.to(tl.int64) * stride_lb
    tl.store(lse_base + o_hq * stride_lh + o_q * stride_ls, lse, mask=m_r)


# ----------------------------------------------------------------------------------------------
# Launcher


@functools.lru_cache(maxsize=4096)  # a decoding loop asks the same question every step; the scan costs µs
def num_splits_heuristic(num_programs: int, num_sms: int, num_key_blocks: int, max_splits: int = 128) -> int:
    """Split count for ``num_programs`` (batch · nheads_k · query blocks) programs, flash-attn 2's rule.

    Memory-bound decoding needs every SM streaming: with fewer programs than about two
    per SM, the key range is split. Among the split counts that change the number of
    blocks per split, take the smallest whose wave efficiency (programs / (waves · slots))
    is within 85% of the best one. Splits never exceed the number of key blocks.
    """
    slots = 2 * num_sms  # two resident programs per SM
    if num_programs >= 0.8 * slots:
        return 1
    max_splits = max(1, min(max_splits, slots, num_key_blocks))

    def eligible(s: int) -> bool:  # a split count that leaves the blocks per split unchanged is pointless
        return s == 1 or math.ceil(num_key_blocks / s) != math.ceil(num_key_blocks / (s - 1))

    def efficiency(s: int) -> float:
        waves = num_programs * s / slots
        return waves / math.ceil(waves)

    best = max(efficiency(s) for s in range(1, max_splits + 1) if eligible(s))
    return next(s for s in range(1, max_splits + 1) if eligible(s) and efficiency(s) >= 0.85 * best)


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return cuda_properties(device).multi_processor_count
    return 1  # the interpreter runs one program at a time


def _decode_config(block_d: int, dtype: torch.dtype, query_rows: int) -> dict:
    """Block shapes: the M block holds the packed (query position, head) rows, at least 16 for tl.dot."""
    wide = dtype == torch.float32
    block_m = min(64, max(16, next_power_of_2(query_rows)))
    if block_d <= 128:
        return dict(BLOCK_M=block_m, BLOCK_N=64 if not wide else 32, num_warps=4, num_stages=3)
    return dict(BLOCK_M=min(block_m, 32), BLOCK_N=32 if not wide else 16, num_warps=4, num_stages=2)


def split_plan(batch, seqlen_q, group_size, nheads_k, block_d, dtype, max_seqlen_k, device, num_splits=0,
               config=None):
    """→ (block config, query-row blocks, split count) of a call; num_splits 0 = heuristic.

    The heuristic sees the cache's capacity (max_seqlen_k), not the valid lengths, which
    live on the device: reading them would cost a host sync per decoding step.
    """
    cfg = dict(_decode_config(block_d, dtype, seqlen_q * group_size), **(config or {}))
    num_m_blocks = cdiv(seqlen_q * group_size, cfg["BLOCK_M"])
    num_key_blocks = max(1, cdiv(max_seqlen_k, cfg["BLOCK_N"]))
    if num_splits == 0:
        num_splits = num_splits_heuristic(batch * nheads_k * num_m_blocks, _num_sms(device), num_key_blocks)
    return cfg, num_m_blocks, min(num_splits, num_key_blocks)


def kvcache_attention_forward(q, k_cache, v_cache, seqlens_k, cache_batch_idx, block_table, softmax_scale: float,
                              causal: bool, window_size=(-1, -1), softcap: float = 0.0, alibi_slopes=None,
                              num_splits: int = 0, config: dict | None = None):
    """Triton launcher. q [B, Sq, Hq, D]; caches [B_cache, S_cache, Hk, D] or paged
    [num_blocks, page_size, Hk, D] with block_table [B, max_blocks] int32; seqlens_k [B] int32
    (valid keys per sequence, after any append); alibi_slopes [Hq] or [B, Hq] float32;
    num_splits 0 = heuristic. ``config`` overrides the block shapes (benchmark tuning).
    → (out [B, Sq, Hq, D] in q's dtype, lse [B, Hq, Sq] float32)."""
    batch, seqlen_q, nheads_q, head_dim = q.shape
    nheads_k = k_cache.shape[2]
    group_size = nheads_q // nheads_k
    paged = block_table is not None
    max_seqlen_k = block_table.shape[1] * k_cache.shape[1] if paged else k_cache.shape[1]
    window_left, window_right = window_size
    if causal:
        window_right = 0
    block_d = _block_d(head_dim)
    cfg, num_m_blocks, num_splits = split_plan(batch, seqlen_q, group_size, nheads_k, block_d, q.dtype,
                                               max_seqlen_k, q.device, num_splits, config)

    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((batch, nheads_q, seqlen_q), dtype=torch.float32, device=q.device)
    if num_splits == 1:
        # one split: the kernel's partial result is the final one, written in q's dtype
        out_part, lse_part = out.unsqueeze(0), lse.unsqueeze(0)
    else:
        out_part = torch.empty((num_splits, *q.shape), dtype=torch.float32, device=q.device)
        lse_part = torch.empty((num_splits, batch, nheads_q, seqlen_q), dtype=torch.float32, device=q.device)
    # tensors a configuration does not use are passed as (unread) stand-ins
    table = block_table if paged else seqlens_k[:, None]
    slopes = seqlens_k[:, None] if alibi_slopes is None else alibi_slopes.expand(batch, nheads_q)
    grid = (num_m_blocks, batch * nheads_k, num_splits)
    _kvcache_attn_fwd_kernel[grid](
        q, k_cache, v_cache, out_part, lse_part, seqlens_k,
        cache_batch_idx if cache_batch_idx is not None else seqlens_k, table, slopes,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *out_part.stride(), *lse_part.stride(),
        *table.stride(), *slopes.stride(),
        nheads_k, group_size, seqlen_q, num_splits, k_cache.shape[1],
        softmax_scale * LOG2E, softmax_scale / softcap if softcap > 0 else 0.0, softcap * LOG2E,
        window_left, window_right,
        IS_PAGED=paged, HAS_BATCH_IDX=cache_batch_idx is not None,
        MASK_LEFT=window_left >= 0, MASK_RIGHT=window_right >= 0,
        HAS_SOFTCAP=softcap > 0, HAS_ALIBI=alibi_slopes is not None,
        HEAD_DIM=head_dim, BLOCK_D=block_d, DOT_PRECISION=_dot_precision(q.dtype), **cfg,
    )
    if num_splits > 1:
        merge_states_into(out_part, lse_part, out, lse)
    return out, lse


# ----------------------------------------------------------------------------------------------
# Cache update and reference (also the CPU path)


def _cache_rows(k_cache, batch, cache_batch_idx):
    """Index of each sequence's row in a non-paged cache, [B] int64."""
    if cache_batch_idx is None:
        return torch.arange(batch, device=k_cache.device)
    return cache_batch_idx.long()


def append_to_kvcache(k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx=None, block_table=None) -> None:
    """Write k, v [B, Sn, Hk, D] into the caches in place at positions cache_seqlens[b] + 0..Sn-1."""
    batch, seqlen_new = k.shape[:2]
    positions = cache_seqlens.long()[:, None] + torch.arange(seqlen_new, device=k.device)  # [B, Sn]
    if block_table is None:
        rows = _cache_rows(k_cache, batch, cache_batch_idx)[:, None]  # [B, 1]
        k_cache[rows, positions] = k
        v_cache[rows, positions] = v
    else:
        page_size = k_cache.shape[1]
        pages = torch.gather(block_table.long(), 1, positions // page_size)  # [B, Sn]
        k_cache[pages, positions % page_size] = k
        v_cache[pages, positions % page_size] = v


def _sequence_kv(k_cache, v_cache, b: int, seqlen: int, cache_batch_idx, block_table):
    """The first ``seqlen`` keys and values of sequence b, [seqlen, Hk, D] each."""
    if block_table is None:
        row = b if cache_batch_idx is None else int(cache_batch_idx[b])
        return k_cache[row, :seqlen], v_cache[row, :seqlen]
    pages = block_table[b, : cdiv(seqlen, k_cache.shape[1])].long()
    return k_cache[pages].flatten(0, 1)[:seqlen], v_cache[pages].flatten(0, 1)[:seqlen]


def kvcache_attention_reference(q, k_cache, v_cache, seqlens_k, cache_batch_idx=None, block_table=None,
                                softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                alibi_slopes=None, compute_dtype=None):
    """Standard attention of each sequence over its gathered valid prefix (the specification).

    Same arguments as :func:`kvcache_attention_forward`. One sequence at a time, so every
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
        out, lse, _ = reference.attention_forward(
            *(t.to(compute_dtype).unsqueeze(0).transpose(1, 2) for t in (q[b], k_b, v_b)),  # [1, H, N, D]
            softmax_scale, causal, window_size, softcap, slopes,
        )
        outs.append(out[0].transpose(0, 1))  # [Nq, Hq, D]
        lses.append(lse[0])
    return torch.stack(outs), torch.stack(lses)


# ----------------------------------------------------------------------------------------------
# Public function



def _check_int32(name, t, shape):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {t.dtype}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")


MAX_GRID_Y = 65535  # CUDA's limit on a grid's second and third axes


def _check_kvcache_inputs(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table):
    tensors = [("q", q), ("k_cache", k_cache), ("v_cache", v_cache)]
    if (k is None) != (v is None):
        raise ValueError("k and v must be given together (or both None)")
    if k is not None:
        tensors += [("k", k), ("v", v)]
    for name, t in tensors:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D, got shape {tuple(t.shape)}")
        if t.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"{name} must be float16, bfloat16 or float32, got {t.dtype}")
        if t.dtype != q.dtype:
            raise TypeError(f"{name} must have q's dtype {q.dtype}, got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name} must be on q's device {q.device}, got {t.device}")
    shapes = f"q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}"
    batch, seqlen_q, nheads_q, head_dim = q.shape
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache must have the same shape, got {shapes}")
    nheads_k = k_cache.shape[2]
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"head dims differ: {shapes}")
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head dim must be in 1..{MAX_HEAD_DIM}, got {head_dim} ({shapes})")
    if nheads_k == 0 or nheads_q % nheads_k != 0:
        raise ValueError(f"nheads of q ({nheads_q}) must be a multiple of nheads of the cache ({nheads_k}): {shapes}")
    if batch * nheads_k > MAX_GRID_Y:
        raise ValueError(f"batch · nheads of the cache ({batch} · {nheads_k}) must be ≤ {MAX_GRID_Y}, the kernel "
                         f"grid's second axis: split the batch into several calls ({shapes})")
    if k is not None:
        expected = (batch, k.shape[1], nheads_k, head_dim)
        for name, t in (("k", k), ("v", v)):
            if tuple(t.shape) != expected:
                raise ValueError(f"{name} must be (batch, seqlen_new, nheads_k, headdim) = {expected}, "
                                 f"got {tuple(t.shape)} ({shapes})")
        if cache_seqlens is None:
            raise ValueError("cache_seqlens is required when k and v are appended to the cache")
    if isinstance(cache_seqlens, torch.Tensor):
        _check_int32("cache_seqlens", cache_seqlens, (batch,))
    elif cache_seqlens is not None and not isinstance(cache_seqlens, int):
        raise TypeError(f"cache_seqlens must be an int or an int32 tensor, got {type(cache_seqlens).__name__}")
    if block_table is not None:
        if cache_batch_idx is not None:
            raise NotImplementedError("cache_batch_idx cannot be combined with block_table (as in flash-attn)")
        if not isinstance(block_table, torch.Tensor) or block_table.dim() != 2:
            raise ValueError(f"block_table must be a 2-D (batch, max_blocks) int32 tensor, got "
                             f"{tuple(block_table.shape) if isinstance(block_table, torch.Tensor) else block_table!r}")
        _check_int32("block_table", block_table, (batch, block_table.shape[1]))
        capacity = block_table.shape[1] * k_cache.shape[1]
    else:
        if cache_batch_idx is not None:
            _check_int32("cache_batch_idx", cache_batch_idx, (batch,))
        elif k_cache.shape[0] != batch:
            raise ValueError(f"batch sizes differ: {shapes}; pass cache_batch_idx to use other cache rows")
        capacity = k_cache.shape[1]
    for name, t in (("cache_seqlens", cache_seqlens), ("cache_batch_idx", cache_batch_idx),
                    ("block_table", block_table)):
        if isinstance(t, torch.Tensor) and t.device != q.device:
            raise ValueError(f"{name} must be on q's device {q.device}, got {t.device}")
    if isinstance(cache_seqlens, int):
        needed = cache_seqlens + (k.shape[1] if k is not None else 0)
        if not 0 <= cache_seqlens or needed > capacity:
            raise ValueError(f"cache_seqlens={cache_seqlens} (+ {needed - cache_seqlens} new) does not fit "
                             f"a cache of {capacity} positions")


def _check_variants(q, window_size, softcap, alibi_slopes):
    """Validate window/softcap/ALiBi arguments; → window_size as a tuple of two ints."""
    if not (isinstance(window_size, (tuple, list)) and len(window_size) == 2
            and all(isinstance(w, int) for w in window_size)):
        raise TypeError(f"window_size must be a (left, right) pair of ints, got {window_size!r}")
    if not isinstance(softcap, (int, float)) or softcap < 0:
        raise ValueError(f"softcap must be a number ≥ 0, got {softcap!r}")
    if alibi_slopes is not None:
        batch, nheads = q.shape[0], q.shape[2]
        if not isinstance(alibi_slopes, torch.Tensor):
            raise TypeError(f"alibi_slopes must be a torch.Tensor, got {type(alibi_slopes).__name__}")
        if alibi_slopes.dtype != torch.float32:
            raise TypeError(f"alibi_slopes must be float32, got {alibi_slopes.dtype}")
        if tuple(alibi_slopes.shape) not in ((nheads,), (batch, nheads)):
            raise ValueError(f"alibi_slopes must be ({nheads},) or ({batch}, {nheads}), got {tuple(alibi_slopes.shape)}")
        if alibi_slopes.device != q.device:
            raise ValueError(f"alibi_slopes must be on q's device {q.device}, got {alibi_slopes.device}")
    return tuple(window_size)


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
):
    """Attention of q against a KV cache, appending new keys/values first; flash-attn 2's semantics.

    Arguments:
        q: (batch, seqlen_q, nheads, headdim), float16 / bfloat16 / float32; seqlen_q = 1 for
            decoding, more for speculative decoding or chunked prefill.
        k_cache, v_cache: (batch_cache, seqlen_cache, nheads_k, headdim), or with block_table a
            paged cache (num_blocks, page_size, nheads_k, headdim), any page size. Updated in place
            when k, v are given.
        k, v: optional new keys/values (batch, seqlen_new, nheads_k, headdim), written into the
            cache at positions cache_seqlens[b] .. cache_seqlens[b] + seqlen_new − 1.
        cache_seqlens: int or (batch,) int32: the number of valid cached keys per sequence before
            the append. None means the whole cache is valid (then k, v must be None).
        cache_batch_idx: optional (batch,) int32: the cache row of each sequence (non-paged only).
        block_table: optional (batch, max_blocks) int32: the pages of each sequence, in order.
        softmax_scale: defaults to 1 / sqrt(headdim).
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

    Returns:
        out (batch, seqlen_q, nheads, headdim) in q's dtype, and with return_softmax_lse the
        log-sum-exp (batch, nheads, seqlen_q), float32, natural log (−inf for a row that sees
        no key, whose output is 0).
    """
    _check_kvcache_inputs(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table)
    window_size = _check_variants(q, window_size, softcap, alibi_slopes)
    if not isinstance(num_splits, int) or num_splits < 0:
        raise ValueError(f"num_splits must be an int ≥ 0, got {num_splits!r}")
    batch, seqlen_q, _, head_dim = q.shape
    scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)

    if cache_seqlens is None:
        full = block_table.shape[1] * k_cache.shape[1] if block_table is not None else k_cache.shape[1]
        cache_seqlens = torch.full((batch,), full, dtype=torch.int32, device=q.device)
    elif isinstance(cache_seqlens, int):
        cache_seqlens = torch.full((batch,), cache_seqlens, dtype=torch.int32, device=q.device)
    seqlens_k = cache_seqlens
    if k is not None:
        append_to_kvcache(k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table)
        seqlens_k = cache_seqlens + k.shape[1]

    if batch * seqlen_q == 0:
        out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
        lse = torch.full((batch, q.shape[2], seqlen_q), -math.inf, dtype=torch.float32, device=q.device)
    elif uses_triton(q):
        with launch_device(q):
            out, lse = kvcache_attention_forward(q, k_cache, v_cache, seqlens_k, cache_batch_idx, block_table,
                                                 scale, bool(causal), window_size, softcap, alibi_slopes, num_splits)
    else:
        out, lse = kvcache_attention_reference(q, k_cache, v_cache, seqlens_k, cache_batch_idx, block_table,
                                               scale, bool(causal), window_size, softcap, alibi_slopes,
                                               compute_dtype=torch.float32)
        out, lse = out.to(q.dtype), lse.float()
    return (out, lse) if return_softmax_lse else out
