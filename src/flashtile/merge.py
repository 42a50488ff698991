"""Merging partial attention results through their log-sum-exps.

Attention over a key set split into disjoint parts ``K = K_1 ∪ … ∪ K_P`` is
recovered exactly from the parts' normalised outputs ``O_p`` and natural-log
log-sum-exps ``L_p``::

    L = log Σ_p exp(L_p),        O = Σ_p exp(L_p − L) · O_p.

This is the online-softmax merge (``reference.merge_softmax_states``) written
for normalised outputs; it is what split-KV decoding, ring attention and prefix
caching use. It is associative and order-free; a part with ``L_p = −inf`` (no
visible key) contributes nothing, and if every part is −inf the result is
output 0 and log-sum-exp −inf.

Layout (flash-attn's): outputs ``[..., seqlen, nheads, headdim]`` and
log-sum-exps ``[..., nheads, seqlen]``, float32. The weights are formed in
float32; the merged output has the dtype of the inputs' outputs.

Two implementations of the same formula: a Triton kernel (CUDA tensors, and CPU
tensors under ``TRITON_INTERPRET=1``) that walks the parts once with a running
maximum, as the attention forward walks key blocks; and the PyTorch expression
below (CPU, and any input that requires grad: the kernel has no backward).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ._host import cdiv, launch_device, next_power_of_2
from .ops import uses_triton

__all__ = ["merge_attention_states", "merge_split_attention_states"]


@triton.jit
def _merge_states_kernel(
    Outs, Lses, Out, Lse,
    stride_op, stride_on, stride_os, stride_oh, stride_od,
    stride_lp, stride_ln, stride_lh, stride_ls,
    stride_mn, stride_ms, stride_mh, stride_md,
    stride_Ln, stride_Lh, stride_Ls,
    num_parts, seqlen,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
):
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

    seen = l_i > 0.0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, (m_i + tl.math.log2(l_i)) * 0.6931471805599453, float("-inf"))  # * ln 2
    p_out = Out + i_n * stride_mn + i_h * stride_mh + o_s[:, None] * stride_ms + o_d[None, :] * stride_md
    tl.store(p_out, out.to(Out.dtype.element_ty), mask=m_sd)
    tl.store(Lse + i_n * stride_Ln + i_h * stride_Lh + o_s * stride_Ls, lse, mask=m_s)


def merge_states_into(outs: torch.Tensor, lses: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
    """Triton launcher: outs [P, N, S, H, D], lses [P, N, H, S] (any strides) merged into
    out [N, S, H, D] (any float dtype) and lse [N, H, S] float32, written in place."""
    num_parts, n, seqlen, nheads, head_dim = outs.shape
    if out.numel() == 0 and lse.numel() == 0:
        return
    block_d = max(16, next_power_of_2(head_dim))
    block_s = min(16, next_power_of_2(seqlen))
    grid = (cdiv(seqlen, block_s), nheads, n)
    _merge_states_kernel[grid](
        outs, lses, out, lse,
        *outs.stride(), *lses.stride(), *out.stride(), *lse.stride(),
        num_parts, seqlen,
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_S=block_s,
    )


def _merge_torch(outs: torch.Tensor, lses: torch.Tensor):
    lses = lses.float()
    m = lses.amax(0)  # [..., H, S]
    m_safe = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    scales = torch.exp(lses - m_safe)  # [P, ..., H, S]; 0 for an empty part
    total = scales.sum(0)
    seen = total > 0
    lse = torch.where(seen, m_safe + torch.log(total), torch.full_like(m, -math.inf))
    weights = scales / torch.where(seen, total, torch.ones_like(total))  # [P, ..., H, S]
    out = (weights.transpose(-1, -2)[..., None] * outs.float()).sum(0)  # [..., S, H, D]
    return out.to(outs.dtype), lse


def _check_states(outs: torch.Tensor, lses: torch.Tensor) -> None:
    for name, t in (("outs", outs), ("lses", lses)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if outs.dim() < 4:
        raise ValueError(f"outs must be [P, ..., seqlen, nheads, headdim], got shape {tuple(outs.shape)}")
    expected = (*outs.shape[:-3], outs.shape[-2], outs.shape[-3])
    if tuple(lses.shape) != expected:
        raise ValueError(
            f"lses must be [P, ..., nheads, seqlen] = {expected} for outs {tuple(outs.shape)}, got {tuple(lses.shape)}"
        )
    if outs.device != lses.device:
        raise ValueError(f"outs and lses must be on one device, got {outs.device}, {lses.device}")


def merge_split_attention_states(outs: torch.Tensor, lses: torch.Tensor):
    """Merge P partial results stacked on a leading split dimension.

    outs [P, ..., S, H, D], lses [P, ..., H, S] → (out [..., S, H, D], lse [..., H, S]).
    """
    _check_states(outs, lses)
    needs_grad = torch.is_grad_enabled() and (outs.requires_grad or lses.requires_grad)
    if needs_grad or not uses_triton(outs):
        return _merge_torch(outs, lses)
    num_parts, seqlen, nheads, head_dim = outs.shape[0], *outs.shape[-3:]
    lead = outs.shape[1:-3]
    out = torch.empty(outs.shape[1:], dtype=outs.dtype, device=outs.device)
    lse = torch.empty(lses.shape[1:], dtype=torch.float32, device=outs.device)
    with launch_device(outs):
        merge_states_into(
            outs.reshape(num_parts, -1, seqlen, nheads, head_dim), lses.reshape(num_parts, -1, nheads, seqlen),
            out.view(-1, seqlen, nheads, head_dim), lse.view(-1, nheads, seqlen),
        )
    return out.view(*lead, seqlen, nheads, head_dim), lse.view(*lead, nheads, seqlen)


def merge_attention_states(out_a, lse_a, out_b, lse_b):
    """Merge two partial results over disjoint key sets; see the module docstring.

    out_* [..., S, H, D], lse_* [..., H, S] float32 → (out, lse) of the same shapes.
    """
    return merge_split_attention_states(torch.stack((out_a, out_b)), torch.stack((lse_a, lse_b)))
