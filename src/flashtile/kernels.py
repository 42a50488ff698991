"""FlashAttention forward and backward in Triton, and the launchers that return tensors.

Algorithm (FlashAttention-2 ordering, mirrored by ``flashtile.reference``):

* forward, one program per (Q block, head, batch): walk the K/V blocks the Q
  block can see with an online softmax in base 2 (``log2 e`` is folded into the
  scale so the inner loop uses ``exp2``), rescale the running sum and the
  unnormalised output by ``exp2(m_old − m_new)``, divide by ``ℓ`` once, and
  write O and the log-sum-exp ``L = (m + log2 ℓ) · ln 2`` — **natural log**, float32;
* backward preprocess: ``D_i = rowsum(dO_i ∘ O_i)`` in float32;
* backward dK/dV, one program per (K block, KV head, batch): loop over the query
  heads of its GQA group and over the Q blocks that see it, recompute
  ``Pᵀ = exp2(S·log2 e − L·log2 e)``; ``dV += Pᵀ dO``,
  ``dK += scale · dSᵀ Q`` with ``dS = P ∘ (dP − D)``; it also writes dS itself
  as the gradient of an additive bias;
* backward dQ, one program per (Q block, head, batch): ``dQ += scale · dS K``.

Variants are constexpr switches, so the plain path compiles without them (the
score pipeline and block ranges are in ``flashtile.scores``): sliding window and
causal (``MASK_LEFT``/``MASK_RIGHT``; blocks outside the window are skipped),
softcap, ALiBi, an additive bias, dropout on P (Philox; the backward regenerates
the mask), and variable-length batches (``IS_VARLEN``: sequences packed along
one token axis, located through ``cu_seqlens``; the grid covers the longest).

No atomics anywhere: every output element is written by exactly one program,
so the backward is bitwise deterministic run to run.

Loads: the forward moves its Q, K, V and O tiles with Hopper's tensor copy engine (TMA, through
4-D tensor descriptors over [batch, seqlen, nheads, head_dim]: rows past a sequence's end and
padded head dims arrive as zeros, stores are clipped) when the batch is not packed, the strides
allow it and seqlen ≥ ``TMA_MIN_SEQLEN``; otherwise, and in the backward, masked pointer loads
(descriptors measured slower there on the H200: benchmarks/NOTES.md, v0.4).

Conventions: tensors in (batch, seqlen, nheads, headdim), or (total, nheads,
headdim) when packed, with arbitrary strides; query head ``h`` uses KV head
``h // (nheads_q // nheads_k)``; causal masking is aligned to the bottom-right
corner (query ``i`` sees key ``j`` iff ``j ≤ i + seqlen_k − seqlen_q``), per
sequence; a row that sees no key gets output 0 and log-sum-exp −inf. The
log-sum-exp is (batch, nheads, seqlen_q), or (nheads, total_q) when packed.
Head dims 1..256 are padded inside to a power of two ≥ 16 (masked loads; the
user never pads). float32 inputs use IEEE float32 dots. Grids are (blocks, heads,
batch): batch and heads may each reach CUDA's 65535 on those axes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from . import hopper
from ._host import cdiv, cuda_properties, next_power_of_2
from .scores import (
    _dropout_keep,
    _key_range,
    _masked_scores_log2,
    _query_range,
    _tanh,
    _unmasked_key_range,
    _unmasked_query_range,
)

if os.environ.get("TRITON_INTERPRET") == "1":
    from ._interpreter import patch_bf16_dot

    patch_bf16_dot()

LOG2E = 1.4426950408889634  # 1 / ln 2; kernels repeat it as a literal (no globals in @jit)


@triton.jit
def _sequence_bounds(i_b, CuSeqlens, seqlen, IS_VARLEN: tl.constexpr):
    """(first token, length) of sequence ``i_b``: packed through cu_seqlens, or the whole axis."""
    if IS_VARLEN:
        start = tl.load(CuSeqlens + i_b)
        return start, tl.load(CuSeqlens + i_b + 1) - start
    return 0, seqlen


@triton.jit
def _load_rows(ptrs, m_rows, m_d, APPLY_MASK: tl.constexpr, EVEN_D: tl.constexpr):
    """A [rows, BLOCK_D] tile: masked by row bounds in masked blocks, by head dim only where padded."""
    if APPLY_MASK:
        return tl.load(ptrs, mask=m_rows[:, None] & m_d[None, :], other=0.0)
    if EVEN_D:
        return tl.load(ptrs)
    return tl.load(ptrs, mask=m_d[None, :], other=0.0)


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
def _attn_fwd_inner(
    acc, l_i, m_i, b_q, k_src, v_src, bias_base, seed, lo, hi,
    o_m, o_n, o_d, m_m, m_d, i_b, i_hk, i_bh, diagonal, seqlen_k,
    stride_ks, stride_kd, stride_vs, stride_vd, stride_bm, stride_bn,
    qk_scale, softcap_scale, softcap_log2, alibi_slope_log2, window_left, window_right,
    dropout_p, dropout_scale,
    APPLY_MASK: tl.constexpr, MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_DROPOUT: tl.constexpr, EVEN_D: tl.constexpr,
    USE_TMA: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Online softmax over K/V blocks [lo, hi). ``APPLY_MASK`` is off for the blocks that
    every row sees whole (in bounds, inside the window): they need no bounds or mask work."""
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + o_n
        m_n = cols < seqlen_k
        b_k = _load_block(k_src, i_b, i_hk, start_n, cols, m_n, o_d, m_d, stride_ks, stride_kd,
                          APPLY_MASK, EVEN_D, USE_TMA, BLOCK_N, BLOCK_D)  # [BLOCK_N, BLOCK_D]
        b_v = _load_block(v_src, i_b, i_hk, start_n, cols, m_n, o_d, m_d, stride_vs, stride_vd,
                          APPLY_MASK, EVEN_D, USE_TMA, BLOCK_N, BLOCK_D)  # [BLOCK_N, BLOCK_D]
        qk = tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N]
        s = _masked_scores_log2(
            qk, o_m[:, None], cols[None, :], m_m[:, None], m_n[None, :], diagonal,
            bias_base + o_m[:, None] * stride_bm + cols[None, :] * stride_bn,
            qk_scale, softcap_scale, softcap_log2, alibi_slope_log2, window_left, window_right,
            APPLY_MASK, MASK_LEFT, MASK_RIGHT, HAS_SOFTCAP, HAS_ALIBI, HAS_BIAS,
        )
        # -- update m_i and l_i; a row with no visible key yet keeps m = -inf,
        #    so exponentiate against 0 instead to avoid (-inf) - (-inf)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_safe[:, None])  # [BLOCK_M, BLOCK_N]
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)  # the normaliser counts dropped entries too
        if HAS_DROPOUT:
            keep = _dropout_keep(seed, o_m[:, None], cols[None, :], i_bh, dropout_p)
            p = tl.where(keep, p * dropout_scale, 0.0)
        # -- rescale the unnormalised output and add this block
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(b_v.dtype), b_v, acc, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _attn_fwd_kernel(
    Q, K, V, Out, Lse, Bias, AlibiSlopes, Seed, CuSeqlensQ, CuSeqlensK,
    stride_qb, stride_qs, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_ob, stride_os, stride_oh, stride_od,
    stride_lb, stride_lh,
    stride_bb, stride_bh, stride_bm, stride_bn,
    stride_ab,
    nheads_q, group_size, seqlen_q, seqlen_k,
    qk_scale, softcap_scale, softcap_log2, window_left, window_right, dropout_p,
    MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_DROPOUT: tl.constexpr, IS_VARLEN: tl.constexpr,
    USE_TMA: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """``USE_TMA``: Q, K, V and Out are tensor descriptors (not packed), else pointers."""
    i_m = tl.program_id(0)
    i_hq = tl.program_id(1)
    i_b = tl.program_id(2)
    i_bh = i_b * nheads_q + i_hq
    i_hk = i_hq // group_size
    q_start, seqlen_q = _sequence_bounds(i_b, CuSeqlensQ, seqlen_q, IS_VARLEN)
    k_start, seqlen_k = _sequence_bounds(i_b, CuSeqlensK, seqlen_k, IS_VARLEN)
    if i_m * BLOCK_M >= seqlen_q:
        return  # a packed sequence shorter than the longest

    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    o_n = tl.arange(0, BLOCK_N)
    o_d = tl.arange(0, BLOCK_D)
    m_m = o_m < seqlen_q
    m_d = o_d < HEAD_DIM

    if USE_TMA:
        k_src = K
        v_src = V
        b_q = Q.load([i_b, i_m * BLOCK_M, i_hq, 0]).reshape(BLOCK_M, BLOCK_D)
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
    row_end = tl.minimum(row_start + BLOCK_M, seqlen_q)
    lo, hi = _key_range(row_start, row_end, diagonal, seqlen_k, window_left, window_right,
                        MASK_LEFT, MASK_RIGHT, BLOCK_N)
    full_lo, full_hi = _unmasked_key_range(row_start, row_end, diagonal, seqlen_k, lo, hi,
                                           window_left, window_right, MASK_LEFT, MASK_RIGHT, BLOCK_N)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    # the key blocks in three runs: masked left edge, whole blocks, masked right edge (diagonal)
    for run in tl.static_range(3):
        run_lo = lo if run == 0 else full_lo if run == 1 else full_hi
        run_hi = full_lo if run == 0 else full_hi if run == 1 else hi
        acc, l_i, m_i = _attn_fwd_inner(
            acc, l_i, m_i, b_q, k_src, v_src, bias_base, seed, run_lo, run_hi,
            o_m, o_n, o_d, m_m, m_d, i_b, i_hk, i_bh, diagonal, seqlen_k,
            stride_ks, stride_kd, stride_vs, stride_vd, stride_bm, stride_bn,
            qk_scale, softcap_scale, softcap_log2, alibi_slope_log2, window_left, window_right,
            dropout_p, dropout_scale,
            run != 1, MASK_LEFT, MASK_RIGHT, HAS_SOFTCAP, HAS_ALIBI, HAS_BIAS, HAS_DROPOUT, HEAD_DIM == BLOCK_D,
            USE_TMA, BLOCK_N, BLOCK_D, DOT_PRECISION,
        )

    seen = l_i > 0.0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, (m_i + tl.math.log2(l_i)) * 0.6931471805599453, float("-inf"))  # * ln 2
    if USE_TMA:
        # the copy engine clips rows past seqlen_q and the padded head dims
        Out.store([i_b, i_m * BLOCK_M, i_hq, 0], out.to(Out.dtype).reshape(1, BLOCK_M, 1, BLOCK_D))
    else:
        p_o = (Out + i_b * stride_ob + q_start * stride_os + i_hq * stride_oh
               + o_m[:, None] * stride_os + o_d[None, :] * stride_od)
        tl.store(p_o, out.to(Out.dtype.element_ty), mask=m_m[:, None] & m_d[None, :])
    tl.store(Lse + i_b * stride_lb + i_hq * stride_lh + q_start + o_m, lse, mask=m_m)


