"""Score modifiers, visibility and the online softmax's end, shared by every flashtile Triton kernel.

A kernel computes the raw product ``qk = q · k`` of a block and turns it into
base-2 scores for ``exp2`` (``log2 e`` folded in), in this order, each step
switched by a constexpr so that the plain path compiles to ``qk · qk_scale``:

1. scale and softcap: ``s = qk · scale`` or, with softcap ``c > 0``,
   ``s = c · tanh(qk · scale / c)`` (Gemma 2);
2. ALiBi: ``s −= slope · |i + Nk − Nq − j|``;
3. an additive bias (SDPA's float ``attn_mask``), added by the kernel itself;
4. visibility: key ``j`` is visible to query ``i`` iff
   ``i + Nk − Nq − left ≤ j ≤ i + Nk − Nq + right`` where a bound of −1 is
   unbounded (flash-attn's ``window_size``); causal is ``right = 0``
   (bottom-right alignment). Invisible scores become −inf.

The block-range helpers give the K blocks a Q block can see and the Q blocks
that can see a K block, so that blocks entirely outside the mask are skipped,
never loaded: the cost of a sliding window grows with the window, not seqlen.

Dropout uses Philox-4x32-10 (``tl.random.philox``) keyed by a 64-bit seed with
counter ``(j, i, sequence·nheads + head, 0)``: the backward regenerates the
mask instead of storing it, and ``reference.dropout_keep_mask`` rebuilds the
same bits in PyTorch.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def tanh(x):
    """float32 tanh as a rational function (Eigen's fast tanh, a few ulps).

    Triton's interpreter has no libdevice tanh, and ``1 − 2/(e^{2x} + 1)`` loses
    all relative accuracy near 0, where softcapped scores live.
    """
    x = tl.minimum(tl.maximum(x, -7.90531110763549805), 7.90531110763549805)
    x2 = x * x
    p = x2 * -2.76076847742355e-16 + 2.00018790482477e-13
    p = x2 * p + -8.60467152213735e-11
    p = x2 * p + 5.12229709037114e-08
    p = x2 * p + 1.48572235717979e-05
    p = x2 * p + 6.37261928875436e-04
    p = x2 * p + 4.89352455891786e-03
    q = x2 * 1.19825839466702e-06 + 1.18534705686654e-04
    q = x2 * q + 2.26843463243900e-03
    q = x2 * q + 4.89352518554385e-03
    return x * p / q


@triton.jit
def scores_log2(qk, rows, cols, diagonal, qk_scale, softcap_scale, softcap_log2, alibi_slope_log2,
                 HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr):
    """Base-2 scores of a block from its raw product ``qk``.

    ``rows`` and ``cols`` are query and key indices shaped to broadcast against
    ``qk`` ([BM, 1] and [1, BN], or the transpose for a key-major block).
    qk_scale = scale·log2 e; softcap_scale = scale / c; softcap_log2 = c·log2 e;
    alibi_slope_log2 = slope·log2 e. Bias and visibility are applied by the caller.
    """
    if HAS_SOFTCAP:
        s = tanh(qk * softcap_scale) * softcap_log2
    else:
        s = qk * qk_scale
    if HAS_ALIBI:
        s -= alibi_slope_log2 * tl.abs(rows + diagonal - cols).to(tl.float32)
    return s


@triton.jit
def is_visible(rows, cols, diagonal, window_left, window_right,
             MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr):
    """Whether key ``cols`` is visible to query ``rows`` by the window/causal rule (no bounds).

    ``rows`` and ``cols`` broadcast against each other, as in :func:`scores_log2`.
    """
    rel = cols - rows - diagonal  # j − (i + Nk − Nq)
    visible = rel == rel
    if MASK_LEFT:
        visible = visible & (rel >= -window_left)
    if MASK_RIGHT:
        visible = visible & (rel <= window_right)
    return visible


@triton.jit
def masked_scores_log2(qk, rows, cols, m_rows, m_cols, diagonal, bias_ptrs,
                        qk_scale, softcap_scale, softcap_log2, alibi_slope_log2, window_left, window_right,
                        APPLY_MASK: tl.constexpr, MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr,
                        HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_BIAS: tl.constexpr):
    """The whole score pipeline of a block: :func:`scores_log2`, the bias, then −inf where a key
    is out of bounds (``m_rows``/``m_cols``) or outside the window — only when ``APPLY_MASK``,
    which the kernels turn off for blocks every row sees whole. Any orientation (see
    :func:`scores_log2`); ``bias_ptrs`` point at the bias entries of the block."""
    s = scores_log2(qk, rows, cols, diagonal, qk_scale, softcap_scale, softcap_log2, alibi_slope_log2,
                     HAS_SOFTCAP, HAS_ALIBI)
    if HAS_BIAS:
        s += tl.load(bias_ptrs, mask=m_rows & m_cols, other=0.0).to(tl.float32) * 1.4426950408889634
    if APPLY_MASK:
        visible = m_rows & m_cols
        if MASK_LEFT or MASK_RIGHT:
            visible = visible & is_visible(rows, cols, diagonal, window_left, window_right, MASK_LEFT, MASK_RIGHT)
        s = tl.where(visible, s, float("-inf"))
    return s


@triton.jit
def key_range(row_start, row_end, diagonal, seqlen_k, window_left, window_right,
               MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr, BLOCK_N: tl.constexpr):
    """[lo, hi) of the keys that queries [row_start, row_end) can see; lo is a multiple of BLOCK_N."""
    lo = 0
    hi = seqlen_k
    if MASK_LEFT:
        lo = tl.maximum(row_start + diagonal - window_left, 0) // BLOCK_N * BLOCK_N
    if MASK_RIGHT:
        hi = tl.minimum(row_end + diagonal + window_right, seqlen_k)
    return lo, hi


@triton.jit
def key_runs(row_start, row_end, diagonal, seqlen_k, window_left, window_right,
             MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr, BLOCK_N: tl.constexpr):
    """The key blocks that queries [row_start, row_end) see, as three runs of BLOCK_N-wide blocks
    from ``lo``: ``(lo, full_lo, full_hi, hi)`` with [lo, hi) as :func:`key_range`, and
    [full_lo, full_hi) the blocks that every query sees whole — in bounds and inside the window —
    so that they need no mask. [lo, full_lo) and [full_hi, hi) are the masked edges."""
    lo, hi = key_range(row_start, row_end, diagonal, seqlen_k, window_left, window_right,
                       MASK_LEFT, MASK_RIGHT, BLOCK_N)
    full_lo = lo
    limit = seqlen_k
    if MASK_LEFT:
        # the last row's window starts at row_end − 1 + diagonal − left: round up to a block
        first = row_end - 1 + diagonal - window_left
        full_lo = tl.maximum(lo, (first + BLOCK_N - 1) // BLOCK_N * BLOCK_N)
    if MASK_RIGHT:
        # the first row's window ends at row_start + diagonal + right
        limit = tl.minimum(limit, row_start + diagonal + window_right + 1)
    full_lo = tl.minimum(full_lo, hi)
    full_hi = lo + tl.maximum(limit - lo, 0) // BLOCK_N * BLOCK_N
    full_hi = tl.minimum(tl.maximum(full_hi, full_lo), hi)
    return lo, full_lo, full_hi, hi


@triton.jit
def query_range(col_start, col_end, diagonal, seqlen_q, window_left, window_right,
                 MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr, BLOCK_M: tl.constexpr):
    """[lo, hi) of the queries that see any of keys [col_start, col_end); lo a multiple of BLOCK_M."""
    lo = 0
    hi = seqlen_q
    if MASK_RIGHT:
        lo = tl.maximum(col_start - diagonal - window_right, 0) // BLOCK_M * BLOCK_M
    if MASK_LEFT:
        hi = tl.minimum(col_end - diagonal + window_left, seqlen_q)
    return lo, hi


@triton.jit
def query_runs(col_start, col_end, diagonal, seqlen_q, window_left, window_right,
               MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr, BLOCK_M: tl.constexpr):
    """The query blocks that see keys [col_start, col_end) (col_end ≤ seqlen_k), as three runs of
    BLOCK_M-high blocks from ``lo``: ``(lo, full_lo, full_hi, hi)`` with [lo, hi) as
    :func:`query_range`, and [full_lo, full_hi) the blocks that are in bounds and see every key
    inside the window, so that they need no mask. Keys past seqlen_k in a ragged last K block
    need none either: each key's dK/dV row is computed apart from the others and never stored."""
    lo, hi = query_range(col_start, col_end, diagonal, seqlen_q, window_left, window_right,
                         MASK_LEFT, MASK_RIGHT, BLOCK_M)
    full_lo = lo
    limit = seqlen_q
    if MASK_RIGHT:
        # the last key is seen from row col_end − 1 − diagonal − right on: round up to a block
        first = col_end - 1 - diagonal - window_right
        full_lo = tl.maximum(lo, (first + BLOCK_M - 1) // BLOCK_M * BLOCK_M)
    if MASK_LEFT:
        # the first key is seen up to row col_start − diagonal + left
        limit = tl.minimum(limit, col_start - diagonal + window_left + 1)
    full_lo = tl.minimum(full_lo, hi)
    full_hi = lo + tl.maximum(limit - lo, 0) // BLOCK_M * BLOCK_M
    full_hi = tl.minimum(tl.maximum(full_hi, full_lo), hi)
    return lo, full_lo, full_hi, hi


@triton.jit
def run_bounds(RUN: tl.constexpr, lo, full_lo, full_hi, hi):
    """[start, end) of run ``RUN`` of :func:`key_runs` / :func:`query_runs`: 0 the masked near
    edge, 1 the whole blocks (no mask), 2 the masked far edge. Kernels walk the three in a
    ``tl.static_range(3)`` loop with ``APPLY_MASK = RUN != 1``."""
    start = lo
    end = full_lo
    if RUN == 1:
        start = full_lo
        end = full_hi
    if RUN == 2:
        start = full_hi
        end = hi
    return start, end


@triton.jit
def widen(stride, WIDE: tl.constexpr):
    """``stride`` as a 64-bit integer when ``WIDE`` (a tensor of the call spans more than 2³¹ elements),
    so that every offset formed with it is 64-bit; else as it is (the common path compiles unchanged)."""
    if WIDE:
        wide = tl.cast(stride, tl.int64)
    else:
        wide = stride
    return wide


@triton.jit
def initial_softmax_state(Sinks, head, HAS_SINK: tl.constexpr, BLOCK_M: tl.constexpr):
    """(m, ℓ) [BLOCK_M] of the online softmax before the first key: −inf and 0, or with a learnable
    sink (a logit that joins the denominator and has no value) its base-2 logit and 1, as if it were
    a first key whose value is 0. ``head``: a scalar or a [BLOCK_M] vector of query heads."""
    if HAS_SINK:
        sink_log2 = tl.load(Sinks + head) * 1.4426950408889634  # * log2(e): the running max is in base 2
        m_i = tl.zeros([BLOCK_M], dtype=tl.float32) + sink_log2
        l_i = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    return m_i, l_i


@triton.jit
def normalise(acc, l_i, m_i):
    """The online softmax's end: (out = acc / ℓ, natural-log lse = (m + log2 ℓ) · ln 2) from the
    base-2 running state, with out 0 and lse −inf on a row that saw no key (ℓ = 0). ``log2`` takes
    ℓ = 1 there: the interpreter evaluates both sides of ``tl.where``, and log2(0) would warn."""
    seen = l_i > 0.0
    l_safe = tl.where(seen, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse = tl.where(seen, (m_i + tl.math.log2(l_safe)) * 0.6931471805599453, float("-inf"))  # * ln 2
    return out, lse


@triton.jit
def dropout_keep(seed, rows, cols, i_seq_head, dropout_p):
    """Whether P[rows, cols] of this (sequence, head) survives dropout (rows, cols broadcast).

    Philox counter (j, i, sequence·nheads + head, 0), first output word mapped to
    [0, 1) as ``tl.rand`` does; kept iff u ≥ p.
    """
    zeros = rows * 0 + cols * 0
    c0 = (zeros + cols).to(tl.uint32)
    c1 = (zeros + rows).to(tl.uint32)
    c2 = (zeros + i_seq_head).to(tl.uint32)
    r, _, _, _ = tl.random.philox(seed, c0, c1, c2, zeros.to(tl.uint32))
    return tl.random.uint_to_uniform_float(r) >= dropout_p
