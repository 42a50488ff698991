"""Attention of queries against a KV cache in Triton (flash-decoding): split-KV and paged.

One program per (block of query rows, batch · KV head, split). The query rows of a program are
the ``seqlen_q × group_size`` (position, query head) pairs that share one KV head, packed into the
M dimension of the dots (flash-attn's "seqlenq_ngroups_swapped"): K/V are read from memory once per
KV head, not once per query head, which is what decoding — a pass that only streams the cache — is
limited by. The visible key range of a program (causal/window aware, per sequence) is cut into
``num_splits`` runs of whole key blocks; each split runs the online softmax of the main forward
kernel (``flashtile.triton.attention``; base 2 with ``log2 e`` folded into the scale) over its run
and writes a normalised partial output and its log-sum-exp, which ``flashtile.triton.merge``
combines. With one split the kernel writes the final result directly.

Variants, with the score helpers of ``flashtile.triton.scores`` and each sequence's own length as
Nk: softcap ``c · tanh(s / c)``, ALiBi ``−slope · |i + Nk − Nq − j|``, and the sliding window
``i + Nk − Nq − left ≤ j ≤ i + Nk − Nq + right`` (causal sets right = 0); key blocks outside the
window are skipped, not loaded.

Paged cache: ``K`` is (num_blocks, page_size, nheads_k, headdim) and key ``j`` of sequence ``b``
lives at ``K[block_table[b, j // page_size], j % page_size]``; the kernel gathers rows through the
block table, so any page size works (flash-attn 2 needs multiples of 256). Without paging,
``CacheBatchIdx`` optionally maps sequence ``b`` to its cache row.

Conventions: bottom-right causal alignment per sequence; a split that sees no key writes output 0
and log-sum-exp −inf (natural log, float32), which the merge weights 0. A learnable sink (one logit
per query head in the denominator, no value) is counted by the first split alone.

Rotary embeddings (flash-attn 2's ``rotary_cos``/``rotary_sin``) are applied to the tiles as they
are loaded: the appended keys in :func:`kvcache_append_kernel` before they are stored, the queries
here before the first dot (:func:`_rotary`, positions by ``reference.rotary_positions``' rule), so no
rotated copy of q or k is ever written to memory.

Offsets are 32-bit unless a tensor spans more than 2³¹ − 1 elements (``WIDE``, as in
``flashtile.triton.attention``). Q·Kᵀ runs over the head dim in one chunk up to 256 and in 64-wide
chunks beyond (absorbed MLA: q/k 576); V and Out may have their own head dim (512 there).

Memory safety: whatever the index tensors hold, no load leaves the tensors: each sequence's length
is clamped into [0, capacity]; a ``CacheBatchIdx`` outside [0, cache_rows) makes the sequence see no
key; a ``BlockTable`` page id outside [0, cache_rows) (the number of pages) makes that page's keys
invisible. (``flashtile._validate`` refuses such values wherever reading them is free.)
"""

from __future__ import annotations

import triton
import triton.language as tl

from .scores import initial_softmax_state, is_visible, key_range, normalise, scores_log2, widen


