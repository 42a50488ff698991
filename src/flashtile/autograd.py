"""The one autograd layer: dispatch by device to the Triton kernels or the CPU tiled path.

Tensors here are in flash-attn's layout (batch, seqlen, nheads, headdim), already
validated by ``flashtile.interface``. CUDA tensors run the Triton kernels; CPU
tensors run ``flashtile.reference``'s tiled algorithm (O(N) memory), except under
``TRITON_INTERPRET=1``, where the Triton kernels themselves run on the CPU.
"""

from __future__ import annotations

import math
import os

import torch

from . import reference


def uses_triton(t: torch.Tensor) -> bool:
    """Whether tensors on ``t``'s device run the Triton kernels."""
    return t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


def _forward(q, k, v, softmax_scale, causal):
    batch, seqlen_q, nheads_q, _ = q.shape
    if batch * nheads_q * seqlen_q == 0 or k.shape[1] == 0:
        # nothing to attend: output 0, log-sum-exp -inf
        out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
        lse = torch.full((batch, nheads_q, seqlen_q), -math.inf, dtype=torch.float32, device=q.device)
        return out, lse
    if uses_triton(q):
        from .kernels import flash_attn_forward

        return flash_attn_forward(q, k, v, softmax_scale, causal)
    out, lse = reference.tiled_attention_forward(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), softmax_scale, causal
    )
    return out.transpose(1, 2), lse.float()


def _backward(dout, q, k, v, out, lse, softmax_scale, causal):
    if q.shape[0] * q.shape[2] * q.shape[1] == 0 or k.shape[1] == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    if uses_triton(q):
        from .kernels import flash_attn_backward

        return flash_attn_backward(dout, q, k, v, out, lse, softmax_scale, causal)
    dq, dk, dv = reference.tiled_attention_backward(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
        out.transpose(1, 2), lse, dout.transpose(1, 2), softmax_scale, causal,
    )
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


class FlashAttnFunction(torch.autograd.Function):
    """Exact attention; saves only q, k, v, out and the log-sum-exp for the backward."""

    @staticmethod
    def forward(ctx, q, k, v, softmax_scale: float, causal: bool):
        out, lse = _forward(q, k, v, softmax_scale, causal)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.softmax_scale = softmax_scale
        ctx.causal = causal
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _backward(dout, q, k, v, out, lse, ctx.softmax_scale, ctx.causal)
        return dq, dk, dv, None, None
