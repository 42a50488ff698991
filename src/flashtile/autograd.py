"""The one autograd layer: a ``torch.autograd.Function`` over the ``flashtile::fwd``/``bwd`` ops.

Inputs come separate ``(q, k, v)`` or packed (``qkv`` stacked on dim −3, or ``q`` and
``kv``); packed inputs are split into views, never copied, and the backward writes
the gradients straight into the slices of one packed gradient, with no
concatenation. Tensors here are already validated by ``flashtile.interface``.
Only the tensors the backward needs are saved: the inputs, out and the
log-sum-exp (plus the bias, ALiBi slopes, dropout seed and cu_seqlens if given).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

SEPARATE, QKV_PACKED, KV_PACKED = "separate", "qkv", "kv"


class Scalars(NamedTuple):
    """The non-tensor arguments of one call; ``window_right`` already includes causal (0)."""

    softmax_scale: float
    window_left: int = -1
    window_right: int = -1
    softcap: float = 0.0
    dropout_p: float = 0.0
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0


def _unpack(layout, a, b, c):
    if layout == QKV_PACKED:
        return a.unbind(-3)
    if layout == KV_PACKED:
        return (a, *b.unbind(-3))
    return a, b, c


class FlashAttnFunction(torch.autograd.Function):
    """Exact attention: ``apply(layout, a, b, c, attn_bias, alibi_slopes, dropout_seed,
    cu_seqlens_q, cu_seqlens_k, scalars)`` → (out, lse); (a, b, c) is (q, k, v),
    (qkv, None, None) or (q, kv, None) by ``layout``; ``cu_seqlens_k`` None with
    ``cu_seqlens_q`` given means the same tensor (Dynamo refuses one tensor passed twice)."""

    @staticmethod
    def forward(ctx, layout, a, b, c, attn_bias, alibi_slopes, dropout_seed, cu_seqlens_q, cu_seqlens_k,
                scalars: Scalars):
        q, k, v = _unpack(layout, a, b, c)
        cu_seqlens_k = cu_seqlens_q if cu_seqlens_k is None else cu_seqlens_k
        out, lse = torch.ops.flashtile.fwd(
            q, k, v, scalars.softmax_scale, scalars.window_left, scalars.window_right, scalars.softcap,
            alibi_slopes, attn_bias, scalars.dropout_p, dropout_seed, cu_seqlens_q, cu_seqlens_k,
            scalars.max_seqlen_q, scalars.max_seqlen_k,
        )
        ctx.save_for_backward(a, b, c, out, lse, attn_bias, alibi_slopes, dropout_seed, cu_seqlens_q, cu_seqlens_k)
        ctx.layout = layout
        ctx.scalars = scalars
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        a, b, c, out, lse, attn_bias, alibi_slopes, dropout_seed, cu_seqlens_q, cu_seqlens_k = ctx.saved_tensors
        scalars, layout = ctx.scalars, ctx.layout
        q, k, v = _unpack(layout, a, b, c)
        grads = [torch.empty_like(t) if t is not None else None for t in (a, b, c)]
        dq, dk, dv = _unpack(layout, *grads)
        bias_grad = attn_bias is not None and ctx.needs_input_grad[4]
        dbias = torch.ops.flashtile.bwd(
            dout, q, k, v, out, lse, dq, dk, dv, scalars.softmax_scale, scalars.window_left,
            scalars.window_right, scalars.softcap, alibi_slopes, attn_bias, bias_grad, scalars.dropout_p,
            dropout_seed, cu_seqlens_q, cu_seqlens_k, scalars.max_seqlen_q, scalars.max_seqlen_k,
        )
        return (None, *grads, dbias if bias_grad else None, None, None, None, None, None)