@triton.jit
def _rotary(b_x, x_rows, stride_xd, m_rows, positions, Cos, Sin, stride_ro, seqlen_ro,
            ROTARY_DIM: tl.constexpr, INTERLEAVED: tl.constexpr, BLOCK_D: tl.constexpr):
    """b_x [R, BLOCK_D], loaded from the row pointers ``x_rows`` [R, 1] (channel stride ``stride_xd``),
    with its first ``ROTARY_DIM`` channels rotated at ``positions`` [R] of the (seqlen_ro, ROTARY_DIM / 2)
    tables: each channel's partner (the other half, or the neighbour when ``INTERLEAVED``) is loaded
    again, and ``x' = x · cos ∓ partner · sin`` is formed in float32 and rounded once, as
    ``reference.apply_rotary``."""
    HALF: tl.constexpr = ROTARY_DIM // 2
    o_d = tl.arange(0, BLOCK_D)
    if INTERLEAVED:  # pairs (2j, 2j + 1)
        partner, angle, first = o_d ^ 1, o_d // 2, o_d % 2 == 0
    else:  # pairs (j, j + HALF)
        first = o_d < HALF
        partner, angle = tl.where(first, o_d + HALF, o_d - HALF), tl.where(first, o_d, o_d - HALF)
    rotated = o_d < ROTARY_DIM
    m = m_rows[:, None] & rotated[None, :]
    row = tl.minimum(tl.maximum(positions, 0), seqlen_ro - 1)[:, None] * stride_ro  # [R, 1]
    cos = tl.load(Cos + row + angle[None, :], mask=m, other=1.0).to(tl.float32)  # [R, BLOCK_D]
    sin = tl.load(Sin + row + angle[None, :], mask=m, other=0.0).to(tl.float32)
    b_partner = tl.load(x_rows + partner[None, :] * stride_xd, mask=m, other=0.0).to(tl.float32)
    b_rotated = b_x.to(tl.float32) * cos + tl.where(first, -1.0, 1.0)[None, :] * b_partner * sin
    return tl.where(rotated[None, :], b_rotated.to(b_x.dtype), b_x)


@triton.jit
def _float8_to_float16(x):
    """A float8 tile (e4m3 or e5m2) widened to float16, exactly, by the PTX conversion of two values at
    a time (sm_89 and later): the same instruction ``.to(tl.float16)`` lowers to, in a form whose layout
    Triton keeps (the kernel's ``CONVERT_V_BY_PTX``). GPU only: Triton's interpreter runs no PTX."""
    if x.dtype == tl.float8e5:
        return tl.inline_asm_elementwise("cvt.rn.f16x2.e5m2x2 $0, $1;", "=r,h", [x], dtype=tl.float16,
                                         is_pure=False, pack=2)
    return tl.inline_asm_elementwise("cvt.rn.f16x2.e4m3x2 $0, $1;", "=r,h", [x], dtype=tl.float16,
                                     is_pure=False, pack=2)


