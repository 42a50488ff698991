"""flashtile's two operators, registered with ``torch.library`` so that torch.compile sees them.

``flashtile::fwd`` and ``flashtile::bwd`` are one attention call's forward and
backward as plain operators (no autograd), with fake implementations that give
the output shapes without running anything: ``torch.compile(fullgraph=True)``
traces through them with no graph break and no host sync. The backward writes
into ``dq``/``dk``/``dv`` buffers it is given (it mutates them), so the packed
functions can hand it the slices of one packed gradient.

They are defined with explicit schemas and one CompositeExplicitAutograd kernel each
(``torch.library.Library``), not with ``torch.library.custom_op``, which wraps every
call in a Python autograd kernel and a Dynamo guard and, for the mutating backward,
re-reads the schema's defaults: a forward+backward's host time fell from ~390 to
~220 µs on a CPU core without them (benchmarks/NOTES.md, "Host overhead"). Autograd
is ``flashtile.autograd``'s single Function; the operators have no autograd kernel (an
autograd kernel in Python would cost ~4 µs a call), so ``attention_forward`` and
``attention_backward`` below refuse inputs that need grad rather than let PyTorch's
fallback leave their gradients None.

Each dispatches by device: CUDA tensors run the Triton kernels; CPU tensors run
``flashtile.reference``'s tiled algorithm (O(N) memory), except under
``TRITON_INTERPRET=1``, where the Triton kernels themselves run on the CPU.

Layout (batch, seqlen, nheads, headdim), or (total, nheads, headdim) with
``cu_seqlens``; the log-sum-exp is (batch, nheads, seqlen_q), or (nheads,
total_q), natural log, float32. ``window_left/right`` already include causal
(right = 0); −1 is unbounded.
"""

from __future__ import annotations

import math
import os

import torch

from . import reference
from ._host import launch_device

__all__ = ["attention_forward", "attention_backward", "uses_triton"]


def uses_triton(t: torch.Tensor) -> bool:
    """Whether tensors on ``t``'s device run the Triton kernels."""
    return t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


