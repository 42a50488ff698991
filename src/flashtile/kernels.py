"""FlashAttention forward and backward in Triton, and the launchers that return tensors.

Algorithm (FlashAttention-2 ordering, mirrored by ``flashtile.reference``):

* forward, one program per (Q block, batch·head): walk the visible K/V blocks
  with an online softmax in base 2 (``log2 e`` is folded into the scale so the
  inner loop uses ``exp2``), rescale the running sum and the unnormalised output
  by ``exp2(m_old − m_new)``, divide by ``ℓ`` once, and write O and the
  log-sum-exp ``L = (m + log2 ℓ) · ln 2`` — **natural log**, float32;
* backward preprocess: ``D_i = rowsum(dO_i ∘ O_i)`` in float32;
* backward dK/dV, one program per (K block, batch·KV head): loop over the query
  heads of its GQA group and over the Q blocks that see it, recompute
  ``Pᵀ = exp2(K Qᵀ·scale·log2 e − L·log2 e)``; ``dV += Pᵀ dO``,
  ``dK += scale · dSᵀ Q`` with ``dS = P ∘ (dP − D)``;
* backward dQ, one program per (Q block, batch·head): ``dQ += scale · dS K``.

No atomics anywhere: every output element is written by exactly one program,
so the backward is bitwise deterministic run to run.

Conventions: tensors in (batch, seqlen, nheads, headdim) with arbitrary strides;
query head ``h`` uses KV head ``h // (nheads_q // nheads_k)``; causal masking
is aligned to the bottom-right corner (query ``i`` sees key ``j`` iff
``j ≤ i + seqlen_k − seqlen_q``); a row that sees no key gets output 0 and
log-sum-exp −inf. Head dims 1..256 are padded inside to a power of two ≥ 16
(masked loads; the user never pads). float32 inputs use IEEE float32 dots.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

if os.environ.get("TRITON_INTERPRET") == "1":
    from ._interpreter import patch_bf16_dot

    patch_bf16_dot()

LOG2E = 1.4426950408889634  # 1 / ln 2; kernels repeat it as a literal (no globals in @jit)


@triton.jit
def _attn_fwd_kernel(
    Q, K, V, Out, Lse,
    stride_qb, stride_qs, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_ob, stride_os, stride_oh, stride_od,
    stride_lb, stride_lh,
    nheads_q, group_size, seqlen_q, seqlen_k, qk_scale,
    IS_CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    i_m = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_b = i_bh // nheads_q
    i_hq = i_bh % nheads_q
    i_hk = i_hq // group_size

    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    o_n = tl.arange(0, BLOCK_N)
    o_d = tl.arange(0, BLOCK_D)
    m_m = o_m < seqlen_q
    m_d = o_d < HEAD_DIM

    p_q = Q + i_b * stride_qb + i_hq * stride_qh + o_m[:, None] * stride_qs + o_d[None, :] * stride_qd
    b_q = tl.load(p_q, mask=m_m[:, None] & m_d[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
    k_base = K + i_b * stride_kb + i_hk * stride_kh
    v_base = V + i_b * stride_vb + i_hk * stride_vh

    diagonal = seqlen_k - seqlen_q  # bottom-right causal alignment
    hi = seqlen_k
    if IS_CAUSAL:
        hi = tl.minimum(seqlen_k, (i_m + 1) * BLOCK_M + diagonal)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for start_n in range(0, hi, BLOCK_N):
        cols = start_n + o_n
        m_n = cols < seqlen_k
        b_k = tl.load(k_base + cols[:, None] * stride_ks + o_d[None, :] * stride_kd,
                      mask=m_n[:, None] & m_d[None, :], other=0.0)  # [BLOCK_N, BLOCK_D]
        b_v = tl.load(v_base + cols[:, None] * stride_vs + o_d[None, :] * stride_vd,
                      mask=m_n[:, None] & m_d[None, :], other=0.0)  # [BLOCK_N, BLOCK_D]
        # scores in base 2: s = q·k · scale · log2(e)
        s = tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
        visible = m_n[None, :]
        if IS_CAUSAL:
            visible = visible & (cols[None, :] <= o_m[:, None] + diagonal)
        s = tl.where(visible, s, float("-inf"))
        # -- update m_i and l_i; a row with no visible key yet keeps m = -inf,
        #    so exponentiate against 0 instead to avoid (-inf) - (-inf)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_safe[:, None])  # [BLOCK_M, BLOCK_N]
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        # -- rescale the unnormalised output and add this block
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(b_v.dtype), b_v, acc, input_precision=DOT_PRECISION)
        m_i = m_new

    seen = l_i > 0.0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, (m_i + tl.math.log2(l_i)) * 0.6931471805599453, float("-inf"))  # * ln 2
    p_o = Out + i_b * stride_ob + i_hq * stride_oh + o_m[:, None] * stride_os + o_d[None, :] * stride_od
    tl.store(p_o, out.to(Out.dtype.element_ty), mask=m_m[:, None] & m_d[None, :])
    tl.store(Lse + i_b * stride_lb + i_hq * stride_lh + o_m, lse, mask=m_m)


@triton.jit
def _attn_bwd_preprocess_kernel(
    Out, DOut, Delta,
    stride_ob, stride_os, stride_oh, stride_od,
    stride_dob, stride_dos, stride_doh, stride_dod,
    nheads_q, seqlen_q,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
):
    i_m = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_b = i_bh // nheads_q
    i_h = i_bh % nheads_q
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    o_d = tl.arange(0, BLOCK_D)
    mask = (o_m < seqlen_q)[:, None] & (o_d < HEAD_DIM)[None, :]
    b_o = tl.load(Out + i_b * stride_ob + i_h * stride_oh + o_m[:, None] * stride_os + o_d[None, :] * stride_od,
                  mask=mask, other=0.0).to(tl.float32)  # [BLOCK_M, BLOCK_D]
    b_do = tl.load(DOut + i_b * stride_dob + i_h * stride_doh + o_m[:, None] * stride_dos + o_d[None, :] * stride_dod,
                   mask=mask, other=0.0).to(tl.float32)  # [BLOCK_M, BLOCK_D]
    # D_i = rowsum(dO_i ∘ O_i); Delta is contiguous [batch, nheads_q, seqlen_q]
    tl.store(Delta + i_bh * seqlen_q + o_m, tl.sum(b_o * b_do, 1), mask=o_m < seqlen_q)


@triton.jit
def _attn_bwd_dkdv_kernel(
    Q, K, V, DOut, Lse, Delta, DK, DV,
    stride_qb, stride_qs, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_dob, stride_dos, stride_doh, stride_dod,
    stride_dkb, stride_dks, stride_dkh, stride_dkd,
    stride_dvb, stride_dvs, stride_dvh, stride_dvd,
    stride_lb, stride_lh,
    nheads_q, nheads_k, group_size, seqlen_q, seqlen_k, sm_scale, qk_scale,
    IS_CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    i_n = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_b = i_bh // nheads_k
    i_hk = i_bh % nheads_k

    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    o_m = tl.arange(0, BLOCK_M)
    o_d = tl.arange(0, BLOCK_D)
    m_n = o_n < seqlen_k
    m_d = o_d < HEAD_DIM
    mask_nd = m_n[:, None] & m_d[None, :]
    b_k = tl.load(K + i_b * stride_kb + i_hk * stride_kh + o_n[:, None] * stride_ks + o_d[None, :] * stride_kd,
                  mask=mask_nd, other=0.0)  # [BLOCK_N, BLOCK_D]
    b_v = tl.load(V + i_b * stride_vb + i_hk * stride_vh + o_n[:, None] * stride_vs + o_d[None, :] * stride_vd,
                  mask=mask_nd, other=0.0)  # [BLOCK_N, BLOCK_D]
    b_dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    b_dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)

    diagonal = seqlen_k - seqlen_q
    lo = 0
    if IS_CAUSAL:
        # first query row that sees key i_n * BLOCK_N, rounded down to a block
        lo = (tl.maximum(i_n * BLOCK_N - diagonal, 0) // BLOCK_M) * BLOCK_M

    # The whole GQA group of query heads is summed here: dK/dV need no atomics.
    for g in range(0, group_size):
        i_hq = i_hk * group_size + g
        q_base = Q + i_b * stride_qb + i_hq * stride_qh
        do_base = DOut + i_b * stride_dob + i_hq * stride_doh
        lse_base = Lse + i_b * stride_lb + i_hq * stride_lh
        delta_base = Delta + (i_b * nheads_q + i_hq) * seqlen_q
        for start_m in range(lo, seqlen_q, BLOCK_M):
            rows = start_m + o_m
            m_m = rows < seqlen_q
            mask_md = m_m[:, None] & m_d[None, :]
            b_q = tl.load(q_base + rows[:, None] * stride_qs + o_d[None, :] * stride_qd,
                          mask=mask_md, other=0.0)  # [BLOCK_M, BLOCK_D]
            b_do = tl.load(do_base + rows[:, None] * stride_dos + o_d[None, :] * stride_dod,
                           mask=mask_md, other=0.0)  # [BLOCK_M, BLOCK_D]
            b_lse = tl.load(lse_base + rows, mask=m_m, other=0.0)  # [BLOCK_M]
            b_delta = tl.load(delta_base + rows, mask=m_m, other=0.0)  # [BLOCK_M]
            # rows that saw no key have lse = -inf: exp2(s - inf) = 0
            lse2 = tl.where(b_lse == float("-inf"), float("inf"), b_lse * 1.4426950408889634)
            s_t = tl.dot(b_k, tl.trans(b_q), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_N, BLOCK_M]
            visible = m_n[:, None] & m_m[None, :]
            if IS_CAUSAL:
                visible = visible & (o_n[:, None] <= rows[None, :] + diagonal)
            p_t = tl.where(visible, tl.math.exp2(s_t - lse2[None, :]), 0.0)  # Pᵀ [BLOCK_N, BLOCK_M]
            b_dv = tl.dot(p_t.to(b_do.dtype), b_do, b_dv, input_precision=DOT_PRECISION)
            dp_t = tl.dot(b_v, tl.trans(b_do), input_precision=DOT_PRECISION)  # dPᵀ [BLOCK_N, BLOCK_M]
            ds_t = p_t * (dp_t - b_delta[None, :])  # dSᵀ = Pᵀ ∘ (dPᵀ − D)
            b_dk = tl.dot(ds_t.to(b_q.dtype), b_q, b_dk, input_precision=DOT_PRECISION)

    b_dk = b_dk * sm_scale
    tl.store(DK + i_b * stride_dkb + i_hk * stride_dkh + o_n[:, None] * stride_dks + o_d[None, :] * stride_dkd,
             b_dk.to(DK.dtype.element_ty), mask=mask_nd)
    tl.store(DV + i_b * stride_dvb + i_hk * stride_dvh + o_n[:, None] * stride_dvs + o_d[None, :] * stride_dvd,
             b_dv.to(DV.dtype.element_ty), mask=mask_nd)


@triton.jit
def _attn_bwd_dq_kernel(
    Q, K, V, DOut, Lse, Delta, DQ,
    stride_qb, stride_qs, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_dob, stride_dos, stride_doh, stride_dod,
    stride_dqb, stride_dqs, stride_dqh, stride_dqd,
    stride_lb, stride_lh,
    nheads_q, group_size, seqlen_q, seqlen_k, sm_scale, qk_scale,
    IS_CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    i_m = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_b = i_bh // nheads_q
    i_hq = i_bh % nheads_q
    i_hk = i_hq // group_size

    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    o_n = tl.arange(0, BLOCK_N)
    o_d = tl.arange(0, BLOCK_D)
    m_m = o_m < seqlen_q
    m_d = o_d < HEAD_DIM
    mask_md = m_m[:, None] & m_d[None, :]
    b_q = tl.load(Q + i_b * stride_qb + i_hq * stride_qh + o_m[:, None] * stride_qs + o_d[None, :] * stride_qd,
                  mask=mask_md, other=0.0)  # [BLOCK_M, BLOCK_D]
    b_do = tl.load(DOut + i_b * stride_dob + i_hq * stride_doh + o_m[:, None] * stride_dos + o_d[None, :] * stride_dod,
                   mask=mask_md, other=0.0)  # [BLOCK_M, BLOCK_D]
    b_lse = tl.load(Lse + i_b * stride_lb + i_hq * stride_lh + o_m, mask=m_m, other=0.0)  # [BLOCK_M]
    b_delta = tl.load(Delta + i_bh * seqlen_q + o_m, mask=m_m, other=0.0)  # [BLOCK_M]
    lse2 = tl.where(b_lse == float("-inf"), float("inf"), b_lse * 1.4426950408889634)
    k_base = K + i_b * stride_kb + i_hk * stride_kh
    v_base = V + i_b * stride_vb + i_hk * stride_vh

    diagonal = seqlen_k - seqlen_q
    hi = seqlen_k
    if IS_CAUSAL:
        hi = tl.minimum(seqlen_k, (i_m + 1) * BLOCK_M + diagonal)

    b_dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for start_n in range(0, hi, BLOCK_N):
        cols = start_n + o_n
        m_n = cols < seqlen_k
        b_k = tl.load(k_base + cols[:, None] * stride_ks + o_d[None, :] * stride_kd,
                      mask=m_n[:, None] & m_d[None, :], other=0.0)  # [BLOCK_N, BLOCK_D]
        b_v = tl.load(v_base + cols[:, None] * stride_vs + o_d[None, :] * stride_vd,
                      mask=m_n[:, None] & m_d[None, :], other=0.0)  # [BLOCK_N, BLOCK_D]
        s = tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
        visible = m_m[:, None] & m_n[None, :]
        if IS_CAUSAL:
            visible = visible & (cols[None, :] <= o_m[:, None] + diagonal)
        p = tl.where(visible, tl.math.exp2(s - lse2[:, None]), 0.0)  # P_ij = exp(S_ij − L_i)
        dp = tl.dot(b_do, tl.trans(b_v), input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N]
        ds = p * (dp - b_delta[:, None])
        b_dq = tl.dot(ds.to(b_k.dtype), b_k, b_dq, input_precision=DOT_PRECISION)

    b_dq = b_dq * sm_scale
    tl.store(DQ + i_b * stride_dqb + i_hq * stride_dqh + o_m[:, None] * stride_dqs + o_d[None, :] * stride_dqd,
             b_dq.to(DQ.dtype.element_ty), mask=mask_md)


# ----------------------------------------------------------------------------------------------
# Launchers


def _block_d(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))


def _dot_precision(dtype: torch.dtype) -> str:
    # float32 inputs get exact float32 products, as torch.matmul gives them by default.
    return "ieee" if dtype == torch.float32 else "tf32"


def _fwd_config(block_d: int, dtype: torch.dtype) -> dict:
    """Block shapes for the forward: (BLOCK_M, BLOCK_N, num_warps, num_stages)."""
    wide = dtype == torch.float32
    if block_d <= 64:
        return dict(BLOCK_M=128, BLOCK_N=64 if not wide else 32, num_warps=4, num_stages=3)
    if block_d <= 128:
        return dict(BLOCK_M=128, BLOCK_N=64 if not wide else 32, num_warps=8, num_stages=3 if not wide else 2)
    return dict(BLOCK_M=64, BLOCK_N=32 if not wide else 16, num_warps=4, num_stages=2)


def _bwd_config(block_d: int, dtype: torch.dtype) -> dict:
    wide = dtype == torch.float32
    if block_d <= 64:
        return dict(BLOCK_M=64, BLOCK_N=64 if not wide else 32, num_warps=4, num_stages=2)
    if block_d <= 128:
        return dict(BLOCK_M=64 if not wide else 32, BLOCK_N=64 if not wide else 32, num_warps=8, num_stages=2)
    return dict(BLOCK_M=32 if not wide else 16, BLOCK_N=32 if not wide else 16, num_warps=4, num_stages=1)


def _strides4(t: torch.Tensor):
    return t.stride(0), t.stride(1), t.stride(2), t.stride(3)


def flash_attn_forward(q, k, v, softmax_scale: float, causal: bool):
    """q [B, Nq, Hq, D], k/v [B, Nk, Hk, D] (any strides) → (out [B, Nq, Hq, D], lse [B, Hq, Nq] fp32)."""
    batch, seqlen_q, nheads_q, head_dim = q.shape
    seqlen_k, nheads_k = k.shape[1], k.shape[2]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((batch, nheads_q, seqlen_q), dtype=torch.float32, device=q.device)
    block_d = _block_d(head_dim)
    cfg = _fwd_config(block_d, q.dtype)
    grid = (triton.cdiv(seqlen_q, cfg["BLOCK_M"]), batch * nheads_q)
    _attn_fwd_kernel[grid](
        q, k, v, out, lse,
        *_strides4(q), *_strides4(k), *_strides4(v), *_strides4(out),
        lse.stride(0), lse.stride(1),
        nheads_q, nheads_q // nheads_k, seqlen_q, seqlen_k, softmax_scale * LOG2E,
        IS_CAUSAL=causal, HEAD_DIM=head_dim, BLOCK_D=block_d,
        DOT_PRECISION=_dot_precision(q.dtype), **cfg,
    )
    return out, lse


def flash_attn_backward(dout, q, k, v, out, lse, softmax_scale: float, causal: bool):
    """Gradients (dq, dk, dv) shaped and typed like q, k, v; deterministic (no atomics)."""
    batch, seqlen_q, nheads_q, head_dim = q.shape
    seqlen_k, nheads_k = k.shape[1], k.shape[2]
    group_size = nheads_q // nheads_k
    block_d = _block_d(head_dim)
    cfg = _bwd_config(block_d, q.dtype)
    precision = _dot_precision(q.dtype)

    delta = torch.empty((batch, nheads_q, seqlen_q), dtype=torch.float32, device=q.device)
    _attn_bwd_preprocess_kernel[(triton.cdiv(seqlen_q, 64), batch * nheads_q)](
        out, dout, delta, *_strides4(out), *_strides4(dout), nheads_q, seqlen_q,
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=64,
    )

    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    common = dict(IS_CAUSAL=causal, HEAD_DIM=head_dim, BLOCK_D=block_d, DOT_PRECISION=precision, **cfg)
    _attn_bwd_dkdv_kernel[(triton.cdiv(seqlen_k, cfg["BLOCK_N"]), batch * nheads_k)](
        q, k, v, dout, lse, delta, dk, dv,
        *_strides4(q), *_strides4(k), *_strides4(v), *_strides4(dout), *_strides4(dk), *_strides4(dv),
        lse.stride(0), lse.stride(1),
        nheads_q, nheads_k, group_size, seqlen_q, seqlen_k, softmax_scale, softmax_scale * LOG2E,
        **common,
    )
    _attn_bwd_dq_kernel[(triton.cdiv(seqlen_q, cfg["BLOCK_M"]), batch * nheads_q)](
        q, k, v, dout, lse, delta, dq,
        *_strides4(q), *_strides4(k), *_strides4(v), *_strides4(dout), *_strides4(dq),
        lse.stride(0), lse.stride(1),
        nheads_q, group_size, seqlen_q, seqlen_k, softmax_scale, softmax_scale * LOG2E,
        **common,
    )
    return dq, dk, dv