@triton.jit
def _paged_rows(table_base, start_n, o_n, m_n, limit, page_size, cache_rows, stride_tn, stride_kb, stride_ks,
                stride_vb, stride_vs, PAGE_SPLIT: tl.constexpr, BLOCK_N: tl.constexpr):
    """(K rows, V rows, visibility), each [BLOCK_N], of keys ``start_n + o_n`` (``start_n`` a multiple of
    BLOCK_N, ``m_n`` their bounds, ``limit`` the end of the keys) in a paged cache: key j lives in page
    ``table[j // page_size]``, slot ``j % page_size``; a page id outside the cache hides its keys and is never
    dereferenced. ``PAGE_SPLIT`` (``configs.page_split``): 1, the block lies in one page, whose id is one
    scalar load and whose rows are consecutive; > 1, the block spans that many whole pages, ids by scalar loads;
    0, one vector load of an id per key, which Triton's pipeliner turns into an asynchronous copy that the
    K/V copies wait behind, and a division per key (pages of 1–8 slots, or sizes that neither divide
    BLOCK_N nor are multiples of it)."""
    if PAGE_SPLIT == 1:
        # start_n < the sequence's keys ≤ the table's capacity: the entry exists
        page = tl.load(table_base + (start_n // page_size) * stride_tn).to(tl.int64)
        valid = (page >= 0) & (page < cache_rows)
        page = tl.where(valid, page, 0)
        slots = start_n % page_size + o_n
        return page * stride_kb + slots * stride_ks, page * stride_vb + slots * stride_vs, m_n & valid
    if PAGE_SPLIT > 1:
        PAGE: tl.constexpr = BLOCK_N // PAGE_SPLIT  # the page size; start_n is a multiple of it
        b_page = tl.zeros([BLOCK_N], dtype=tl.int64)
        for j in tl.static_range(PAGE_SPLIT):
            # a page that starts past the keys is not read (the table holds the pages of every key)
            page = tl.load(table_base + (start_n // PAGE + j) * stride_tn, mask=start_n + j * PAGE < limit, other=0)
            b_page = tl.where(o_n // PAGE == j, page.to(tl.int64), b_page)
        slots = o_n % PAGE
    else:
        cols = start_n + o_n
        b_page = tl.load(table_base + (cols // page_size) * stride_tn, mask=m_n, other=0).to(tl.int64)
        slots = cols % page_size
    m_n = m_n & (b_page >= 0) & (b_page < cache_rows)
    b_page = tl.where(m_n, b_page, 0)
    return b_page * stride_kb + slots * stride_ks, b_page * stride_vb + slots * stride_vs, m_n


@triton.jit
def kvcache_attn_fwd_kernel(
    Q, K, V, Out, Lse, SeqlensK, CacheBatchIdx, BlockTable, AlibiSlopes, Sinks, CuSeqlensQ, CacheLeftpad,
    KDescale, VDescale, RotaryCos, RotarySin, RotaryStart,
    stride_qb, stride_qs, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_op, stride_ob, stride_os, stride_oh, stride_od,
    stride_lp, stride_lb, stride_lh, stride_ls,
    stride_tb, stride_tn, stride_ab, stride_ah, stride_sb, stride_sh, stride_ro,
    nheads_k, group_size, seqlen_q, num_splits, page_size, capacity, cache_rows, seqlen_ro,
    qk_scale, softcap_scale, softcap_log2, window_left, window_right,
    IS_PAGED: tl.constexpr, PAGE_SPLIT: tl.constexpr, HAS_BATCH_IDX: tl.constexpr, IS_VARLEN_Q: tl.constexpr,
    HAS_LEFTPAD: tl.constexpr, HAS_DESCALE: tl.constexpr, CONVERT_V_BY_PTX: tl.constexpr, ROTARY_DIM: tl.constexpr,
    ROTARY_INTERLEAVED: tl.constexpr, ROTARY_AT_START: tl.constexpr,
    MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    HAS_SINK: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
    WIDE: tl.constexpr,
):
    """``BLOCK_D``: Q·Kᵀ runs over the head dim in chunks of BLOCK_D (one chunk, Q held in registers,
    up to 256; absorbed MLA's 576 in 64-wide chunks); ``HEAD_DIM_V``/``BLOCK_DV``: V's and Out's.
    ``IS_VARLEN_Q``: Q, Out and Lse are packed over the sequences (total_q rows, batch strides 0;
    ``seqlen_q`` is then total_q), sequence b's queries at rows ``CuSeqlensQ[b]`` on.
    ``HAS_LEFTPAD``: sequence b's keys start at slot ``CacheLeftpad[b]``; masks and ALiBi stay in slot
    indices, which is the same rule as counting from the first key (the end is what aligns them).
    ``HAS_DESCALE``: the cache is float8; K and V of (sequence b, KV head h) are the stored values times
    ``KDescale[b, h]`` and ``VDescale[b, h]`` (strides ``stride_sb``, ``stride_sh``): the tiles are
    widened for the dots to float16 (each row of bfloat16 q divided by a power of two that fits it; q's
    own dtype for absorbed MLA's head dims beyond one chunk), the K scale folded into the score scale
    and the V scale into the output. ``CONVERT_V_BY_PTX`` (float8 V widened to float16, on sm_89 and later): V's
    widening is written as the PTX instruction (``_float8_to_float16``), which Triton does not move: with
    ``.to()`` it moved the conversion after a change to the dot operand's layout, which loads an 8-bit
    tile transposed one byte at a time (64 ``ld.shared.b8`` per thread per block in the sm_90a PTX); this
    way the tile converts where it was loaded and the transposition runs on float16 (``ldmatrix.trans``).
    ``ROTARY_DIM`` > 0: Q's first ROTARY_DIM channels are rotated at positions
    ``RotaryStart[b]`` + the query's index in its sequence (``RotaryStart[b]`` alone with
    ``ROTARY_AT_START``), in one chunk (the launcher keeps ROTARY_DIM ≤ BLOCK_D)."""
    # a tensor of the call spans more than 2³¹ elements: 64-bit strides make every offset formed with them
    # 64-bit (head-dim strides stay 32-bit; the launcher bounds what they span)
    stride_qb, stride_qs, stride_qh = widen(stride_qb, WIDE), widen(stride_qs, WIDE), widen(stride_qh, WIDE)
    stride_kb, stride_ks, stride_kh = widen(stride_kb, WIDE), widen(stride_ks, WIDE), widen(stride_kh, WIDE)
    stride_vb, stride_vs, stride_vh = widen(stride_vb, WIDE), widen(stride_vs, WIDE), widen(stride_vh, WIDE)
    stride_op, stride_ob = widen(stride_op, WIDE), widen(stride_ob, WIDE)
    stride_os, stride_oh = widen(stride_os, WIDE), widen(stride_oh, WIDE)
    stride_lp, stride_lb = widen(stride_lp, WIDE), widen(stride_lb, WIDE)
    stride_lh, stride_ls = widen(stride_lh, WIDE), widen(stride_ls, WIDE)
    i_m = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_split = tl.program_id(2)
    i_b = i_bh // nheads_k
    i_hk = i_bh % nheads_k
    q_start = 0
    if IS_VARLEN_Q:  # the sequence's queries, clamped into the token axis as in the packed kernels
        q_start = tl.minimum(tl.maximum(tl.load(CuSeqlensQ + i_b), 0), seqlen_q)
        seqlen_q = tl.minimum(tl.maximum(tl.load(CuSeqlensQ + i_b + 1), q_start), seqlen_q) - q_start
        if i_m * BLOCK_M >= seqlen_q * group_size:
            return  # a sequence with fewer queries than the longest

    # row r of the block is query position r // group_size, query head i_hk·group_size + r % group_size
    o_r = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    o_q = o_r // group_size
    o_hq = i_hk * group_size + o_r % group_size
    o_n = tl.arange(0, BLOCK_N)
    o_d = tl.arange(0, BLOCK_D)
    o_dv = tl.arange(0, BLOCK_DV)
    m_r = o_r < seqlen_q * group_size
    m_d = o_d < HEAD_DIM
    m_dv = o_dv < HEAD_DIM_V

    q_rows = Q + i_b.to(tl.int64) * stride_qb + (q_start + o_q[:, None]) * stride_qs + o_hq[:, None] * stride_qh
    b_q = tl.load(q_rows + o_d[None, :] * stride_qd, mask=m_r[:, None] & m_d[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
    if ROTARY_DIM > 0:
        positions = tl.load(RotaryStart + i_b)
        if not ROTARY_AT_START:
            positions = positions + o_q
        b_q = _rotary(b_q, q_rows, stride_qd, m_r, positions, RotaryCos, RotarySin, stride_ro, seqlen_ro,
                      ROTARY_DIM, ROTARY_INTERLEAVED, BLOCK_D)
    alibi_slope_log2 = 0.0
    if HAS_ALIBI:
        b_slope = tl.load(AlibiSlopes + i_b * stride_ab + o_hq * stride_ah, mask=m_r, other=0.0)  # [BLOCK_M]
        alibi_slope_log2 = b_slope[:, None] * 1.4426950408889634  # * log2(e), for base-2 scores

    if IS_PAGED:
        k_base = K + i_hk * stride_kh
        v_base = V + i_hk * stride_vh
        table_base = BlockTable + i_b.to(tl.int64) * stride_tb
    # a sequence's valid keys, clamped into the cache: no cache_seqlens value reaches outside it
    seqlen_k = tl.minimum(tl.maximum(tl.load(SeqlensK + i_b), 0), capacity)
    if not IS_PAGED:
        i_cache = i_b.to(tl.int64)
        if HAS_BATCH_IDX:
            i_cache = tl.load(CacheBatchIdx + i_b).to(tl.int64)
            # a cache row outside the cache: the sequence sees no key (output 0, log-sum-exp -inf)
            seqlen_k = tl.where((i_cache >= 0) & (i_cache < cache_rows), seqlen_k, 0)
            i_cache = tl.minimum(tl.maximum(i_cache, 0), cache_rows - 1)
        k_base = K + i_cache * stride_kb + i_hk * stride_kh
        v_base = V + i_cache * stride_vb + i_hk * stride_vh

    # -- the keys this block of rows can see, [lo, hi), cut into num_splits runs of whole blocks
    diagonal = seqlen_k - seqlen_q  # bottom-right alignment, per sequence
    first_q = (i_m * BLOCK_M) // group_size
    last_q = tl.minimum((i_m * BLOCK_M + BLOCK_M - 1) // group_size, seqlen_q - 1)
    lo, hi = key_range(first_q, last_q + 1, diagonal, seqlen_k, window_left, window_right,
                        MASK_LEFT, MASK_RIGHT, BLOCK_N)
    leftpad = 0
    if HAS_LEFTPAD:  # slots before the sequence's first are not its keys: skip their blocks, mask the rest
        leftpad = tl.minimum(tl.maximum(tl.load(CacheLeftpad + i_b), 0), seqlen_k)
        lo = tl.maximum(lo, (leftpad // BLOCK_N) * BLOCK_N)
    blocks_per_split = tl.cdiv(tl.cdiv(tl.maximum(hi - lo, 0), BLOCK_N), num_splits)
    split_lo = lo + i_split * blocks_per_split * BLOCK_N
    split_hi = tl.minimum(hi, split_lo + blocks_per_split * BLOCK_N)

    m_i, l_i = initial_softmax_state(Sinks, o_hq, HAS_SINK, BLOCK_M)
    if HAS_SINK:  # the sink joins the denominator once: in the first split, which the merge then weights
        m_i = tl.where(i_split == 0, m_i, float("-inf"))
        l_i = tl.where(i_split == 0, l_i, 0.0)
    if HAS_DESCALE:  # s = (q · k₈) · k_descale · scale
        k_descale = tl.load(KDescale + i_b * stride_sb + i_hk * stride_sh)
        qk_scale = qk_scale * k_descale
        softcap_scale = softcap_scale * k_descale
        if HEAD_DIM <= BLOCK_D and b_q.dtype == tl.bfloat16:
            # the dots in float16: float8 widens to it in one instruction a pair, to bfloat16 in three
            # (the PTX's conversions per block: 64 against 192). Each row of q is divided by the power of two
            # that brings its largest value to [2^14, 2^15): exact in float16 wherever the row's values span
            # fewer than ~2^24 (bfloat16's 8 bits stay clear of float16's subnormals). Per row, so that one
            # head's magnitude or a non-finite value cannot reach the others; rows of zeros or holding inf
            # or NaN keep their values (and their result)
            b_q32 = b_q.to(tl.float32)
            q_max = tl.max(tl.abs(b_q32), 1)  # [BLOCK_M]
            exponent = tl.clamp(tl.ceil(tl.math.log2(q_max)) - 15.0, -100.0, 100.0)
            q_pow = tl.math.exp2(tl.where((q_max > 0) & (q_max < float("inf")), exponent, 0.0))[:, None]
            b_q = (b_q32 / q_pow).to(tl.float16)
            qk_scale = qk_scale * q_pow  # [BLOCK_M, 1]
            softcap_scale = softcap_scale * q_pow
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    for start_n in range(split_lo, split_hi, BLOCK_N):
        cols = start_n + o_n
        m_n = cols < split_hi
        if HAS_LEFTPAD:
            m_n = m_n & (cols >= leftpad)
        if IS_PAGED:
            k_rows, v_rows, m_n = _paged_rows(table_base, start_n, o_n, m_n, split_hi, page_size, cache_rows,
                                              stride_tn, stride_kb, stride_ks, stride_vb, stride_vs, PAGE_SPLIT,
                                              BLOCK_N)  # [BLOCK_N] each
        else:
            k_rows = cols * stride_ks
            v_rows = cols * stride_vs
        b_k = tl.load(k_base + k_rows[:, None] + o_d[None, :] * stride_kd,
                      mask=m_n[:, None] & m_d[None, :], other=0.0)  # [BLOCK_N, BLOCK_D]
        b_v = tl.load(v_base + v_rows[:, None] + o_dv[None, :] * stride_vd,
                      mask=m_n[:, None] & m_dv[None, :], other=0.0)  # [BLOCK_N, BLOCK_DV]
        if HAS_DESCALE:  # float8 → the dots' dtype (q's, or float16): exact, the scales applied outside them
            b_k = b_k.to(b_q.dtype)
            if CONVERT_V_BY_PTX and b_q.dtype == tl.float16:
                b_v = _float8_to_float16(b_v)
            else:
                b_v = b_v.to(b_q.dtype)
        qk = tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N]
        # head dims beyond one chunk (absorbed MLA: 576): the rest of Q·Kᵀ chunk by chunk, Q re-read
        for d0 in tl.static_range(BLOCK_D, HEAD_DIM, BLOCK_D):
            m_c = (d0 + o_d) < HEAD_DIM
            b_qc = tl.load(q_rows + (d0 + o_d)[None, :] * stride_qd, mask=m_r[:, None] & m_c[None, :], other=0.0)
            b_kc = tl.load(k_base + k_rows[:, None] + (d0 + o_d)[None, :] * stride_kd,
                           mask=m_n[:, None] & m_c[None, :], other=0.0).to(b_q.dtype)  # [BLOCK_N, BLOCK_D]
            qk = tl.dot(b_qc, tl.trans(b_kc), qk, input_precision=DOT_PRECISION)
        s = scores_log2(qk, o_q[:, None], cols[None, :], diagonal, qk_scale, softcap_scale, softcap_log2,
                         alibi_slope_log2, HAS_SOFTCAP, HAS_ALIBI)
        visible = m_n[None, :] & is_visible(o_q[:, None], cols[None, :], diagonal, window_left, window_right,
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
    out, lse = normalise(acc, l_i, m_i)
    if HAS_DESCALE:  # o = P · (v₈ · v_descale)
        out = out * tl.load(VDescale + i_b * stride_sb + i_hk * stride_sh)
    out_base = Out + i_split * stride_op + i_b.to(tl.int64) * stride_ob
    p_o = out_base + (q_start + o_q[:, None]) * stride_os + o_hq[:, None] * stride_oh + o_dv[None, :] * stride_od
    tl.store(p_o, out.to(Out.dtype.element_ty), mask=m_r[:, None] & m_dv[None, :])
    lse_base = Lse + i_split * stride_lp + i_b.to(tl.int64) * stride_lb
    tl.store(lse_base + o_hq * stride_lh + (q_start + o_q) * stride_ls, lse, mask=m_r)


@triton.jit
def _round_to_float8(x, MANTISSA: tl.constexpr, MIN_EXPONENT: tl.constexpr):
    """float32 x (within the format's range) rounded to the nearest float8 value, ties to even, still as
    float32: the conversion that follows is then exact, whatever rounding the converter does (Triton's
    interpreter does not round to nearest). Normal values keep ``MANTISSA`` bits (rounding the bit
    pattern); below 2^``MIN_EXPONENT`` the step is fixed, and a float32 add rounds to it."""
    SHIFT: tl.constexpr = 23 - MANTISSA
    x_bits = x.to(tl.int32, bitcast=True)
    bits = (x_bits + ((1 << (SHIFT - 1)) - 1) + ((x_bits >> SHIFT) & 1)) & ~((1 << SHIFT) - 1)
    normal = bits.to(tl.float32, bitcast=True)
    magic: tl.constexpr = 1.5 * 2.0 ** (23 + MIN_EXPONENT - MANTISSA)  # adds with a step of 2^(MIN_EXPONENT - MANTISSA)
    subnormal = (tl.abs(x) + magic) - magic
    # the sign kept (−0, and what rounds to it, stay −0); a product, as a negation compiles to 0 − x, which is +0
    subnormal = tl.where(x_bits < 0, subnormal * -1.0, subnormal)
    rounded = tl.where(tl.abs(x) < 2.0 ** MIN_EXPONENT, subnormal, normal)
    return tl.where(x != x, x, rounded)  # NaN stays NaN (the bit arithmetic would make it a number)


@triton.jit
def quantise_float8(x, descale, FP8_MAX: tl.constexpr, MANTISSA: tl.constexpr, MIN_EXPONENT: tl.constexpr):
    """x / descale clamped to ±``FP8_MAX`` and rounded to the float8 format's nearest value (ties to even), as
    float32: what the CPU path's ``(x / descale).clamp(-max, max).to(float8)`` stores, NaN (kept by the clamp,
    as torch's clamp keeps it) and the sign of zero included."""
    clamped = tl.clamp(x.to(tl.float32) / descale, -FP8_MAX, FP8_MAX, tl.PropagateNan.ALL)
    return _round_to_float8(clamped, MANTISSA, MIN_EXPONENT)


@triton.jit
def kvcache_append_kernel(
    K, V, KCache, VCache, CacheSeqlens, CacheBatchIdx, BlockTable, CuSeqlensNew, KDescale, VDescale,
    RotaryCos, RotarySin,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_cb, stride_cs, stride_ch, stride_cd,
    stride_wb, stride_ws, stride_wh, stride_wd,
    stride_tb, stride_tn, stride_sb, stride_sh, stride_ro,
    seqlen_new, page_size, capacity, cache_rows, seqlen_ro,
    IS_PAGED: tl.constexpr, HAS_BATCH_IDX: tl.constexpr, IS_VARLEN: tl.constexpr, HAS_DESCALE: tl.constexpr,
    ROTARY_DIM: tl.constexpr, ROTARY_INTERLEAVED: tl.constexpr,
    FP8_MAX: tl.constexpr, FP8_MANTISSA: tl.constexpr, FP8_MIN_EXPONENT: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_S: tl.constexpr,
    WIDE: tl.constexpr,
):
    """Write new keys/values k, v [B, Sn, Hk, D] into the cache at positions cache_seqlens[b] + i; with
    ``IS_VARLEN`` k, v are packed [total_new, Hk, D] (batch strides 0; ``seqlen_new`` is total_new),
    sequence b's at rows ``CuSeqlensNew[b]`` on. ``HAS_DESCALE``: the cache is float8 and a new value x is
    stored as x / descale[b, h], clamped to ±``FP8_MAX`` and rounded to nearest even
    (:func:`_round_to_float8`). ``ROTARY_DIM`` > 0: k's first ROTARY_DIM channels are rotated at the
    row's position (:func:`_rotary`) before anything else.

    One program per (block of new rows, KV head, sequence). A write lands only where it is inside
    the cache: position in [0, capacity), cache row (``CacheBatchIdx``) or page (``BlockTable``) in
    [0, cache_rows); any other is dropped, so no index value can write outside the cache or over
    another sequence's slot."""
    # a tensor of the call spans more than 2³¹ elements: 64-bit strides make every offset formed with them
    # 64-bit (head-dim strides stay 32-bit; the launcher bounds what they span)
    stride_kb, stride_ks, stride_kh = widen(stride_kb, WIDE), widen(stride_ks, WIDE), widen(stride_kh, WIDE)
    stride_vb, stride_vs, stride_vh = widen(stride_vb, WIDE), widen(stride_vs, WIDE), widen(stride_vh, WIDE)
    stride_cb, stride_cs, stride_ch = widen(stride_cb, WIDE), widen(stride_cs, WIDE), widen(stride_ch, WIDE)
    stride_wb, stride_ws, stride_wh = widen(stride_wb, WIDE), widen(stride_ws, WIDE), widen(stride_wh, WIDE)
    i_s = tl.program_id(0)
    i_h = tl.program_id(1)
    i_b = tl.program_id(2).to(tl.int64)
    new_start = 0
    if IS_VARLEN:  # the sequence's new rows, clamped into the token axis
        new_start = tl.minimum(tl.maximum(tl.load(CuSeqlensNew + i_b), 0), seqlen_new)
        seqlen_new = tl.minimum(tl.maximum(tl.load(CuSeqlensNew + i_b + 1), new_start), seqlen_new) - new_start
    o_s = i_s * BLOCK_S + tl.arange(0, BLOCK_S)
    o_d = tl.arange(0, BLOCK_D)
    o_dv = tl.arange(0, BLOCK_DV)
    m_s = o_s < seqlen_new
    m_d = o_d < HEAD_DIM
    m_dv = o_dv < HEAD_DIM_V
    positions = tl.load(CacheSeqlens + i_b).to(tl.int64) + o_s  # [BLOCK_S]
    rotary_positions = positions  # before the clamping below: the table has its own bounds
    valid = m_s & (positions >= 0) & (positions < capacity)
    positions = tl.where(valid, positions, 0)
    if IS_PAGED:
        page = tl.load(BlockTable + i_b * stride_tb + (positions // page_size) * stride_tn, mask=valid,
                       other=0).to(tl.int64)
        valid = valid & (page >= 0) & (page < cache_rows)
        page = tl.where(valid, page, 0)
        k_rows = page * stride_cb + (positions % page_size) * stride_cs
        v_rows = page * stride_wb + (positions % page_size) * stride_ws
    else:
        row = i_b
        if HAS_BATCH_IDX:
            row = tl.load(CacheBatchIdx + i_b).to(tl.int64)
            valid = valid & (row >= 0) & (row < cache_rows)
            row = tl.where((row >= 0) & (row < cache_rows), row, 0)
        k_rows = row * stride_cb + positions * stride_cs
        v_rows = row * stride_wb + positions * stride_ws
    rows = new_start + o_s
    new_k_rows = K + i_b * stride_kb + i_h * stride_kh + rows[:, None] * stride_ks  # [BLOCK_S, 1]
    b_k = tl.load(new_k_rows + o_d[None, :] * stride_kd, mask=m_s[:, None] & m_d[None, :], other=0.0)  # [BLOCK_S, BLOCK_D]
    if ROTARY_DIM > 0:
        b_k = _rotary(b_k, new_k_rows, stride_kd, m_s, rotary_positions, RotaryCos, RotarySin, stride_ro, seqlen_ro,
                      ROTARY_DIM, ROTARY_INTERLEAVED, BLOCK_D)
    b_v = tl.load(V + i_b * stride_vb + i_h * stride_vh + rows[:, None] * stride_vs + o_dv[None, :] * stride_vd,
                  mask=m_s[:, None] & m_dv[None, :], other=0.0)  # [BLOCK_S, BLOCK_DV]
    if HAS_DESCALE:
        k_descale = tl.load(KDescale + i_b * stride_sb + i_h * stride_sh)
        v_descale = tl.load(VDescale + i_b * stride_sb + i_h * stride_sh)
        b_k = quantise_float8(b_k, k_descale, FP8_MAX, FP8_MANTISSA, FP8_MIN_EXPONENT).to(KCache.dtype.element_ty)
        b_v = quantise_float8(b_v, v_descale, FP8_MAX, FP8_MANTISSA, FP8_MIN_EXPONENT).to(VCache.dtype.element_ty)
    tl.store(KCache + i_h * stride_ch + k_rows[:, None] + o_d[None, :] * stride_cd, b_k,
             mask=valid[:, None] & m_d[None, :])
    # V after K: where v_cache is a view into k_cache (absorbed MLA), the value channels are written last
    tl.store(VCache + i_h * stride_wh + v_rows[:, None] + o_dv[None, :] * stride_wd, b_v,
             mask=valid[:, None] & m_dv[None, :])