def _variant(window_left, window_right, softcap, alibi_slopes, attn_bias, dropout_p, dropout_seed,
             cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
    from .kernels import Variant

    return Variant((window_left, window_right), softcap, alibi_slopes, attn_bias, dropout_p, dropout_seed,
                   cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)


def _reference_options(window_left, window_right, softcap, alibi_slopes, attn_bias, dropout_p, dropout_seed):
    return dict(window_size=(window_left, window_right), softcap=softcap, alibi_slopes=alibi_slopes,
                attn_bias=attn_bias, dropout_p=dropout_p,
                dropout_seed=int(dropout_seed.item()) if dropout_seed is not None else None)


def _lse_shape(q, k, cu_seqlens_q):
    if cu_seqlens_q is not None:
        return (q.shape[1], q.shape[0])
    return (q.shape[0], q.shape[2], q.shape[1])


def _attends_nothing(q, k, cu_seqlens_q) -> bool:
    token_axis = 0 if cu_seqlens_q is not None else 1
    return q.numel() == 0 or k.shape[token_axis] == 0


_SCHEMAS = {
    "fwd": "fwd(Tensor q, Tensor k, Tensor v, float softmax_scale, SymInt window_left, SymInt window_right, "
           "float softcap, Tensor? alibi_slopes, Tensor? attn_bias, float dropout_p, Tensor? dropout_seed, "
           "Tensor? cu_seqlens_q, Tensor? cu_seqlens_k, SymInt max_seqlen_q, SymInt max_seqlen_k) -> (Tensor, Tensor)",
    "bwd": "bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor(a!) dq, Tensor(b!) dk, "
           "Tensor(c!) dv, float softmax_scale, SymInt window_left, SymInt window_right, float softcap, "
           "Tensor? alibi_slopes, Tensor? attn_bias, bool bias_grad, float dropout_p, Tensor? dropout_seed, "
           "Tensor? cu_seqlens_q, Tensor? cu_seqlens_k, SymInt max_seqlen_q, SymInt max_seqlen_k) -> Tensor",
}


def _fwd(q, k, v, softmax_scale, window_left, window_right, softcap, alibi_slopes, attn_bias, dropout_p,
         dropout_seed, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
    if _attends_nothing(q, k, cu_seqlens_q):
        # nothing to attend: output 0, log-sum-exp -inf
        return q.new_zeros(q.shape), torch.full(_lse_shape(q, k, cu_seqlens_q), -math.inf, device=q.device)
    if uses_triton(q):
        from .kernels import flash_attn_forward

        variant = _variant(window_left, window_right, softcap, alibi_slopes, attn_bias, dropout_p, dropout_seed,
                           cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        with launch_device(q):
            return flash_attn_forward(q, k, v, softmax_scale, variant)
    options = _reference_options(window_left, window_right, softcap, alibi_slopes, attn_bias, dropout_p,
                                 dropout_seed)
    if cu_seqlens_q is not None:
        out, lse = reference.tiled_varlen_attention_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale,
                                                            **options)
        return out, lse.float()
    out, lse = reference.tiled_attention_forward(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                 softmax_scale, **options)
    return out.transpose(1, 2).contiguous(), lse.float()


def _fwd_fake(q, k, v, softmax_scale, window_left, window_right, softcap, alibi_slopes, attn_bias, dropout_p,
              dropout_seed, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
    return q.new_empty(q.shape), q.new_empty(_lse_shape(q, k, cu_seqlens_q), dtype=torch.float32)


def _bwd(dout, q, k, v, out, lse, dq, dk, dv, softmax_scale, window_left, window_right, softcap, alibi_slopes,
         attn_bias, bias_grad, dropout_p, dropout_seed, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
    """Writes dq, dk, dv; returns the bias gradient (shaped like attn_bias), or an empty tensor."""
    no_bias_grad = q.new_empty((0,), dtype=torch.float32)
    if _attends_nothing(q, k, cu_seqlens_q):
        for grad in (dq, dk, dv):
            grad.zero_()
        return torch.zeros_like(attn_bias) if bias_grad else no_bias_grad
    if uses_triton(q):
        from .kernels import flash_attn_backward

        variant = _variant(window_left, window_right, softcap, alibi_slopes, attn_bias, dropout_p, dropout_seed,
                           cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        with launch_device(q):
            *_, dbias = flash_attn_backward(dout, q, k, v, out, lse, softmax_scale, variant, dq, dk, dv, bias_grad)
        return dbias if bias_grad else no_bias_grad
    options = _reference_options(window_left, window_right, softcap, alibi_slopes, attn_bias, dropout_p,
                                 dropout_seed)
    if cu_seqlens_q is not None:
        grads = reference.tiled_varlen_attention_backward(q, k, v, out, lse, dout, cu_seqlens_q, cu_seqlens_k,
                                                          softmax_scale, **options)
        for buffer, grad in zip((dq, dk, dv), grads):
            buffer.copy_(grad)
        return no_bias_grad
    *grads, dbias = reference.tiled_attention_backward(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), out.transpose(1, 2), lse, dout.transpose(1, 2),
        softmax_scale, **options,
    )
    for buffer, grad in zip((dq, dk, dv), grads):
        buffer.copy_(grad.transpose(1, 2))
    return dbias.to(attn_bias.dtype) if bias_grad else no_bias_grad


def _bwd_fake(dout, q, k, v, out, lse, dq, dk, dv, softmax_scale, window_left, window_right, softcap, alibi_slopes,
              attn_bias, bias_grad, dropout_p, dropout_seed, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
    return torch.empty_like(attn_bias) if bias_grad else q.new_empty((0,), dtype=torch.float32)


if not hasattr(torch.ops.flashtile, "fwd"):  # a reload of this module (notebook autoreload) keeps the first
    _LIBRARY = torch.library.Library("flashtile", "DEF")  # registrations live as long as this object
    # pt2_compliant_tag: what custom_op would add, and what torch.compile's strict op check asks for
    for _name, _kernel, _fake in (("fwd", _fwd, _fwd_fake), ("bwd", _bwd, _bwd_fake)):
        _LIBRARY.define(_SCHEMAS[_name], tags=(torch.Tag.pt2_compliant_tag,))
        _LIBRARY.impl(_name, _kernel, "CompositeExplicitAutograd")
        torch.library.register_fake(f"flashtile::{_name}", _fake, lib=_LIBRARY)


def _refuse_autograd(*tensors) -> None:
    # the operators have no autograd formula (flashtile.autograd is the differentiable layer), and
    # PyTorch's fallback would only warn at backward time and leave the gradients None
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        raise RuntimeError("flashtile.ops.attention_forward/attention_backward are not differentiable: call them "
                           "under torch.no_grad() or inside an autograd.Function, or use flash_attn_func")


def attention_forward(q, k, v, softmax_scale: float, causal: bool, *, window_size=(-1, -1), softcap=0.0,
                      alibi_slopes=None, attn_bias=None, dropout_p=0.0, dropout_seed=None):
    """One attention call's forward, no autograd: (q, k, v) → (out, lse).

    For code that composes attention calls itself, such as ring attention.
    ``dropout_seed``: an int, or an int64 tensor of one element (needed when dropout_p > 0).
    """
    _refuse_autograd(q, k, v, alibi_slopes, attn_bias)
    left, right = window_size
    if causal:
        right = 0
    if isinstance(dropout_seed, int):
        dropout_seed = torch.tensor([dropout_seed], dtype=torch.int64, device=q.device)
    return torch.ops.flashtile.fwd(q, k, v, softmax_scale, left, right, softcap, alibi_slopes, attn_bias,
                                   dropout_p, dropout_seed, None, None, 0, 0)


def attention_backward(dout, q, k, v, out, lse, softmax_scale: float, causal: bool, *, window_size=(-1, -1),
                       softcap=0.0, alibi_slopes=None, dropout_p=0.0, dropout_seed=None):
    """→ (dq, dk, dv), with P rebuilt from ``lse`` and D = rowsum(dout ∘ out).

    ``out`` and ``lse`` may be those of a larger attention that this call is a part of
    (ring attention): the gradients are then this part's share.
    """
    _refuse_autograd(dout, q, k, v, out, lse, alibi_slopes)
    left, right = window_size
    if causal:
        right = 0
    if isinstance(dropout_seed, int):
        dropout_seed = torch.tensor([dropout_seed], dtype=torch.int64, device=q.device)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    torch.ops.flashtile.bwd(dout, q, k, v, out, lse, dq, dk, dv, softmax_scale, left, right, softcap,
                            alibi_slopes, None, False, dropout_p, dropout_seed, None, None, 0, 0)
    return dq, dk, dv
