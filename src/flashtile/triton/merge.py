"""Merging partial attention results through their log-sum-exps, in Triton.

``L = log Σ_p exp(L_p)`` and ``O = Σ_p exp(L_p − L) · O_p`` (``flashtile.reference.softmax``
states it), walked once over the parts with a running maximum in base 2, as the attention forward
walks key blocks. A part with ``L_p = −inf`` has weight 0; if every part is −inf the result is
output 0 and log-sum-exp −inf. ``L_p = +inf`` (flash-attn 2's mark of an empty row) is an empty part.

Layout: outputs [P, N, S, H, D] and log-sum-exps [P, N, H, S] (any strides) merged into
[N, S, H, D] (any float dtype) and [N, H, S] float32.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .scores import normalise, widen


@triton.jit
def merge_states_kernel(
    Outs, Lses, Out, Lse,
    stride_op, stride_on, stride_os, stride_oh, stride_od,
    stride_lp, stride_ln, stride_lh, stride_ls,
    stride_mn, stride_ms, stride_mh, stride_md,
    stride_Ln, stride_Lh, stride_Ls,
    num_parts, seqlen,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, WIDE: tl.constexpr,
):
    # a tensor of the call spans more than 2³¹ elements: 64-bit strides make every offset formed with them
    # 64-bit (head-dim strides stay 32-bit; the launcher bounds what they span)
    stride_op, stride_on, stride_os, stride_oh = widen(stride_op, WIDE), widen(stride_on, WIDE), widen(stride_os, WIDE), widen(stride_oh, WIDE)
    stride_lp, stride_ln, stride_lh, stride_ls = widen(stride_lp, WIDE), widen(stride_ln, WIDE), widen(stride_lh, WIDE), widen(stride_ls, WIDE)
    stride_mn, stride_ms, stride_mh = widen(stride_mn, WIDE), widen(stride_ms, WIDE), widen(stride_mh, WIDE)
    stride_Ln, stride_Lh, stride_Ls = widen(stride_Ln, WIDE), widen(stride_Lh, WIDE), widen(stride_Ls, WIDE)
    # one program per (block of seqlen rows, head h, leading index n)
    i_s = tl.program_id(0)
    i_h = tl.program_id(1)
    i_n = tl.program_id(2).to(tl.int64)

    o_s = i_s * BLOCK_S + tl.arange(0, BLOCK_S)
    o_d = tl.arange(0, BLOCK_D)
    m_s = o_s < seqlen
    m_sd = m_s[:, None] & (o_d < HEAD_DIM)[None, :]
    p_outs = Outs + i_n * stride_on + i_h * stride_oh + o_s[:, None] * stride_os + o_d[None, :] * stride_od
    p_lses = Lses + i_n * stride_ln + i_h * stride_lh + o_s * stride_ls

    # running state in base 2, as in the attention forward: m_i = max log2-sum-exp so far,
    # l_i = Σ 2^(L_p·log2 e − m_i), acc = Σ 2^(L_p·log2 e − m_i) · O_p
    m_i = tl.full([BLOCK_S], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_S], dtype=tl.float32)
    acc = tl.zeros([BLOCK_S, BLOCK_D], dtype=tl.float32)
    for i_p in range(0, num_parts):
        b_lse = tl.load(p_lses + i_p * stride_lp, mask=m_s, other=float("-inf")).to(tl.float32)  # [BLOCK_S]
        b_lse = tl.where(b_lse == float("inf"), float("-inf"), b_lse)  # flash-attn 2's empty row: an empty part
        b_lse2 = b_lse * 1.4426950408889634  # * log2(e)
        # -- a part with L = -inf has weight 0; exponentiate against 0 while every part so far is -inf
        m_new = tl.maximum(m_i, b_lse2)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m_i - m_safe)
        weight = tl.math.exp2(b_lse2 - m_safe)
        l_i = l_i * alpha + weight
        b_o = tl.load(p_outs + i_p * stride_op, mask=m_sd, other=0.0).to(tl.float32)  # [BLOCK_S, BLOCK_D]
        acc = acc * alpha[:, None] + weight[:, None] * b_o
        m_i = m_new

    out, lse = normalise(acc, l_i, m_i)
    p_out = Out + i_n * stride_mn + i_h * stride_mh + o_s[:, None] * stride_ms + o_d[None, :] * stride_md
    tl.store(p_out, out.to(Out.dtype.element_ty), mask=m_sd)
    tl.store(Lse + i_n * stride_Ln + i_h * stride_Lh + o_s * stride_Ls, lse, mask=m_s)