@triton.jit
def _attn_bwd_preprocess_kernel(
    Out, DOut, Delta, CuSeqlensQ,
    stride_ob, stride_os, stride_oh, stride_od,
    stride_dob, stride_dos, stride_doh, stride_dod,
    stride_lb, stride_lh,
    seqlen_q,
    IS_VARLEN: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
):
    i_m = tl.program_id(0)
    i_h = tl.program_id(1)
    i_b = tl.program_id(2)
    q_start, seqlen_q = _sequence_bounds(i_b, CuSeqlensQ, seqlen_q, IS_VARLEN)
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    o_d = tl.arange(0, BLOCK_D)
    m_m = o_m < seqlen_q
    mask = m_m[:, None] & (o_d < HEAD_DIM)[None, :]
    rows = q_start + o_m
    b_o = tl.load(Out + i_b * stride_ob + i_h * stride_oh + rows[:, None] * stride_os + o_d[None, :] * stride_od,
                  mask=mask, other=0.0).to(tl.float32)  # [BLOCK_M, BLOCK_D]
    b_do = tl.load(DOut + i_b * stride_dob + i_h * stride_doh + rows[:, None] * stride_dos + o_d[None, :] * stride_dod,
                   mask=mask, other=0.0).to(tl.float32)  # [BLOCK_M, BLOCK_D]
    # D_i = rowsum(dO_i ∘ O_i); Delta has the log-sum-exp's layout
    tl.store(Delta + i_b * stride_lb + i_h * stride_lh + rows, tl.sum(b_o * b_do, 1), mask=m_m)


