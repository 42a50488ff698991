"""FlashAttention forward and backward kernels in Triton (``flashtile.triton.launch`` launches them).

Algorithm (FlashAttention-2 ordering, mirrored by ``flashtile.reference``):

* forward, one program per (Q block, head, batch): walk the K/V blocks the Q
  block can see with an online softmax in base 2 (``log2 e`` is folded into the
  scale so the inner loop uses ``exp2``), rescale the running sum and the
  unnormalised output by ``exp2(m_old − m_new)``, divide by ``ℓ`` once, and
  write O and the log-sum-exp ``L = (m + log2 ℓ) · ln 2`` — **natural log**, float32;
* backward preprocess: ``D_i = rowsum(dO_i ∘ O_i)`` in float32, by a matmul as dP is formed;
* backward dK/dV, one program per (K block, KV head, batch): loop over the query
  heads of its GQA group and over the Q blocks that see it, recompute
  ``Pᵀ = exp2(S·log2 e − L·log2 e)``; ``dV += Pᵀ dO``,
  ``dK += scale · dSᵀ Q`` with ``dS = P ∘ (dP − D)``; it also writes dS itself
  as the gradient of an additive bias;
* backward dQ, one program per (Q block, head, batch): ``dQ += scale · dS K``.

Variants are constexpr switches, so the plain path compiles without them (the
score pipeline and block ranges are in ``flashtile.triton.scores``): sliding window and
causal (``MASK_LEFT``/``MASK_RIGHT``; blocks outside the window are skipped),
softcap, ALiBi, an additive bias, dropout on P (Philox; the backward regenerates
the mask), and variable-length batches (``IS_VARLEN``: sequences packed along
one token axis, located through ``cu_seqlens``; the grid covers the longest), and in the forward
paged K/V (``IS_PAGED``: a paged prefill; each key block's rows found through the block table).

No atomics anywhere: every output element is written by exactly one program,
so the backward is bitwise deterministic run to run.

Loads: the forward moves its Q, K, V and O tiles with Hopper's tensor copy engine (TMA, through
4-D tensor descriptors over [batch, seqlen, nheads, head_dim]: rows past a sequence's end and
padded head dims arrive as zeros, stores are clipped) when the batch is not packed, the strides
allow it and seqlen ≥ ``configs.TMA_MIN_SEQLEN``; otherwise, and in the backward, masked pointer loads
(descriptors measured slower there on the H200: benchmarks/NOTES.md, v0.4).

Conventions: tensors in (batch, seqlen, nheads, headdim), or (total, nheads,
headdim) when packed, with arbitrary strides; query head ``h`` uses KV head
``h // (nheads_q // nheads_k)``; causal masking is aligned to the bottom-right
corner (query ``i`` sees key ``j`` iff ``j ≤ i + seqlen_k − seqlen_q``), per
sequence; a row that sees no key gets output 0 and log-sum-exp −inf. The
log-sum-exp is (batch, nheads, seqlen_q), or (nheads, total_q) when packed.
Head dims 1..256 are padded inside to a power of two ≥ 16 (masked loads; the
user never pads), except in the backward's dK/dV and dQ kernels where two power-of-two chunks
pad less (``BLOCK_D2``/``BLOCK_DV2`` > 0: 192 = 128 + 64, 96 = 64 + 32; ``configs.bwd_head_dim_chunks``):
each product over the head dim is then two matmuls, without the padding's quarter of zero columns.
V (and O, dO, dV) may have a head dim of its own (``HEAD_DIM_V``; MLA: 192 for Q/K, 128 for V).
float32 inputs use IEEE float32 dots. Grids are (blocks, heads, batch): batch and heads may each
reach CUDA's 65535 on those axes.

Offsets are 32-bit unless a tensor of the call spans more than 2³¹ − 1 elements: then ``WIDE``
widens every stride but the head dim's to 64 bits at the kernel's start (``scores.widen``), and with
them every offset; the common path compiles as before.

Each kernel walks its visible blocks in three runs (``scores.key_runs``/``query_runs``):
the masked near edge, the whole blocks that need no mask, and the masked far edge; the
inner loops take ``APPLY_MASK`` as a constexpr so the middle run compiles without masks.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .scores import (dropout_keep, initial_softmax_state, key_runs, masked_scores_log2, normalise, query_runs,
                     run_bounds, tanh, widen)


@triton.jit
def _sequence_bounds(i_b, CuSeqlens, seqlen, IS_VARLEN: tl.constexpr):
    """(first token, length) of sequence ``i_b``: packed through cu_seqlens, or the whole axis.

    Packed, ``seqlen`` is the token count of the axis, and the bounds are clamped into it (an end
    below its start gives length 0): no value of cu_seqlens can move a load or store outside the
    tensors. Tokens that no sequence covers are never written (the launcher zero-fills them)."""
    if IS_VARLEN:
        start = tl.minimum(tl.maximum(tl.load(CuSeqlens + i_b), 0), seqlen)
        end = tl.minimum(tl.maximum(tl.load(CuSeqlens + i_b + 1), start), seqlen)
        return start, end - start
    return 0, seqlen


@triton.jit
def _program(CuSeqlensQ, CuSeqlensK, seqlen_q, seqlen_k, IS_VARLEN: tl.constexpr):
    """The prologue of the forward, dK/dV and dQ kernels. The grid is (blocks, heads, batch): →
    (block, head, batch, first query, seqlen_q, first key, seqlen_k) of this program, with the
    sequence's own lengths when the batch is packed (``seqlen_q``/``seqlen_k`` given are then the
    token counts; the grid covers max_seqlen)."""
    i_block = tl.program_id(0)
    i_head = tl.program_id(1)
    i_b = tl.program_id(2)
    q_start, seqlen_q = _sequence_bounds(i_b, CuSeqlensQ, seqlen_q, IS_VARLEN)
    k_start, seqlen_k = _sequence_bounds(i_b, CuSeqlensK, seqlen_k, IS_VARLEN)
    return i_block, i_head, i_b, q_start, seqlen_q, k_start, seqlen_k


@triton.jit
def _load_rows(ptrs, m_rows, m_d, APPLY_MASK: tl.constexpr, EVEN_D: tl.constexpr):
    """A [rows, BLOCK_D] tile: masked by row bounds in masked blocks, by head dim only where padded."""
    if APPLY_MASK:
        return tl.load(ptrs, mask=m_rows[:, None] & m_d[None, :], other=0.0)
    if EVEN_D:
        return tl.load(ptrs)
    return tl.load(ptrs, mask=m_d[None, :], other=0.0)


@triton.jit
def _load_tail(base, rows, m_rows, stride_s, stride_d, APPLY_MASK: tl.constexpr, HEAD_DIM: tl.constexpr,
               BLOCK_D: tl.constexpr, BLOCK_D2: tl.constexpr):
    """Head dims [BLOCK_D, BLOCK_D + BLOCK_D2) of ``rows``, [rows, BLOCK_D2]: the second chunk of a head dim
    held in two (``configs.bwd_head_dim_chunks``); None when ``BLOCK_D2`` is 0 (one chunk)."""
    tail = None
    if BLOCK_D2 > 0:
        o_d2 = BLOCK_D + tl.arange(0, BLOCK_D2)
        tail = _load_rows(base + rows[:, None] * stride_s + o_d2[None, :] * stride_d, m_rows, o_d2 < HEAD_DIM,
                          APPLY_MASK, BLOCK_D + BLOCK_D2 == HEAD_DIM)
    return tail


@triton.jit
def _dot_over_head_dim(a, b, a2, b2, BLOCK_D2: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """a · bᵀ summed over a head dim held in one chunk (``a``, ``b``) or two (and ``a2``, ``b2``)."""
    acc = tl.dot(a, tl.trans(b), input_precision=DOT_PRECISION)
    if BLOCK_D2 > 0:
        acc = tl.dot(a2, tl.trans(b2), acc, input_precision=DOT_PRECISION)
    return acc


@triton.jit
def _store_tail(base, rows, m_rows, stride_s, stride_d, tile, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                BLOCK_D2: tl.constexpr):
    """Stores the second chunk written by :func:`_load_tail`'s rule (nothing when ``BLOCK_D2`` is 0)."""
    if BLOCK_D2 > 0:
        o_d2 = BLOCK_D + tl.arange(0, BLOCK_D2)
        tl.store(base + rows[:, None] * stride_s + o_d2[None, :] * stride_d, tile.to(base.dtype.element_ty),
                 mask=m_rows[:, None] & (o_d2 < HEAD_DIM)[None, :])