@triton.jit
def _attn_bwd_dkdv_inner(
    b_dk, b_dv, b_k, b_v, q_base, do_base, lse_base, delta_base, bias_base, dbias_base, seed, lo, hi,
    o_m, o_n, o_d, m_n, m_d, i_bhq, diagonal, seqlen_q, seqlen_k,
    stride_qs, stride_qd, stride_dos, stride_dod, stride_bm, stride_bn,
    qk_scale, softcap_scale, softcap_log2, alibi_slope_log2, window_left, window_right,
    dropout_p, dropout_scale,
    APPLY_MASK: tl.constexpr, MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr, HAS_BIAS: tl.constexpr, BIAS_GRAD: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    EVEN_D: tl.constexpr, BLOCK_M: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """dK, dV of one K block over Q blocks [lo, hi) of one query head (Kᵀ-major blocks).
    ``APPLY_MASK`` is off for Q blocks that see the whole K block (in bounds, inside the window)."""
    for start_m in range(lo, hi, BLOCK_M):
        rows = start_m + o_m
        m_m = rows < seqlen_q
        b_q = _load_rows(q_base + rows[:, None] * stride_qs + o_d[None, :] * stride_qd, m_m, m_d,
                         APPLY_MASK, EVEN_D)  # [BLOCK_M, BLOCK_D]
        b_do = _load_rows(do_base + rows[:, None] * stride_dos + o_d[None, :] * stride_dod, m_m, m_d,
                          APPLY_MASK, EVEN_D)  # [BLOCK_M, BLOCK_D]
        if APPLY_MASK:
            b_lse = tl.load(lse_base + rows, mask=m_m, other=0.0)  # [BLOCK_M]
            b_delta = tl.load(delta_base + rows, mask=m_m, other=0.0)  # [BLOCK_M]
        else:
            b_lse = tl.load(lse_base + rows)
            b_delta = tl.load(delta_base + rows)
        # rows that saw no key have lse = -inf: exp2(s - inf) = 0
        lse2 = tl.where(b_lse == float("-inf"), float("inf"), b_lse * 1.4426950408889634)
        qk_t = tl.dot(b_k, tl.trans(b_q), input_precision=DOT_PRECISION)  # [BLOCK_N, BLOCK_M]
        s_t = _masked_scores_log2(
            qk_t, rows[None, :], o_n[:, None], m_m[None, :], m_n[:, None], diagonal,
            bias_base + rows[None, :] * stride_bm + o_n[:, None] * stride_bn,
            qk_scale, softcap_scale, softcap_log2, alibi_slope_log2, window_left, window_right,
            APPLY_MASK, MASK_LEFT, MASK_RIGHT, HAS_SOFTCAP, HAS_ALIBI, HAS_BIAS,
        )
        p_t = tl.math.exp2(s_t - lse2[None, :])  # Pᵀ [BLOCK_N, BLOCK_M]
        dp_t = tl.dot(b_v, tl.trans(b_do), input_precision=DOT_PRECISION)  # dPᵀ [BLOCK_N, BLOCK_M]
        if HAS_DROPOUT:
            # O = (P ∘ Z) V with Z = keep / (1 − p): dV uses P ∘ Z, and dP reaches P through Z
            keep_t = _dropout_keep(seed, rows[None, :], o_n[:, None], i_bhq, dropout_p)
            b_dv = tl.dot(tl.where(keep_t, p_t * dropout_scale, 0.0).to(b_do.dtype), b_do, b_dv,
                          input_precision=DOT_PRECISION)
            dp_t = tl.where(keep_t, dp_t * dropout_scale, 0.0)
        else:
            b_dv = tl.dot(p_t.to(b_do.dtype), b_do, b_dv, input_precision=DOT_PRECISION)
        ds_t = p_t * (dp_t - b_delta[None, :])  # dSᵀ = Pᵀ ∘ (dPᵀ − D), natural-log units
        if BIAS_GRAD:
            tl.store(dbias_base + rows[None, :] * seqlen_k + o_n[:, None], ds_t,
                     mask=m_n[:, None] & m_m[None, :])
        if HAS_SOFTCAP:
            # d(c·tanh(x/c))/dx = 1 − tanh²
            t = _tanh(qk_t * softcap_scale)
            ds_t = ds_t * (1.0 - t * t)
        b_dk = tl.dot(ds_t.to(b_q.dtype), b_q, b_dk, input_precision=DOT_PRECISION)
    return b_dk, b_dv


@triton.jit
def _attn_bwd_dkdv_kernel(
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
    IS_VARLEN: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    i_n = tl.program_id(0)
    i_hk = tl.program_id(1)
    i_b = tl.program_id(2)
    q_start, seqlen_q = _sequence_bounds(i_b, CuSeqlensQ, seqlen_q, IS_VARLEN)
    k_start, seqlen_k = _sequence_bounds(i_b, CuSeqlensK, seqlen_k, IS_VARLEN)
    if i_n * BLOCK_N >= seqlen_k:
        return  # a packed sequence shorter than the longest

    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    o_m = tl.arange(0, BLOCK_M)
    o_d = tl.arange(0, BLOCK_D)
    m_n = o_n < seqlen_k
    m_d = o_d < HEAD_DIM
    mask_nd = m_n[:, None] & m_d[None, :]
    keys = k_start + o_n
    b_k = tl.load(K + i_b * stride_kb + i_hk * stride_kh + keys[:, None] * stride_ks + o_d[None, :] * stride_kd,
                  mask=mask_nd, other=0.0)  # [BLOCK_N, BLOCK_D]
    b_v = tl.load(V + i_b * stride_vb + i_hk * stride_vh + keys[:, None] * stride_vs + o_d[None, :] * stride_vd,
                  mask=mask_nd, other=0.0)  # [BLOCK_N, BLOCK_D]
    b_dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    b_dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    seed, dropout_scale = _dropout_setup(Seed, dropout_p, HAS_DROPOUT)

    diagonal = seqlen_k - seqlen_q
    col_start = i_n * BLOCK_N
    col_end = tl.minimum(col_start + BLOCK_N, seqlen_k)
    lo, hi = _query_range(col_start, col_end, diagonal, seqlen_q, window_left, window_right,
                          MASK_LEFT, MASK_RIGHT, BLOCK_M)
    full_lo, full_hi = _unmasked_query_range(col_start, col_end, diagonal, seqlen_q, seqlen_k, lo, hi,
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
            run_lo = lo if run == 0 else full_lo if run == 1 else full_hi
            run_hi = full_lo if run == 0 else full_hi if run == 1 else hi
            b_dk, b_dv = _attn_bwd_dkdv_inner(
                b_dk, b_dv, b_k, b_v, q_base, do_base, lse_base, delta_base, bias_base, dbias_base, seed,
                run_lo, run_hi, o_m, o_n, o_d, m_n, m_d, i_bhq, diagonal, seqlen_q, seqlen_k,
                stride_qs, stride_qd, stride_dos, stride_dod, stride_bm, stride_bn,
                qk_scale, softcap_scale, softcap_log2, alibi_slope_log2, window_left, window_right,
                dropout_p, dropout_scale,
                run != 1, MASK_LEFT, MASK_RIGHT, HAS_SOFTCAP, HAS_ALIBI, HAS_BIAS, BIAS_GRAD, HAS_DROPOUT,
                HEAD_DIM == BLOCK_D, BLOCK_M, DOT_PRECISION,
            )

    b_dk = b_dk * sm_scale
    tl.store(DK + i_b * stride_dkb + i_hk * stride_dkh + keys[:, None] * stride_dks + o_d[None, :] * stride_dkd,
             b_dk.to(DK.dtype.element_ty), mask=mask_nd)
    tl.store(DV + i_b * stride_dvb + i_hk * stride_dvh + keys[:, None] * stride_dvs + o_d[None, :] * stride_dvd,
             b_dv.to(DV.dtype.element_ty), mask=mask_nd)


@triton.jit
def _attn_bwd_dq_inner(
    b_dq, b_q, b_do, lse2, b_delta, k_base, v_base, bias_base, seed, lo, hi,
    o_m, o_n, o_d, m_m, m_d, i_bh, diagonal, seqlen_k,
    stride_ks, stride_kd, stride_vs, stride_vd, stride_bm, stride_bn,
    qk_scale, softcap_scale, softcap_log2, alibi_slope_log2, window_left, window_right,
    dropout_p, dropout_scale,
    APPLY_MASK: tl.constexpr, MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_DROPOUT: tl.constexpr, EVEN_D: tl.constexpr,
    BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """dQ of one Q block over K blocks [lo, hi); ``APPLY_MASK`` as in :func:`_attn_fwd_inner`."""
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + o_n
        m_n = cols < seqlen_k
        b_k = _load_rows(k_base + cols[:, None] * stride_ks + o_d[None, :] * stride_kd, m_n, m_d,
                         APPLY_MASK, EVEN_D)  # [BLOCK_N, BLOCK_D]
        b_v = _load_rows(v_base + cols[:, None] * stride_vs + o_d[None, :] * stride_vd, m_n, m_d,
                         APPLY_MASK, EVEN_D)  # [BLOCK_N, BLOCK_D]
        qk = tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N]
        s = _masked_scores_log2(
            qk, o_m[:, None], cols[None, :], m_m[:, None], m_n[None, :], diagonal,
            bias_base + o_m[:, None] * stride_bm + cols[None, :] * stride_bn,
            qk_scale, softcap_scale, softcap_log2, alibi_slope_log2, window_left, window_right,
            APPLY_MASK, MASK_LEFT, MASK_RIGHT, HAS_SOFTCAP, HAS_ALIBI, HAS_BIAS,
        )
        p = tl.math.exp2(s - lse2[:, None])  # P_ij = exp(S_ij − L_i)
        dp = tl.dot(b_do, tl.trans(b_v), input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N]
        if HAS_DROPOUT:
            keep = _dropout_keep(seed, o_m[:, None], cols[None, :], i_bh, dropout_p)
            dp = tl.where(keep, dp * dropout_scale, 0.0)
        ds = p * (dp - b_delta[:, None])
        if HAS_SOFTCAP:
            t = _tanh(qk * softcap_scale)
            ds = ds * (1.0 - t * t)
        b_dq = tl.dot(ds.to(b_k.dtype), b_k, b_dq, input_precision=DOT_PRECISION)
    return b_dq


@triton.jit
def _attn_bwd_dq_kernel(
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
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    i_m = tl.program_id(0)
    i_hq = tl.program_id(1)
    i_b = tl.program_id(2)
    i_bh = i_b * nheads_q + i_hq
    i_hk = i_hq // group_size
    q_start, seqlen_q = _sequence_bounds(i_b, CuSeqlensQ, seqlen_q, IS_VARLEN)
    k_start, seqlen_k = _sequence_bounds(i_b, CuSeqlensK, seqlen_k, IS_VARLEN)
    if i_m * BLOCK_M >= seqlen_q:
        return  # a packed sequence shorter than the longest

    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    o_n = tl.arange(0, BLOCK_N)
    o_d = tl.arange(0, BLOCK_D)
    m_m = o_m < seqlen_q
    m_d = o_d < HEAD_DIM
    mask_md = m_m[:, None] & m_d[None, :]
    rows = q_start + o_m
    b_q = tl.load(Q + i_b * stride_qb + i_hq * stride_qh + rows[:, None] * stride_qs + o_d[None, :] * stride_qd,
                  mask=mask_md, other=0.0)  # [BLOCK_M, BLOCK_D]
    b_do = tl.load(DOut + i_b * stride_dob + i_hq * stride_doh + rows[:, None] * stride_dos + o_d[None, :] * stride_dod,
                   mask=mask_md, other=0.0)  # [BLOCK_M, BLOCK_D]
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
    row_end = tl.minimum(row_start + BLOCK_M, seqlen_q)
    lo, hi = _key_range(row_start, row_end, diagonal, seqlen_k, window_left, window_right,
                        MASK_LEFT, MASK_RIGHT, BLOCK_N)
    full_lo, full_hi = _unmasked_key_range(row_start, row_end, diagonal, seqlen_k, lo, hi,
                                           window_left, window_right, MASK_LEFT, MASK_RIGHT, BLOCK_N)

    b_dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for run in tl.static_range(3):
        run_lo = lo if run == 0 else full_lo if run == 1 else full_hi
        run_hi = full_lo if run == 0 else full_hi if run == 1 else hi
        b_dq = _attn_bwd_dq_inner(
            b_dq, b_q, b_do, lse2, b_delta, k_base, v_base, bias_base, seed, run_lo, run_hi,
            o_m, o_n, o_d, m_m, m_d, i_bh, diagonal, seqlen_k,
            stride_ks, stride_kd, stride_vs, stride_vd, stride_bm, stride_bn,
            qk_scale, softcap_scale, softcap_log2, alibi_slope_log2, window_left, window_right,
            dropout_p, dropout_scale,
            run != 1, MASK_LEFT, MASK_RIGHT, HAS_SOFTCAP, HAS_ALIBI, HAS_BIAS, HAS_DROPOUT, HEAD_DIM == BLOCK_D,
            BLOCK_N, DOT_PRECISION,
        )

    b_dq = b_dq * sm_scale
    tl.store(DQ + i_b * stride_dqb + i_hq * stride_dqh + rows[:, None] * stride_dqs + o_d[None, :] * stride_dqd,
             b_dq.to(DQ.dtype.element_ty), mask=mask_md)


# ----------------------------------------------------------------------------------------------
# Launchers


@dataclass(frozen=True)
class Variant:
    """What changes the scores or the layout of one attention call; defaults are the plain path.

    ``window`` is (left, right) with −1 unbounded, causal already folded in as right = 0.
    ``cu_seqlens_q/k`` (int32, batch + 1) mark a packed batch; ``max_seqlen_q/k`` size its grid.
    ``dropout_seed`` is an int64 tensor of one element on the inputs' device.
    """

    window: tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    alibi_slopes: torch.Tensor | None = None
    attn_bias: torch.Tensor | None = None
    dropout_p: float = 0.0
    dropout_seed: torch.Tensor | None = None
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0

    @property
    def is_varlen(self) -> bool:
        return self.cu_seqlens_q is not None


PLAIN = Variant()


def _block_d(head_dim: int) -> int:
    return max(16, next_power_of_2(head_dim))


def _dot_precision(dtype: torch.dtype) -> str:
    # float32 inputs get exact float32 products, as torch.matmul gives them by default.
    return "ieee" if dtype == torch.float32 else "tf32"


# Block shapes (BLOCK_M, BLOCK_N, num_warps, num_stages) for 16-bit inputs, from sweeps on the H200
# (benchmarks/tune_configs.py, bf16, seqlen 8192; benchmarks/NOTES.md has the tables).
_FWD_16BIT = {
    # (largest BLOCK_D, causal, tensor descriptors): config
    (64, False, True): (128, 64, 8, 3), (64, True, True): (128, 64, 4, 3),
    (128, False, True): (128, 128, 8, 3), (128, True, True): (128, 128, 8, 3),
    (256, False, True): (64, 32, 4, 3), (256, True, True): (64, 32, 4, 3),
    # pointer loads (short or packed sequences): causal favours smaller Q blocks there
    (64, False, False): (128, 64, 8, 3), (64, True, False): (64, 64, 4, 3),
    (128, False, False): (128, 128, 8, 3), (128, True, False): (64, 64, 4, 3),
    (256, False, False): (64, 32, 4, 2), (256, True, False): (64, 32, 4, 2),
}
# The backward's two kernels each have their own config: (dK/dV kernel, dQ kernel).
_BWD_16BIT = {
    64: ((64, 64, 4, 3), (64, 64, 4, 3)),
    128: ((64, 64, 4, 2), (64, 64, 4, 2)),
    256: ((32, 32, 4, 2), (64, 32, 4, 1)),
}
# float32 tiles are twice as wide in shared memory: half the blocks (not tuned).
_FWD_32BIT = {64: (128, 32, 4, 3), 128: (128, 32, 8, 2), 256: (64, 16, 4, 2)}
_BWD_32BIT = {
    64: ((64, 32, 4, 2), (64, 32, 4, 2)),
    128: ((32, 32, 8, 2), (32, 32, 8, 2)),
    256: ((16, 16, 4, 1), (16, 16, 4, 1)),
}


def _config(block_m, block_n, num_warps, num_stages) -> dict:
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps, num_stages=num_stages)


def _size_class(block_d: int) -> int:
    return 64 if block_d <= 64 else 128 if block_d <= 128 else 256


def _fwd_config(block_d: int, dtype: torch.dtype, causal: bool, has_bias: bool = False, tma: bool = False) -> dict:
    if dtype == torch.float32:
        return _config(*_FWD_32BIT[_size_class(block_d)])
    block_m, block_n, num_warps, num_stages = _FWD_16BIT[(_size_class(block_d), causal, tma)]
    if has_bias:
        # the pipelined [BLOCK_M, BLOCK_N] bias tiles must fit beside K and V in shared memory:
        # (128, 128, 8, 3) at hdim 128 asked for 288 KiB of the H200's 227 KiB
        block_n = min(block_n, 64)
    return _config(block_m, block_n, num_warps, num_stages)


def _bwd_configs(block_d: int, dtype: torch.dtype, causal: bool) -> tuple[dict, dict]:
    """(dK/dV kernel config, dQ kernel config)."""
    table = _BWD_32BIT if dtype == torch.float32 else _BWD_16BIT
    dkdv, dq = table[_size_class(block_d)]
    return _config(*dkdv), _config(*dq)


INT32_MAX = 2**31 - 1
# On the H200, descriptor loads (with their configs) beat pointer loads at seqlen 4096-16384 in every
# standard case, and lost at 512-2048 in some (benchmarks/NOTES.md, v0.4).
TMA_MIN_SEQLEN = 4096
# (head dim, causal): the seqlen from which the Gluon forward (flashtile.hopper) beat the Triton one on
# the H200: at head dim 128 everywhere (1.1-1.4x), at 64 from 2048 (causal 8192) on (NOTES.md, v0.5).
GLUON_MIN_SEQLEN = {(128, False): 1, (128, True): 1, (64, False): 2048, (64, True): 8192}


def _check_offsets(**tensors) -> None:
    """The kernels index elements with 32-bit offsets: refuse a tensor that spans more."""
    for name, t in tensors.items():
        if t is None or t.numel() == 0:
            continue
        extent = 1 + sum((size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride()))
        if extent > INT32_MAX:
            raise ValueError(
                f"{name} of shape {tuple(t.shape)} spans {extent} elements; flashtile's kernels index with "
                f"32-bit offsets (at most {INT32_MAX}): split the batch or the heads into several calls"
            )


def _descriptor_compatible(*tensors: torch.Tensor) -> bool:
    """Whether the copy engine can move tiles of these tensors: a contiguous head dim and positive
    16-byte-aligned strides and bases."""
    return all(
        t.stride(-1) == 1 and t.data_ptr() % 16 == 0
        and all(s > 0 and s * t.element_size() % 16 == 0 for s in t.stride()[:-1])
        for t in tensors
    )


def _tma_usable(variant: Variant, seqlen_q: int, seqlen_k: int, *tensors: torch.Tensor) -> bool:
    """Whether the forward loads its tiles through tensor descriptors. They need Hopper's copy
    engine (or the interpreter), one sequence per batch row (not packed) and descriptor-compatible
    tensors; and they pay off only from ``TMA_MIN_SEQLEN`` on (benchmarks/NOTES.md, v0.4)."""
    if variant.is_varlen or min(seqlen_q, seqlen_k) < TMA_MIN_SEQLEN:
        return False
    device = tensors[0].device
    if device.type == "cuda":
        if cuda_properties(device).major < 9:
            return False
    elif os.environ.get("TRITON_INTERPRET") != "1":
        return False
    return _descriptor_compatible(*tensors)


def _is_sm90(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    properties = cuda_properties(device)
    return (properties.major, properties.minor) == (9, 0)


def _gluon_usable(variant: Variant, softmax_scale: float, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the forward runs ``flashtile.hopper``'s Gluon kernel: on an sm_90 GPU, for plain full
    or causal attention in 16 bits at a head dim it has, with a positive softmax scale (it masks raw
    scores before scaling them), from ``GLUON_MIN_SEQLEN[head_dim, causal]`` on."""
    head_dim, seqlen, causal = q.shape[-1], min(q.shape[1], k.shape[1]), variant.window == (-1, 0)
    plain = (variant.window in ((-1, -1), (-1, 0)) and variant.softcap == 0 and variant.alibi_slopes is None
             and variant.attn_bias is None and variant.dropout_p == 0 and not variant.is_varlen)
    return (plain and softmax_scale > 0 and q.dtype in (torch.float16, torch.bfloat16)
            and q.numel() > 0 and k.numel() > 0
            and seqlen >= GLUON_MIN_SEQLEN.get((head_dim, causal), INT32_MAX) and _is_sm90(q.device)
            and _descriptor_compatible(q, k, v))


def _descriptor(t: torch.Tensor, rows: int, block_d: int) -> TensorDescriptor:
    """A descriptor over [batch, seqlen, nheads, head_dim] that moves [1, rows, 1, block_d] boxes."""
    return TensorDescriptor(t, list(t.shape), list(t.stride()), [1, rows, 1, block_d])


def _strides4(t: torch.Tensor):
    """(batch, seq, head, dim) strides; a packed (total, head, dim) tensor has batch stride 0."""
    if t.dim() == 3:
        return 0, t.stride(0), t.stride(1), t.stride(2)
    return t.stride(0), t.stride(1), t.stride(2), t.stride(3)


def _shape(q, k, variant: Variant):
    """(batch, seqlen_q, seqlen_k, nheads_q, nheads_k, head_dim); seqlens are the grid's maxima."""
    if variant.is_varlen:
        return (variant.cu_seqlens_q.numel() - 1, variant.max_seqlen_q, variant.max_seqlen_k,
                q.shape[1], k.shape[1], q.shape[2])
    return q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2], q.shape[3]


def _lse_empty(q, batch, nheads_q, seqlen_q, variant: Variant):
    if variant.is_varlen:
        return torch.empty((nheads_q, q.shape[0]), dtype=torch.float32, device=q.device)
    return torch.empty((batch, nheads_q, seqlen_q), dtype=torch.float32, device=q.device)


def _lse_strides(lse: torch.Tensor):
    """(batch, head) strides of the log-sum-exp; the token stride is 1 in both layouts."""
    return (0, lse.stride(0)) if lse.dim() == 2 else (lse.stride(0), lse.stride(1))


def _variant_args(variant: Variant, softmax_scale: float, q: torch.Tensor, shape):
    """Pointers, strides, scalars and constexprs shared by the three kernels."""
    batch, seqlen_q, seqlen_k, nheads_q, _, _ = shape
    bias = variant.attn_bias
    if bias is not None:
        bias = bias.expand(batch, nheads_q, seqlen_q, seqlen_k)  # a view: broadcast dims get stride 0
    slopes = variant.alibi_slopes
    softcap = variant.softcap
    left, right = variant.window
    pointers = dict(
        Bias=bias if bias is not None else q, AlibiSlopes=slopes if slopes is not None else q,
        Seed=variant.dropout_seed if variant.dropout_seed is not None else q,
        CuSeqlensQ=variant.cu_seqlens_q if variant.is_varlen else q,
        CuSeqlensK=variant.cu_seqlens_k if variant.is_varlen else q,
    )
    strides = dict(
        stride_bb=bias.stride(0) if bias is not None else 0, stride_bh=bias.stride(1) if bias is not None else 0,
        stride_bm=bias.stride(2) if bias is not None else 0, stride_bn=bias.stride(3) if bias is not None else 0,
        stride_ab=slopes.stride(0) if slopes is not None and slopes.dim() == 2 else 0,
    )
    scalars = dict(
        qk_scale=softmax_scale * LOG2E,
        softcap_scale=softmax_scale / softcap if softcap > 0 else 1.0,
        softcap_log2=softcap * LOG2E,
        window_left=left, window_right=right, dropout_p=variant.dropout_p,
    )
    constexprs = dict(
        MASK_LEFT=left >= 0, MASK_RIGHT=right >= 0, HAS_SOFTCAP=softcap > 0, HAS_ALIBI=slopes is not None,
        HAS_BIAS=bias is not None, HAS_DROPOUT=variant.dropout_p > 0, IS_VARLEN=variant.is_varlen,
        DOT_PRECISION=_dot_precision(q.dtype),
    )
    return pointers, strides, scalars, constexprs


def flash_attn_forward(q, k, v, softmax_scale: float, variant: Variant = PLAIN):
    """q [B, Nq, Hq, D], k/v [B, Nk, Hk, D] (any strides), or packed [total, H, D] with
    ``variant.cu_seqlens_*`` → (out like q, lse [B, Hq, Nq] or [Hq, total_q], float32)."""
    _check_offsets(q=q, k=k, v=v, attn_bias=variant.attn_bias)
    if _gluon_usable(variant, softmax_scale, q, k, v):
        return hopper.flash_attn_forward_sm90(q, k, v, softmax_scale * LOG2E, causal=variant.window == (-1, 0))
    shape = _shape(q, k, variant)
    batch, seqlen_q, seqlen_k, nheads_q, nheads_k, head_dim = shape
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = _lse_empty(q, batch, nheads_q, seqlen_q, variant)
    block_d = _block_d(head_dim)
    use_tma = _tma_usable(variant, seqlen_q, seqlen_k, q, k, v, out)
    cfg = _fwd_config(block_d, q.dtype, variant.window[1] >= 0, variant.attn_bias is not None, use_tma)
    pointers, strides, scalars, constexprs = _variant_args(variant, softmax_scale, q, shape)
    tiles = (q, k, v, out)
    if use_tma:
        tiles = (_descriptor(q, cfg["BLOCK_M"], block_d), _descriptor(k, cfg["BLOCK_N"], block_d),
                 _descriptor(v, cfg["BLOCK_N"], block_d), _descriptor(out, cfg["BLOCK_M"], block_d))
    grid = (cdiv(seqlen_q, cfg["BLOCK_M"]), nheads_q, batch)
    _attn_fwd_kernel[grid](
        *tiles, lse, *pointers.values(),
        *_strides4(q), *_strides4(k), *_strides4(v), *_strides4(out), *_lse_strides(lse),
        *strides.values(),
        nheads_q, nheads_q // nheads_k, seqlen_q, seqlen_k, *scalars.values(),
        **constexprs, USE_TMA=use_tma, HEAD_DIM=head_dim, BLOCK_D=block_d, **cfg,
    )
    return out, lse


def flash_attn_backward(dout, q, k, v, out, lse, softmax_scale: float, variant: Variant = PLAIN,
                        dq=None, dk=None, dv=None, bias_grad: bool = False):
    """Gradients (dq, dk, dv, dbias) of :func:`flash_attn_forward`; deterministic (no atomics).

    ``dq``/``dk``/``dv`` may be given as (possibly strided) buffers to write into, such as the
    slices of a packed gradient. ``dbias`` is the bias gradient reduced to the bias's shape
    when ``bias_grad``, else None.
    """
    shape = _shape(q, k, variant)
    batch, seqlen_q, seqlen_k, nheads_q, nheads_k, head_dim = shape
    lse = lse.contiguous()  # D takes the log-sum-exp's strides: a strided slice would misplace it
    block_d = _block_d(head_dim)
    dkdv_cfg, dq_cfg = _bwd_configs(block_d, q.dtype, variant.window[1] >= 0)
    pointers, strides, scalars, constexprs = _variant_args(variant, softmax_scale, q, shape)

    delta = torch.empty_like(lse)
    _attn_bwd_preprocess_kernel[(cdiv(seqlen_q, 64), nheads_q, batch)](
        out, dout, delta, pointers["CuSeqlensQ"], *_strides4(out), *_strides4(dout), *_lse_strides(lse),
        seqlen_q, IS_VARLEN=variant.is_varlen, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=64,
    )

    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device) if dq is None else dq
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device) if dk is None else dk
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device) if dv is None else dv
    dbias = None
    if bias_grad:
        if batch * nheads_q * seqlen_q * seqlen_k > INT32_MAX:
            raise ValueError(f"the bias gradient (batch, nheads, seqlen_q, seqlen_k) = "
                             f"{(batch, nheads_q, seqlen_q, seqlen_k)} exceeds 32-bit offsets")
        # zeros: entries in blocks that the window skips are never written
        dbias = torch.zeros((batch, nheads_q, seqlen_q, seqlen_k), dtype=torch.float32, device=q.device)
    common = dict(**constexprs, HEAD_DIM=head_dim, BLOCK_D=block_d)
    _attn_bwd_dkdv_kernel[(cdiv(seqlen_k, dkdv_cfg["BLOCK_N"]), nheads_k, batch)](
        q, k, v, dout, lse, delta, dk, dv, dbias if dbias is not None else q, *pointers.values(),
        *_strides4(q), *_strides4(k), *_strides4(v), *_strides4(dout), *_strides4(dk), *_strides4(dv),
        *_lse_strides(lse), *strides.values(),
        nheads_q, nheads_q // nheads_k, seqlen_q, seqlen_k, softmax_scale, *scalars.values(),
        BIAS_GRAD=bias_grad, **common, **dkdv_cfg,
    )
    _attn_bwd_dq_kernel[(cdiv(seqlen_q, dq_cfg["BLOCK_M"]), nheads_q, batch)](
        q, k, v, dout, lse, delta, dq, *pointers.values(),
        *_strides4(q), *_strides4(k), *_strides4(v), *_strides4(dout), *_strides4(dq),
        *_lse_strides(lse), *strides.values(),
        nheads_q, nheads_q // nheads_k, seqlen_q, seqlen_k, softmax_scale, *scalars.values(),
        **common, **dq_cfg,
    )
    if dbias is not None:
        dbias = dbias.sum_to_size(variant.attn_bias.shape).to(variant.attn_bias.dtype)
    return dq, dk, dv, dbias