@triton.jit
def _alibi_slope_log2(AlibiSlopes, i_b, i_h, stride_ab, HAS_ALIBI: tl.constexpr):
    """Head ``i_h``'s ALiBi slope in log2 units (0 without ALiBi); slopes are (nheads,) or (batch, nheads)."""
    slope = 0.0
    if HAS_ALIBI:
        slope = tl.load(AlibiSlopes + i_b * stride_ab + i_h) * 1.4426950408889634
    return slope


@triton.jit
def _dropout_setup(Seed, dropout_p, HAS_DROPOUT: tl.constexpr):
    """(Philox seed, 1 / (1 − p)) of this launch; (0, 1) without dropout."""
    seed = 0
    scale = 1.0
    if HAS_DROPOUT:
        seed = tl.load(Seed)
        scale = 1.0 / (1.0 - dropout_p)
    return seed, scale


@triton.jit
def _load_block(src, i_b, i_h, start, rows, m_rows, o_d, m_d, stride_s, stride_d,
                APPLY_MASK: tl.constexpr, EVEN_D: tl.constexpr, USE_TMA: tl.constexpr,
                ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """Rows ``rows = start + [0, ROWS)`` of one head, [ROWS, BLOCK_D]. ``src`` is a tensor
    descriptor over [batch, seqlen, nheads, head_dim] (the copy engine fills rows past the end and
    padded head dims with zeros), or the head's base pointer for pointer loads (:func:`_load_rows`)."""
    # if/else, not an early return: the compiler would still build the pointer branch for a descriptor
    if USE_TMA:
        block = src.load([i_b, start, i_h, 0]).reshape(ROWS, BLOCK_D)
    else:
        block = _load_rows(src + rows[:, None] * stride_s + o_d[None, :] * stride_d, m_rows, m_d, APPLY_MASK, EVEN_D)
    return block


@triton.jit
def _paged_rows(table_row, start_n, cols, m_n, seqlen_k, stride_tn, page_size, num_pages,
                PAGE_SPLIT: tl.constexpr, BLOCK_N: tl.constexpr):
    """Where keys ``cols = start_n + [0, BLOCK_N)`` live in a paged cache: (page id, slot in the page,
    visibility), each [BLOCK_N], and whether every page the block reads is inside the cache (a scalar;
    with ``PAGE_SPLIT`` = 0 always true); a key is visible where ``m_n`` holds and its page id is inside
    the cache (the KV-cache kernel's rule), and its page id is 0 otherwise, so it is never dereferenced.

    ``PAGE_SPLIT`` > 1 (``configs.page_split``; 1 is :func:`_load_from_page`): the block spans that many
    whole pages of ``BLOCK_N // PAGE_SPLIT`` keys, whose ids are that many scalar loads and whose
    slots come from constexpr shifts. Triton's pipeliner turns a vector load of the table into an
    asynchronous copy, and the K/V copies that depend on it then wait for every copy in flight each
    iteration (0.34× the contiguous forward on an H100); scalar loads go to registers a stage ahead
    and leave the K/V pipeline as deep as the contiguous one's. ``PAGE_SPLIT`` = 0 (pages smaller than
    a quarter of the block, or sizes that neither divide it nor are multiples of it): one vector load
    of the table and a runtime division per key."""
    pages_in_cache = True
    if PAGE_SPLIT == 0:
        b_page = tl.load(table_row + (cols // page_size) * stride_tn, mask=m_n, other=0)
        slots = cols % page_size
    else:
        PAGE: tl.constexpr = BLOCK_N // PAGE_SPLIT  # the page size; start_n is a multiple of it
        first = start_n // PAGE
        b_page = tl.zeros([BLOCK_N], dtype=tl.int32)
        for j in tl.static_range(PAGE_SPLIT):
            # the table holds ceil(seqlen_k / PAGE) pages at least: a page that starts past the keys is not read
            page = tl.load(table_row + (first + j) * stride_tn, mask=start_n + j * PAGE < seqlen_k, other=0)
            b_page = tl.where((cols - start_n) // PAGE == j, page, b_page)
            pages_in_cache = pages_in_cache & (page >= 0) & (page < num_pages)
        slots = (cols - start_n) % PAGE
    visible = m_n & (b_page >= 0) & (b_page < num_pages)
    return tl.where(visible, b_page, 0), slots, visible, pages_in_cache


@triton.jit
def _table_in_cache(table_row, seqlen_k, stride_tn, page_size, num_pages):
    """Whether every page id that a sequence's keys [0, ``seqlen_k``) use (its row of the block table) lies
    inside the cache: the kernel's whole blocks then need not hide keys of pages outside it, key by key."""
    CHUNK: tl.constexpr = 256  # table entries a load: one for most sequences (256 pages)
    n_pages = tl.cdiv(seqlen_k, page_size)
    outside = tl.zeros([CHUNK], dtype=tl.int32)
    for start in range(0, n_pages, CHUNK):
        ids = start + tl.arange(0, CHUNK)
        page = tl.load(table_row + ids * stride_tn, mask=ids < n_pages, other=0)
        outside |= ((page < 0) | (page >= num_pages)).to(tl.int32)
    return tl.max(outside, 0) == 0


@triton.jit
def _load_from_page(k_src, v_src, table_row, start_n, o_n, m_n, o_d, m_d, o_dv, m_dv, stride_tn, page_size,
                    num_pages, stride_kb, stride_ks, stride_kd, stride_vb, stride_vs, stride_vd,
                    APPLY_MASK: tl.constexpr):
    """K [BLOCK_N, BLOCK_D], V [BLOCK_N, BLOCK_DV], the keys' visibility [BLOCK_N] and whether the page is
    inside the cache (a scalar) for keys ``start_n + o_n`` that lie in one page (``PAGE_SPLIT`` = 1):
    consecutive rows at one offset, so the loads are the contiguous kernel's (offsets fixed across blocks
    plus one base per block; the per-key row arithmetic of :func:`_paged_rows` cost the page-64 prefill
    about 1.6× the contiguous forward's instructions on an H100). A page id outside the cache reads page 0
    under a mask (zeros) and hides the block's keys; only masked blocks (``APPLY_MASK``) mask by key bounds."""
    # start_n < seqlen_k ≤ the table's capacity: the table entry exists
    page = tl.load(table_row + (start_n // page_size) * stride_tn)
    valid = (page >= 0) & (page < num_pages)
    page = tl.where(valid, page, 0)
    slot = start_n % page_size
    p_k = k_src + page * stride_kb + slot * stride_ks + o_n[:, None] * stride_ks + o_d[None, :] * stride_kd
    p_v = v_src + page * stride_vb + slot * stride_vs + o_n[:, None] * stride_vs + o_dv[None, :] * stride_vd
    if APPLY_MASK:
        m_n = m_n & valid
        b_k = tl.load(p_k, mask=m_n[:, None] & m_d[None, :], other=0.0)
        b_v = tl.load(p_v, mask=m_n[:, None] & m_dv[None, :], other=0.0)
    else:  # every key of the block is in bounds
        b_k = tl.load(p_k, mask=valid & m_d[None, :], other=0.0)
        b_v = tl.load(p_v, mask=valid & m_dv[None, :], other=0.0)
        m_n = m_n & valid
    return b_k, b_v, m_n, valid


@triton.jit
def _load_paged(base, b_page, slots, m_n, o_d, m_d, stride_p, stride_s, stride_d):
    """Keys of one head from a paged cache, [BLOCK_N, BLOCK_D]: key i at slot ``slots[i]`` of page
    ``b_page[i]`` (:func:`_paged_rows`); ``stride_p`` is 64-bit when the cache spans 2³¹ elements."""
    rows = b_page * stride_p + slots * stride_s  # [BLOCK_N]
    return tl.load(base + rows[:, None] + o_d[None, :] * stride_d, mask=m_n[:, None] & m_d[None, :], other=0.0)


@triton.jit
def _attn_fwd_inner(
    acc, l_i, m_i, b_q, k_src, v_src, bias_base, seed, lo, hi,
    o_m, o_n, o_d, o_dv, m_m, m_d, m_dv, i_b, i_hk, i_bh, diagonal, seqlen_k,
    stride_kb, stride_ks, stride_kd, stride_vb, stride_vs, stride_vd, stride_bm, stride_bn,
    table_row, stride_tn, page_size, num_pages,
    qk_scale, softcap_scale, softcap_log2, alibi_slope_log2, window_left, window_right,
    dropout_p, dropout_scale,
    APPLY_MASK: tl.constexpr, MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_DROPOUT: tl.constexpr, EVEN_D: tl.constexpr,
    EVEN_DV: tl.constexpr, USE_TMA: tl.constexpr, IS_PAGED: tl.constexpr, PAGE_SPLIT: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Online softmax over K/V blocks [lo, hi). ``APPLY_MASK`` is off for the blocks that
    every row sees whole (in bounds, inside the window): they need no bounds or mask work.
    ``IS_PAGED``: K and V are paged caches read through the sequence's row of the block table
    (``table_row``, :func:`_paged_rows`); a page id outside the cache hides its keys: the masked blocks
    test for it key by key, and so do whole blocks of pages smaller than a quarter of a block
    (``PAGE_SPLIT`` = 0); with larger pages the kernel leaves no whole blocks to a sequence whose table
    holds such a page (:func:`_table_in_cache`), and theirs test nothing per key."""
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + o_n
        m_n = cols < seqlen_k
        if IS_PAGED and PAGE_SPLIT == 1:
            b_k, b_v, m_n, pages_in_cache = _load_from_page(
                k_src, v_src, table_row, start_n, o_n, m_n, o_d, m_d, o_dv, m_dv, stride_tn, page_size, num_pages,
                stride_kb, stride_ks, stride_kd, stride_vb, stride_vs, stride_vd, APPLY_MASK)
        elif IS_PAGED:
            b_page, slots, m_n, pages_in_cache = _paged_rows(
                table_row, start_n, cols, m_n, seqlen_k, stride_tn, page_size, num_pages, PAGE_SPLIT, BLOCK_N)
            b_k = _load_paged(k_src, b_page, slots, m_n, o_d, m_d, stride_kb, stride_ks, stride_kd)
            b_v = _load_paged(v_src, b_page, slots, m_n, o_dv, m_dv, stride_vb, stride_vs, stride_vd)
        else:
            b_k = _load_block(k_src, i_b, i_hk, start_n, cols, m_n, o_d, m_d, stride_ks, stride_kd,
                              APPLY_MASK, EVEN_D, USE_TMA, BLOCK_N, BLOCK_D)  # [BLOCK_N, BLOCK_D]
            b_v = _load_block(v_src, i_b, i_hk, start_n, cols, m_n, o_dv, m_dv, stride_vs, stride_vd,
                              APPLY_MASK, EVEN_DV, USE_TMA, BLOCK_N, BLOCK_DV)  # [BLOCK_N, BLOCK_DV]
        qk = tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N]
        s = masked_scores_log2(
            qk, o_m[:, None], cols[None, :], m_m[:, None], m_n[None, :], diagonal,
            bias_base + o_m[:, None] * stride_bm + cols[None, :] * stride_bn,
            qk_scale, softcap_scale, softcap_log2, alibi_slope_log2, window_left, window_right,
            APPLY_MASK, MASK_LEFT, MASK_RIGHT, HAS_SOFTCAP, HAS_ALIBI, HAS_BIAS,
        )
        if IS_PAGED and PAGE_SPLIT == 0 and not APPLY_MASK:  # a whole block can hold keys of pages outside the cache
            s = tl.where(m_n[None, :], s, float("-inf"))
        # -- update m_i and l_i; a row with no visible key yet keeps m = -inf,
        #    so exponentiate against 0 instead to avoid (-inf) - (-inf)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        if IS_PAGED and PAGE_SPLIT > 0 and not APPLY_MASK:
            # pages_in_cache always holds here (the kernel checked the table), and the select costs one per row:
            # it is there for Triton's pipeliner, which turned the block's page-id loads into asynchronous copies
            # when they fed only the K/V addresses, and the loop then waited for every copy in flight (0.34× the
            # contiguous kernel, NOTES.md); a use reached first (through the sum's first operand) on the way from
            # the P·V product keeps them synchronous loads, as the per-key select that this replaced did
            p_shift = tl.where(pages_in_cache, m_safe, float("inf"))
            p = tl.math.exp2(-p_shift[:, None] + s)  # [BLOCK_M, BLOCK_N]
        else:
            p = tl.math.exp2(s - m_safe[:, None])  # [BLOCK_M, BLOCK_N]
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)  # the normaliser counts dropped entries too
        if HAS_DROPOUT:
            keep = dropout_keep(seed, o_m[:, None], cols[None, :], i_bh, dropout_p)
            p = tl.where(keep, p * dropout_scale, 0.0)
        # -- rescale the unnormalised output and add this block
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(b_v.dtype), b_v, acc, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def attn_fwd_kernel(
    Q, K, V, Out, Lse, Bias, AlibiSlopes, Seed, CuSeqlensQ, CuSeqlensK, Sinks, BlockTable, SequsedK,
    stride_qb, stride_qs, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_ob, stride_os, stride_oh, stride_od,
    stride_lb, stride_lh,
    stride_bb, stride_bh, stride_bm, stride_bn,
    stride_ab, stride_tb, stride_tn,
    nheads_q, group_size, seqlen_q, seqlen_k, page_size, num_pages,
    qk_scale, softcap_scale, softcap_log2, window_left, window_right, dropout_p,
    MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_DROPOUT: tl.constexpr, IS_VARLEN: tl.constexpr,
    IS_PAGED: tl.constexpr, PAGE_SPLIT: tl.constexpr,
    HAS_SINK: tl.constexpr, USE_TMA: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, WIDE: tl.constexpr,
):
    """``USE_TMA``: Q, K, V and Out are tensor descriptors (not packed), else pointers.
    ``HAS_SINK``: ``Sinks`` (nheads_q,) float32 logits join each row's denominator (no value).
    ``HEAD_DIM_V``: the head dim of V and Out (MLA's differs from Q's and K's ``HEAD_DIM``).
    ``IS_PAGED`` (with ``IS_VARLEN``: packed queries): K and V are paged caches [num_pages, page_size,
    nheads_k, head_dim] and sequence b's keys are the first ``SequsedK[b]`` slots of the pages in row b
    of ``BlockTable``, clamped to ``seqlen_k`` (the table's capacity); ``CuSeqlensK`` is then unread in
    effect (its bounds are replaced); ``PAGE_SPLIT``: how a key block's page ids are loaded (:func:`_paged_rows`)."""
    # a tensor of the call spans more than 2³¹ elements: 64-bit strides make every offset formed with them
    # 64-bit (head-dim strides stay 32-bit; the launcher bounds what they span)
    stride_qb, stride_qs, stride_qh = widen(stride_qb, WIDE), widen(stride_qs, WIDE), widen(stride_qh, WIDE)
    stride_kb, stride_ks, stride_kh = widen(stride_kb, WIDE), widen(stride_ks, WIDE), widen(stride_kh, WIDE)
    stride_vb, stride_vs, stride_vh = widen(stride_vb, WIDE), widen(stride_vs, WIDE), widen(stride_vh, WIDE)
    stride_ob, stride_os, stride_oh = widen(stride_ob, WIDE), widen(stride_os, WIDE), widen(stride_oh, WIDE)
    stride_lb, stride_lh = widen(stride_lb, WIDE), widen(stride_lh, WIDE)
    stride_bb, stride_bh, stride_bm = widen(stride_bb, WIDE), widen(stride_bh, WIDE), widen(stride_bm, WIDE)
    capacity = seqlen_k
    i_m, i_hq, i_b, q_start, seqlen_q, k_start, seqlen_k = _program(CuSeqlensQ, CuSeqlensK, seqlen_q, seqlen_k,
                                                                    IS_VARLEN)
    if IS_PAGED:  # a sequence's keys, clamped into the table's pages: no value reaches outside the cache
        k_start = 0
        seqlen_k = tl.minimum(tl.maximum(tl.load(SequsedK + i_b), 0), capacity)
    i_bh = i_b * nheads_q + i_hq
    i_hk = i_hq // group_size
    if i_m * BLOCK_M >= seqlen_q:
        return  # a packed sequence shorter than the longest

    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    o_n = tl.arange(0, BLOCK_N)
    o_d = tl.arange(0, BLOCK_D)
    o_dv = tl.arange(0, BLOCK_DV)
    m_m = o_m < seqlen_q
    m_d = o_d < HEAD_DIM
    m_dv = o_dv < HEAD_DIM_V

    table_row = BlockTable
    if IS_PAGED:
        table_row = BlockTable + i_b.to(tl.int64) * stride_tb
    if USE_TMA:
        k_src = K
        v_src = V
        b_q = Q.load([i_b, i_m * BLOCK_M, i_hq, 0]).reshape(BLOCK_M, BLOCK_D)
    else:
        if IS_PAGED:  # each block's rows are found through the table: only the head is fixed here
            k_src = K + i_hk * stride_kh
            v_src = V + i_hk * stride_vh
        else:
            k_src = K + i_b * stride_kb + k_start * stride_ks + i_hk * stride_kh
            v_src = V + i_b * stride_vb + k_start * stride_vs + i_hk * stride_vh
        p_q = (Q + i_b * stride_qb + q_start * stride_qs + i_hq * stride_qh
               + o_m[:, None] * stride_qs + o_d[None, :] * stride_qd)
        b_q = tl.load(p_q, mask=m_m[:, None] & m_d[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
    bias_base = Bias + i_b * stride_bb + i_hq * stride_bh
    alibi_slope_log2 = _alibi_slope_log2(AlibiSlopes, i_b, i_hq, stride_ab, HAS_ALIBI)
    seed, dropout_scale = _dropout_setup(Seed, dropout_p, HAS_DROPOUT)

    diagonal = seqlen_k - seqlen_q  # bottom-right alignment
    row_start = i_m * BLOCK_M
    lo, full_lo, full_hi, hi = key_runs(row_start, tl.minimum(row_start + BLOCK_M, seqlen_q), diagonal, seqlen_k,
                                        window_left, window_right, MASK_LEFT, MASK_RIGHT, BLOCK_N)
    if IS_PAGED and PAGE_SPLIT > 0:  # a page outside the cache: no whole blocks, the far edge's masked run has them
        full_hi = tl.where(_table_in_cache(table_row, seqlen_k, stride_tn, page_size, num_pages), full_hi, full_lo)

    m_i, l_i = initial_softmax_state(Sinks, i_hq, HAS_SINK, BLOCK_M)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    # the key blocks in three runs: masked left edge, whole blocks, masked right edge (diagonal)
    for run in tl.static_range(3):
        run_lo, run_hi = run_bounds(run, lo, full_lo, full_hi, hi)
        acc, l_i, m_i = _attn_fwd_inner(
            acc, l_i, m_i, b_q, k_src, v_src, bias_base, seed, run_lo, run_hi,
            o_m, o_n, o_d, o_dv, m_m, m_d, m_dv, i_b, i_hk, i_bh, diagonal, seqlen_k,
            stride_kb, stride_ks, stride_kd, stride_vb, stride_vs, stride_vd, stride_bm, stride_bn,
            table_row, stride_tn, page_size, num_pages,
            qk_scale, softcap_scale, softcap_log2, alibi_slope_log2, window_left, window_right,
            dropout_p, dropout_scale,
            run != 1, MASK_LEFT, MASK_RIGHT, HAS_SOFTCAP, HAS_ALIBI, HAS_BIAS, HAS_DROPOUT, HEAD_DIM == BLOCK_D,
            HEAD_DIM_V == BLOCK_DV, USE_TMA, IS_PAGED, PAGE_SPLIT, BLOCK_N, BLOCK_D, BLOCK_DV, DOT_PRECISION,
        )

    out, lse = normalise(acc, l_i, m_i)
    if USE_TMA:
        # the copy engine clips rows past seqlen_q and the padded head dims
        Out.store([i_b, i_m * BLOCK_M, i_hq, 0], out.to(Out.dtype).reshape(1, BLOCK_M, 1, BLOCK_DV))
    else:
        p_o = (Out + i_b * stride_ob + q_start * stride_os + i_hq * stride_oh
               + o_m[:, None] * stride_os + o_dv[None, :] * stride_od)
        tl.store(p_o, out.to(Out.dtype.element_ty), mask=m_m[:, None] & m_dv[None, :])
    tl.store(Lse + i_b * stride_lb + i_hq * stride_lh + q_start + o_m, lse, mask=m_m)


@triton.jit
def attn_bwd_preprocess_kernel(
    Out, DOut, Delta, CuSeqlensQ,
    stride_ob, stride_os, stride_oh, stride_od,
    stride_dob, stride_dos, stride_doh, stride_dod,
    stride_lb, stride_lh,
    seqlen_q,
    IS_VARLEN: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_D2: tl.constexpr,
    BLOCK_M: tl.constexpr, D_BY_MATMUL: tl.constexpr, DOT_PRECISION: tl.constexpr, WIDE: tl.constexpr,
):
    """``D = rowsum(dO ∘ O)`` per block of ``BLOCK_M`` query rows of one head, into ``Delta`` (the
    log-sum-exp's layout), over the head dim in the chunks (``BLOCK_D``, ``BLOCK_D2``) in which the dK/dV and
    dQ kernels form dP = dO Vᵀ.

    ``D_BY_MATMUL`` (O and dO of one dtype): D is the diagonal of O dOᵀ formed by a matmul, as dP is. Where a
    row sees a single key, O is that key's V, and the two are then the same sum of the same products, so that
    dS = P ∘ (dP − D) comes out 0, as it is mathematically, wherever the two matmuls sum in the same order
    (on sm_90 the 16-bit dK/dV tiles of 32 rows use mma.sync where this uses wgmma; every one-key test passed
    on an H100 all the same). An elementwise sum rounds in another order, and its gap to dP, times scale · K,
    exceeded flash-attn's float32 floor on dQ and dK at head dims 192-256 on an H100 (benchmarks/NOTES.md,
    twenty-fifth session). The matmul does ``BLOCK_M`` times the elementwise work: O(seqlen_q · BLOCK_M · D),
    against the backward's O(seqlen_q · seqlen_k · D). Otherwise (an O of another dtype than dO's, as a
    larger attention's may be): the elementwise sum in float32."""
    # a tensor of the call spans more than 2³¹ elements: 64-bit strides make every offset formed with them
    # 64-bit (head-dim strides stay 32-bit; the launcher bounds what they span)
    stride_ob, stride_os, stride_oh = widen(stride_ob, WIDE), widen(stride_os, WIDE), widen(stride_oh, WIDE)
    stride_dob, stride_dos, stride_doh = widen(stride_dob, WIDE), widen(stride_dos, WIDE), widen(stride_doh, WIDE)
    stride_lb, stride_lh = widen(stride_lb, WIDE), widen(stride_lh, WIDE)
    i_m = tl.program_id(0)
    i_h = tl.program_id(1)
    i_b = tl.program_id(2)
    q_start, seqlen_q = _sequence_bounds(i_b, CuSeqlensQ, seqlen_q, IS_VARLEN)
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    o_d = tl.arange(0, BLOCK_D)
    m_m = o_m < seqlen_q
    m_d = o_d < HEAD_DIM
    rows = q_start + o_m
    o_base = Out + i_b * stride_ob + i_h * stride_oh
    do_base = DOut + i_b * stride_dob + i_h * stride_doh
    b_o = _load_rows(o_base + rows[:, None] * stride_os + o_d[None, :] * stride_od, m_m, m_d, True,
                     HEAD_DIM >= BLOCK_D)  # [BLOCK_M, BLOCK_D]
    b_do = _load_rows(do_base + rows[:, None] * stride_dos + o_d[None, :] * stride_dod, m_m, m_d, True,
                      HEAD_DIM >= BLOCK_D)  # [BLOCK_M, BLOCK_D]
    b_o2 = _load_tail(o_base, rows, m_m, stride_os, stride_od, True, HEAD_DIM, BLOCK_D,
                      BLOCK_D2)  # [BLOCK_M, BLOCK_D2]
    b_do2 = _load_tail(do_base, rows, m_m, stride_dos, stride_dod, True, HEAD_DIM, BLOCK_D,
                       BLOCK_D2)  # [BLOCK_M, BLOCK_D2]
    if D_BY_MATMUL:
        o_do = _dot_over_head_dim(b_o, b_do, b_o2, b_do2, BLOCK_D2, DOT_PRECISION)  # O dOᵀ [BLOCK_M, BLOCK_M]
        # the diagonal: one term a row, the others exactly 0
        delta = tl.sum(tl.where(o_m[:, None] == o_m[None, :], o_do, 0.0), 1)  # [BLOCK_M]
    else:
        delta = tl.sum(b_o.to(tl.float32) * b_do.to(tl.float32), 1)  # [BLOCK_M]
        if BLOCK_D2 > 0:
            delta += tl.sum(b_o2.to(tl.float32) * b_do2.to(tl.float32), 1)
    tl.store(Delta + i_b * stride_lb + i_h * stride_lh + rows, delta, mask=m_m)


@triton.jit
def _attn_bwd_dkdv_inner(
    b_dk, b_dv, b_dk2, b_dv2, b_k, b_v, b_k2, b_v2, q_base, do_base, lse_base, delta_base, bias_base, dbias_base,
    seed, lo, hi,
    o_m, o_n, o_d, o_dv, m_n, m_d, m_dv, i_bhq, diagonal, seqlen_q, seqlen_k,
    stride_qs, stride_qd, stride_dos, stride_dod, stride_bm, stride_bn,
    qk_scale, softcap_scale, softcap_log2, alibi_slope_log2, window_left, window_right,
    dropout_p, dropout_scale,
    APPLY_MASK: tl.constexpr, MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr, HAS_BIAS: tl.constexpr, BIAS_GRAD: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_D2: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK_DV2: tl.constexpr, BLOCK_M: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """dK, dV of one K block over Q blocks [lo, hi) of one query head (Kᵀ-major blocks).
    ``APPLY_MASK`` is off for Q blocks that see the whole K block (in bounds, inside the window).
    Head dims held in two chunks (``BLOCK_D2``/``BLOCK_DV2`` > 0) carry their second chunk in ``*2``."""
    for start_m in range(lo, hi, BLOCK_M):
        rows = start_m + o_m
        m_m = rows < seqlen_q
        b_q = _load_rows(q_base + rows[:, None] * stride_qs + o_d[None, :] * stride_qd, m_m, m_d,
                         APPLY_MASK, HEAD_DIM >= BLOCK_D)  # [BLOCK_M, BLOCK_D]
        b_do = _load_rows(do_base + rows[:, None] * stride_dos + o_dv[None, :] * stride_dod, m_m, m_dv,
                          APPLY_MASK, HEAD_DIM_V >= BLOCK_DV)  # [BLOCK_M, BLOCK_DV]
        b_q2 = _load_tail(q_base, rows, m_m, stride_qs, stride_qd, APPLY_MASK, HEAD_DIM, BLOCK_D,
                          BLOCK_D2)  # [BLOCK_M, BLOCK_D2]
        b_do2 = _load_tail(do_base, rows, m_m, stride_dos, stride_dod, APPLY_MASK, HEAD_DIM_V, BLOCK_DV,
                           BLOCK_DV2)  # [BLOCK_M, BLOCK_DV2]
        if APPLY_MASK:
            b_lse = tl.load(lse_base + rows, mask=m_m, other=0.0)  # [BLOCK_M]
            b_delta = tl.load(delta_base + rows, mask=m_m, other=0.0)  # [BLOCK_M]
        else:
            b_lse = tl.load(lse_base + rows)
            b_delta = tl.load(delta_base + rows)
        # rows that saw no key have lse = -inf: exp2(s - inf) = 0
        lse2 = tl.where(b_lse == float("-inf"), float("inf"), b_lse * 1.4426950408889634)
        qk_t = _dot_over_head_dim(b_k, b_q, b_k2, b_q2, BLOCK_D2, DOT_PRECISION)  # [BLOCK_N, BLOCK_M]
        s_t = masked_scores_log2(
            qk_t, rows[None, :], o_n[:, None], m_m[None, :], m_n[:, None], diagonal,
            bias_base + rows[None, :] * stride_bm + o_n[:, None] * stride_bn,
            qk_scale, softcap_scale, softcap_log2, alibi_slope_log2, window_left, window_right,
            APPLY_MASK, MASK_LEFT, MASK_RIGHT, HAS_SOFTCAP, HAS_ALIBI, HAS_BIAS,
        )
        p_t = tl.math.exp2(s_t - lse2[None, :])  # Pᵀ [BLOCK_N, BLOCK_M]
        dp_t = _dot_over_head_dim(b_v, b_do, b_v2, b_do2, BLOCK_DV2, DOT_PRECISION)  # dPᵀ [BLOCK_N, BLOCK_M]
        if HAS_DROPOUT:
            # O = (P ∘ Z) V with Z = keep / (1 − p): dV uses P ∘ Z, and dP reaches P through Z
            keep_t = dropout_keep(seed, rows[None, :], o_n[:, None], i_bhq, dropout_p)
            pz_t = tl.where(keep_t, p_t * dropout_scale, 0.0).to(b_do.dtype)
            dp_t = tl.where(keep_t, dp_t * dropout_scale, 0.0)
        else:
            pz_t = p_t.to(b_do.dtype)
        b_dv = tl.dot(pz_t, b_do, b_dv, input_precision=DOT_PRECISION)
        if BLOCK_DV2 > 0:
            b_dv2 = tl.dot(pz_t, b_do2, b_dv2, input_precision=DOT_PRECISION)
        ds_t = p_t * (dp_t - b_delta[None, :])  # dSᵀ = Pᵀ ∘ (dPᵀ − D), natural-log units
        if BIAS_GRAD:
            tl.store(dbias_base + rows[None, :] * seqlen_k + o_n[:, None], ds_t,
                     mask=m_n[:, None] & m_m[None, :])
        if HAS_SOFTCAP:
            # d(c·tanh(x/c))/dx = 1 − tanh²
            t = tanh(qk_t * softcap_scale)
            ds_t = ds_t * (1.0 - t * t)
        b_dk = tl.dot(ds_t.to(b_q.dtype), b_q, b_dk, input_precision=DOT_PRECISION)
        if BLOCK_D2 > 0:
            b_dk2 = tl.dot(ds_t.to(b_q.dtype), b_q2, b_dk2, input_precision=DOT_PRECISION)
    return b_dk, b_dv, b_dk2, b_dv2


@triton.jit
def attn_bwd_dkdv_kernel(
    Q, K, V, DOut, Lse, Delta, DK, DV, DBias, Bias, AlibiSlopes, Seed, CuSeqlensQ, CuSeqlensK,
    stride_qb, stride_qs, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_dob, stride_dos, stride_doh, stride_dod,
    stride_dkb, stride_dks, stride_dkh, stride_dkd,
    stride_dvb, stride_dvs, stride_dvh, stride_dvd,
    stride_lb, stride_lh,
    stride_bb, stride_bh, stride_bm, stride_bn,
    stride_ab,
    nheads_q, group_size, seqlen_q, seqlen_k, sm_scale,
    qk_scale, softcap_scale, softcap_log2, window_left, window_right, dropout_p,
    MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr, HAS_BIAS: tl.constexpr, BIAS_GRAD: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    IS_VARLEN: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_D2: tl.constexpr,
    HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_DV2: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, WIDE: tl.constexpr,
):
    # a tensor of the call spans more than 2³¹ elements: 64-bit strides make every offset formed with them
    # 64-bit (head-dim strides stay 32-bit; the launcher bounds what they span)
    stride_qb, stride_qs, stride_qh = widen(stride_qb, WIDE), widen(stride_qs, WIDE), widen(stride_qh, WIDE)
    stride_kb, stride_ks, stride_kh = widen(stride_kb, WIDE), widen(stride_ks, WIDE), widen(stride_kh, WIDE)
    stride_vb, stride_vs, stride_vh = widen(stride_vb, WIDE), widen(stride_vs, WIDE), widen(stride_vh, WIDE)
    stride_dob, stride_dos, stride_doh = widen(stride_dob, WIDE), widen(stride_dos, WIDE), widen(stride_doh, WIDE)
    stride_dkb, stride_dks, stride_dkh = widen(stride_dkb, WIDE), widen(stride_dks, WIDE), widen(stride_dkh, WIDE)
    stride_dvb, stride_dvs, stride_dvh = widen(stride_dvb, WIDE), widen(stride_dvs, WIDE), widen(stride_dvh, WIDE)
    stride_lb, stride_lh = widen(stride_lb, WIDE), widen(stride_lh, WIDE)
    stride_bb, stride_bh, stride_bm = widen(stride_bb, WIDE), widen(stride_bh, WIDE), widen(stride_bm, WIDE)
    i_n, i_hk, i_b, q_start, seqlen_q, k_start, seqlen_k = _program(CuSeqlensQ, CuSeqlensK, seqlen_q, seqlen_k,
                                                                    IS_VARLEN)
    if i_n * BLOCK_N >= seqlen_k:
        return  # a packed sequence shorter than the longest

    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    o_m = tl.arange(0, BLOCK_M)
    o_d = tl.arange(0, BLOCK_D)
    o_dv = tl.arange(0, BLOCK_DV)
    m_n = o_n < seqlen_k
    m_d = o_d < HEAD_DIM
    m_dv = o_dv < HEAD_DIM_V
    mask_nd = m_n[:, None] & m_d[None, :]
    mask_ndv = m_n[:, None] & m_dv[None, :]
    keys = k_start + o_n
    k_base = K + i_b * stride_kb + i_hk * stride_kh
    v_base = V + i_b * stride_vb + i_hk * stride_vh
    b_k = tl.load(k_base + keys[:, None] * stride_ks + o_d[None, :] * stride_kd,
                  mask=mask_nd, other=0.0)  # [BLOCK_N, BLOCK_D]
    b_v = tl.load(v_base + keys[:, None] * stride_vs + o_dv[None, :] * stride_vd,
                  mask=mask_ndv, other=0.0)  # [BLOCK_N, BLOCK_DV]
    b_k2 = _load_tail(k_base, keys, m_n, stride_ks, stride_kd, True, HEAD_DIM, BLOCK_D, BLOCK_D2)  # [BLOCK_N, BLOCK_D2]
    b_v2 = _load_tail(v_base, keys, m_n, stride_vs, stride_vd, True, HEAD_DIM_V, BLOCK_DV,
                      BLOCK_DV2)  # [BLOCK_N, BLOCK_DV2]
    b_dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    b_dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
    # held in one chunk, a second accumulator is a placeholder that nothing updates or reads
    b_dk2 = b_dk
    b_dv2 = b_dv
    if BLOCK_D2 > 0:
        b_dk2 = tl.zeros([BLOCK_N, BLOCK_D2], dtype=tl.float32)
    if BLOCK_DV2 > 0:
        b_dv2 = tl.zeros([BLOCK_N, BLOCK_DV2], dtype=tl.float32)
    seed, dropout_scale = _dropout_setup(Seed, dropout_p, HAS_DROPOUT)

    diagonal = seqlen_k - seqlen_q
    col_start = i_n * BLOCK_N
    lo, full_lo, full_hi, hi = query_runs(col_start, tl.minimum(col_start + BLOCK_N, seqlen_k), diagonal, seqlen_q,
                                          window_left, window_right, MASK_LEFT, MASK_RIGHT, BLOCK_M)

    # The whole GQA group of query heads is summed here: dK/dV need no atomics.
    for g in range(0, group_size):
        i_hq = i_hk * group_size + g
        i_bhq = i_b * nheads_q + i_hq
        q_base = Q + i_b * stride_qb + q_start * stride_qs + i_hq * stride_qh
        do_base = DOut + i_b * stride_dob + q_start * stride_dos + i_hq * stride_doh
        lse_base = Lse + i_b * stride_lb + i_hq * stride_lh + q_start
        delta_base = Delta + i_b * stride_lb + i_hq * stride_lh + q_start
        bias_base = Bias + i_b * stride_bb + i_hq * stride_bh
        dbias_base = DBias + i_bhq * seqlen_q * seqlen_k  # dense [batch, nheads_q, seqlen_q, seqlen_k]
        alibi_slope_log2 = _alibi_slope_log2(AlibiSlopes, i_b, i_hq, stride_ab, HAS_ALIBI)
        # the query blocks in three runs: masked (diagonal) edge, whole blocks, masked far edge
        for run in tl.static_range(3):
            run_lo, run_hi = run_bounds(run, lo, full_lo, full_hi, hi)
            b_dk, b_dv, b_dk2, b_dv2 = _attn_bwd_dkdv_inner(
                b_dk, b_dv, b_dk2, b_dv2, b_k, b_v, b_k2, b_v2, q_base, do_base, lse_base, delta_base, bias_base,
                dbias_base, seed,
                run_lo, run_hi, o_m, o_n, o_d, o_dv, m_n, m_d, m_dv, i_bhq, diagonal, seqlen_q, seqlen_k,
                stride_qs, stride_qd, stride_dos, stride_dod, stride_bm, stride_bn,
                qk_scale, softcap_scale, softcap_log2, alibi_slope_log2, window_left, window_right,
                dropout_p, dropout_scale,
                run != 1, MASK_LEFT, MASK_RIGHT, HAS_SOFTCAP, HAS_ALIBI, HAS_BIAS, BIAS_GRAD, HAS_DROPOUT,
                HEAD_DIM, BLOCK_D, BLOCK_D2, HEAD_DIM_V, BLOCK_DV, BLOCK_DV2, BLOCK_M, DOT_PRECISION,
            )

    dk_base = DK + i_b * stride_dkb + i_hk * stride_dkh
    dv_base = DV + i_b * stride_dvb + i_hk * stride_dvh
    tl.store(dk_base + keys[:, None] * stride_dks + o_d[None, :] * stride_dkd,
             (b_dk * sm_scale).to(DK.dtype.element_ty), mask=mask_nd)
    tl.store(dv_base + keys[:, None] * stride_dvs + o_dv[None, :] * stride_dvd,
             b_dv.to(DV.dtype.element_ty), mask=mask_ndv)
    if BLOCK_D2 > 0:
        _store_tail(dk_base, keys, m_n, stride_dks, stride_dkd, b_dk2 * sm_scale, HEAD_DIM, BLOCK_D, BLOCK_D2)
    _store_tail(dv_base, keys, m_n, stride_dvs, stride_dvd, b_dv2, HEAD_DIM_V, BLOCK_DV, BLOCK_DV2)


@triton.jit
def _attn_bwd_dq_inner(
    b_dq, b_dq2, b_q, b_do, b_q2, b_do2, lse2, b_delta, k_base, v_base, bias_base, seed, lo, hi,
    o_m, o_n, o_d, o_dv, m_m, m_d, m_dv, i_bh, diagonal, seqlen_k,
    stride_ks, stride_kd, stride_vs, stride_vd, stride_bm, stride_bn,
    qk_scale, softcap_scale, softcap_log2, alibi_slope_log2, window_left, window_right,
    dropout_p, dropout_scale,
    APPLY_MASK: tl.constexpr, MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_DROPOUT: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_D2: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_DV2: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """dQ of one Q block over K blocks [lo, hi); ``APPLY_MASK`` as in :func:`_attn_fwd_inner`; two-chunk
    head dims as in :func:`_attn_bwd_dkdv_inner`."""
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + o_n
        m_n = cols < seqlen_k
        b_k = _load_rows(k_base + cols[:, None] * stride_ks + o_d[None, :] * stride_kd, m_n, m_d,
                         APPLY_MASK, HEAD_DIM >= BLOCK_D)  # [BLOCK_N, BLOCK_D]
        b_v = _load_rows(v_base + cols[:, None] * stride_vs + o_dv[None, :] * stride_vd, m_n, m_dv,
                         APPLY_MASK, HEAD_DIM_V >= BLOCK_DV)  # [BLOCK_N, BLOCK_DV]
        b_k2 = _load_tail(k_base, cols, m_n, stride_ks, stride_kd, APPLY_MASK, HEAD_DIM, BLOCK_D,
                          BLOCK_D2)  # [BLOCK_N, BLOCK_D2]
        b_v2 = _load_tail(v_base, cols, m_n, stride_vs, stride_vd, APPLY_MASK, HEAD_DIM_V, BLOCK_DV,
                          BLOCK_DV2)  # [BLOCK_N, BLOCK_DV2]
        qk = _dot_over_head_dim(b_q, b_k, b_q2, b_k2, BLOCK_D2, DOT_PRECISION)  # [BLOCK_M, BLOCK_N]
        s = masked_scores_log2(
            qk, o_m[:, None], cols[None, :], m_m[:, None], m_n[None, :], diagonal,
            bias_base + o_m[:, None] * stride_bm + cols[None, :] * stride_bn,
            qk_scale, softcap_scale, softcap_log2, alibi_slope_log2, window_left, window_right,
            APPLY_MASK, MASK_LEFT, MASK_RIGHT, HAS_SOFTCAP, HAS_ALIBI, HAS_BIAS,
        )
        p = tl.math.exp2(s - lse2[:, None])  # P_ij = exp(S_ij − L_i)
        dp = _dot_over_head_dim(b_do, b_v, b_do2, b_v2, BLOCK_DV2, DOT_PRECISION)  # [BLOCK_M, BLOCK_N]
        if HAS_DROPOUT:
            keep = dropout_keep(seed, o_m[:, None], cols[None, :], i_bh, dropout_p)
            dp = tl.where(keep, dp * dropout_scale, 0.0)
        ds = p * (dp - b_delta[:, None])
        if HAS_SOFTCAP:
            t = tanh(qk * softcap_scale)
            ds = ds * (1.0 - t * t)
        b_dq = tl.dot(ds.to(b_k.dtype), b_k, b_dq, input_precision=DOT_PRECISION)
        if BLOCK_D2 > 0:
            b_dq2 = tl.dot(ds.to(b_k.dtype), b_k2, b_dq2, input_precision=DOT_PRECISION)
    return b_dq, b_dq2


@triton.jit
def attn_bwd_dq_kernel(
    Q, K, V, DOut, Lse, Delta, DQ, Bias, AlibiSlopes, Seed, CuSeqlensQ, CuSeqlensK,
    stride_qb, stride_qs, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_dob, stride_dos, stride_doh, stride_dod,
    stride_dqb, stride_dqs, stride_dqh, stride_dqd,
    stride_lb, stride_lh,
    stride_bb, stride_bh, stride_bm, stride_bn,
    stride_ab,
    nheads_q, group_size, seqlen_q, seqlen_k, sm_scale,
    qk_scale, softcap_scale, softcap_log2, window_left, window_right, dropout_p,
    MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_DROPOUT: tl.constexpr, IS_VARLEN: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_D2: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK_DV2: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, WIDE: tl.constexpr,
):
    # a tensor of the call spans more than 2³¹ elements: 64-bit strides make every offset formed with them
    # 64-bit (head-dim strides stay 32-bit; the launcher bounds what they span)
    stride_qb, stride_qs, stride_qh = widen(stride_qb, WIDE), widen(stride_qs, WIDE), widen(stride_qh, WIDE)
    stride_kb, stride_ks, stride_kh = widen(stride_kb, WIDE), widen(stride_ks, WIDE), widen(stride_kh, WIDE)
    stride_vb, stride_vs, stride_vh = widen(stride_vb, WIDE), widen(stride_vs, WIDE), widen(stride_vh, WIDE)
    stride_dob, stride_dos, stride_doh = widen(stride_dob, WIDE), widen(stride_dos, WIDE), widen(stride_doh, WIDE)
    stride_dqb, stride_dqs, stride_dqh = widen(stride_dqb, WIDE), widen(stride_dqs, WIDE), widen(stride_dqh, WIDE)
    stride_lb, stride_lh = widen(stride_lb, WIDE), widen(stride_lh, WIDE)
    stride_bb, stride_bh, stride_bm = widen(stride_bb, WIDE), widen(stride_bh, WIDE), widen(stride_bm, WIDE)
    i_m, i_hq, i_b, q_start, seqlen_q, k_start, seqlen_k = _program(CuSeqlensQ, CuSeqlensK, seqlen_q, seqlen_k,
                                                                    IS_VARLEN)
    i_bh = i_b * nheads_q + i_hq
    i_hk = i_hq // group_size
    if i_m * BLOCK_M >= seqlen_q:
        return  # a packed sequence shorter than the longest

    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    o_n = tl.arange(0, BLOCK_N)
    o_d = tl.arange(0, BLOCK_D)
    o_dv = tl.arange(0, BLOCK_DV)
    m_m = o_m < seqlen_q
    m_d = o_d < HEAD_DIM
    m_dv = o_dv < HEAD_DIM_V
    mask_md = m_m[:, None] & m_d[None, :]
    rows = q_start + o_m
    q_base = Q + i_b * stride_qb + i_hq * stride_qh
    do_base = DOut + i_b * stride_dob + i_hq * stride_doh
    b_q = tl.load(q_base + rows[:, None] * stride_qs + o_d[None, :] * stride_qd,
                  mask=mask_md, other=0.0)  # [BLOCK_M, BLOCK_D]
    b_do = tl.load(do_base + rows[:, None] * stride_dos + o_dv[None, :] * stride_dod,
                   mask=m_m[:, None] & m_dv[None, :], other=0.0)  # [BLOCK_M, BLOCK_DV]
    b_q2 = _load_tail(q_base, rows, m_m, stride_qs, stride_qd, True, HEAD_DIM, BLOCK_D, BLOCK_D2)  # [BLOCK_M, BLOCK_D2]
    b_do2 = _load_tail(do_base, rows, m_m, stride_dos, stride_dod, True, HEAD_DIM_V, BLOCK_DV,
                       BLOCK_DV2)  # [BLOCK_M, BLOCK_DV2]
    b_lse = tl.load(Lse + i_b * stride_lb + i_hq * stride_lh + rows, mask=m_m, other=0.0)  # [BLOCK_M]
    b_delta = tl.load(Delta + i_b * stride_lb + i_hq * stride_lh + rows, mask=m_m, other=0.0)  # [BLOCK_M]
    # rows that saw no key have lse = -inf: exp2(s - inf) = 0; rows past the end load lse 0 and dO 0
    lse2 = tl.where(b_lse == float("-inf"), float("inf"), b_lse * 1.4426950408889634)
    k_base = K + i_b * stride_kb + k_start * stride_ks + i_hk * stride_kh
    v_base = V + i_b * stride_vb + k_start * stride_vs + i_hk * stride_vh
    bias_base = Bias + i_b * stride_bb + i_hq * stride_bh
    alibi_slope_log2 = _alibi_slope_log2(AlibiSlopes, i_b, i_hq, stride_ab, HAS_ALIBI)
    seed, dropout_scale = _dropout_setup(Seed, dropout_p, HAS_DROPOUT)

    diagonal = seqlen_k - seqlen_q
    row_start = i_m * BLOCK_M
    lo, full_lo, full_hi, hi = key_runs(row_start, tl.minimum(row_start + BLOCK_M, seqlen_q), diagonal, seqlen_k,
                                        window_left, window_right, MASK_LEFT, MASK_RIGHT, BLOCK_N)

    b_dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    b_dq2 = b_dq  # a placeholder, as the dK/dV kernel's, unless two chunks
    if BLOCK_D2 > 0:
        b_dq2 = tl.zeros([BLOCK_M, BLOCK_D2], dtype=tl.float32)
    for run in tl.static_range(3):
        run_lo, run_hi = run_bounds(run, lo, full_lo, full_hi, hi)
        b_dq, b_dq2 = _attn_bwd_dq_inner(
            b_dq, b_dq2, b_q, b_do, b_q2, b_do2, lse2, b_delta, k_base, v_base, bias_base, seed, run_lo, run_hi,
            o_m, o_n, o_d, o_dv, m_m, m_d, m_dv, i_bh, diagonal, seqlen_k,
            stride_ks, stride_kd, stride_vs, stride_vd, stride_bm, stride_bn,
            qk_scale, softcap_scale, softcap_log2, alibi_slope_log2, window_left, window_right,
            dropout_p, dropout_scale,
            run != 1, MASK_LEFT, MASK_RIGHT, HAS_SOFTCAP, HAS_ALIBI, HAS_BIAS, HAS_DROPOUT, HEAD_DIM, BLOCK_D,
            BLOCK_D2, HEAD_DIM_V, BLOCK_DV, BLOCK_DV2, BLOCK_N, DOT_PRECISION,
        )

    dq_base = DQ + i_b * stride_dqb + i_hq * stride_dqh
    tl.store(dq_base + rows[:, None] * stride_dqs + o_d[None, :] * stride_dqd,
             (b_dq * sm_scale).to(DQ.dtype.element_ty), mask=mask_md)
    if BLOCK_D2 > 0:
        _store_tail(dq_base, rows, m_m, stride_dqs, stride_dqd, b_dq2 * sm_scale, HEAD_DIM, BLOCK_D, BLOCK_D2)

