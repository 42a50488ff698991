"""The one autograd layer: a ``torch.autograd.Function`` over the ``flashtile::fwd``/``bwd`` operators
(called through ``ops.call_fwd``/``call_bwd``, which skip the dispatcher in eager calls), in two forms
(under torch.func's transforms, and not), and :func:`attend`, which calls it only where a gradient can be
asked for.

Inputs come separate ``(q, k, v)`` or packed (``qkv`` stacked on dim −3, or ``q`` and
``kv``); packed inputs are split into views, never copied, and the backward writes
the gradients straight into the slices of one packed gradient, with no
concatenation. Tensors here are already validated by ``flashtile._validate``.
Only the tensors the backward needs are saved: the inputs, out and the
log-sum-exp (plus the call's optional tensors: bias, ALiBi slopes, dropout seed, cu_seqlens).
"""

from __future__ import annotations

import torch

from ._options import AttentionOptions, AttentionTensors
from .ops import call_bwd, call_fwd, differentiable, differentiable_fwd

SEPARATE, QKV_PACKED, KV_PACKED = "separate", "qkv", "kv"


def unpack(layout, a, b, c):
    """(q, k, v) as views of the inputs, by ``layout``."""
    if layout == QKV_PACKED:
        return a.unbind(-3)
    if layout == KV_PACKED:
        return (a, *b.unbind(-3))
    return a, b, c


def _arguments(inputs: tuple) -> tuple:
    """The Function's ``apply`` arguments → (layout, a, b, c, AttentionTensors, options)."""
    layout, a, b, c, alibi_slopes, attn_bias, dropout_seed, cu_seqlens_q, cu_seqlens_k, learnable_sink, options = inputs
    cu_seqlens_k = cu_seqlens_q if cu_seqlens_k is None else cu_seqlens_k
    tensors = AttentionTensors(alibi_slopes, attn_bias, dropout_seed, cu_seqlens_q, cu_seqlens_k, learnable_sink)
    return layout, a, b, c, tensors, options


def _save(ctx, layout, a, b, c, tensors: AttentionTensors, options: AttentionOptions, output: tuple) -> None:
    """What the backward needs from a call, kept in ``ctx``."""
    out, lse = output
    ctx.save_for_backward(a, b, c, out, lse, *tensors)
    ctx.layout = layout
    ctx.options = options
    ctx.mark_non_differentiable(lse)
    # the backward reads no gradient of the log-sum-exp: left unmaterialised, the engine passes None instead of
    # allocating and zero-filling a tensor like lse on every backward (a fill kernel on a GPU); out's gradient
    # is None too where every gradient that reached out was undefined (``_NO_GRADIENTS``)
    ctx.set_materialize_grads(False)


_NO_GRADIENTS = (None,) * 11  # one per argument of ``apply``: out got no gradient, so no input gets one


def _gradients(ctx, saved: tuple, dout, grads: list) -> tuple:
    """The backward of a call saved by :func:`_save`, whose ``ctx.saved_tensors`` are ``saved`` (read once a
    backward: under a non-reentrant checkpoint each saved tensor may be unpacked only once), writing dq, dk,
    dv into ``grads`` (buffers like the inputs a, b, c) → the gradients of ``apply``'s arguments."""
    a, b, c, out, lse, *optional = saved
    tensors = AttentionTensors(*optional)
    q, k, v = unpack(ctx.layout, a, b, c)
    dq, dk, dv = unpack(ctx.layout, *grads)
    bias_grad = tensors.attn_bias is not None and ctx.needs_input_grad[5]
    dbias, dsink = call_bwd(dout, q, k, v, out, lse, dq, dk, dv, bias_grad, tensors, ctx.options)
    dsink = dsink if tensors.learnable_sink is not None and ctx.needs_input_grad[9] else None
    return (None, *grads, None, dbias if bias_grad else None, None, None, None, dsink, None)


class FlashAttnFunction(torch.autograd.Function):
    """Exact attention: ``apply(layout, a, b, c, alibi_slopes, attn_bias, dropout_seed, cu_seqlens_q,
    cu_seqlens_k, learnable_sink, options)`` → (out, lse); (a, b, c) is (q, k, v), (qkv, None, None) or
    (q, kv, None) by ``layout``; the six optional tensors are ``AttentionTensors``' fields, in
    order, passed one by one so that autograd sees them (the bias and the sink may need gradients);
    ``cu_seqlens_k`` None with ``cu_seqlens_q`` given means the same tensor (Dynamo refuses one
    tensor passed twice)."""

    @staticmethod
    def forward(ctx, *inputs):
        layout, a, b, c, tensors, options = _arguments(inputs)
        output = call_fwd(*unpack(layout, a, b, c), tensors, options)
        _save(ctx, layout, a, b, c, tensors, options, output)
        return output

    @staticmethod
    def backward(ctx, dout, _dlse):
        if dout is None:
            return _NO_GRADIENTS
        saved = ctx.saved_tensors
        return _gradients(ctx, saved, dout, [torch.empty_like(t) if t is not None else None for t in saved[:3]])


class TransformableFlashAttnFunction(FlashAttnFunction):
    """:class:`FlashAttnFunction` under torch.func's transforms (``grad``, ``vjp``, ``vmap``, ``jacrev``), which
    take only a Function whose context is set up apart from its forward. Eager calls keep the other: with a separate
    ``setup_context`` PyTorch's ``apply`` binds the arguments to ``forward``'s signature on every call, which
    doubled a small call's host time with gradients (44-48 → 92-97 µs on a CPU core)."""

    @staticmethod
    def forward(*inputs):
        layout, a, b, c, tensors, options = _arguments(inputs)
        return call_fwd(*unpack(layout, a, b, c), tensors, options)

    generate_vmap_rule = True  # torch.vmap runs forward and backward through the operators' vmap rules (ops.py)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _save(ctx, *_arguments(inputs), output)

    @staticmethod
    def backward(ctx, dout, _dlse):
        # the operator writes the gradients into these buffers: under torch.vmap they must be vmapped
        # wherever anything of the call is (only the incoming gradient under jacrev, only an input where a
        # shared gradient is pulled back), as new_empty's of a sum of all of them are
        if dout is None:
            return _NO_GRADIENTS
        saved = ctx.saved_tensors
        anchor = dout.new_zeros(())
        for t in saved:
            if t is not None:
                anchor = anchor + t.new_zeros((), dtype=dout.dtype)
        buffers = [anchor.new_empty(t.shape) if t is not None else None for t in saved[:3]]
        return _gradients(ctx, saved, dout, buffers)


def attend(layout, a, b, c, q, k, v, tensors: AttentionTensors, options: AttentionOptions):
    """The call on (a, b, c) in ``layout``, whose views q, k, v its caller unpacked, → (out, lse):
    ``FlashAttnFunction.apply`` where a gradient can be asked for and the call is not one that PyTorch's
    autograd differentiates itself (``ops.differentiable``: the CPU path's fused kernel); else the forward
    alone, whose result PyTorch's kernel makes differentiable in that case. autograd's Function machinery
    costs ~20 µs of host time per call on a CPU core, as much as a small call's launch (benchmarks/NOTES.md,
    "Host time")."""
    bias, sink = tensors.attn_bias, tensors.learnable_sink
    # under torch.func's transforms a wrapped tensor's requires_grad says nothing of the levels below it (a
    # BatchedTensor's is False where the tensor it wraps needs a gradient: grad of vmap): always the Function
    transformed = torch._C._are_functorch_transforms_active() and not torch.compiler.is_compiling()
    # spelled out, not any() over a generator: this runs on every call. q, k and v want a gradient where
    # the inputs they are views of do
    wants_grad = transformed or (torch.is_grad_enabled() and (
        q.requires_grad or k.requires_grad or v.requires_grad or (bias is not None and bias.requires_grad)
        or (sink is not None and sink.requires_grad)))
    if not wants_grad:
        return call_fwd(q, k, v, tensors, options)
    if differentiable(q, k, v, tensors, options):
        return differentiable_fwd(q, k, v, tensors, options)
    if torch.compiler.is_compiling():  # Dynamo refuses one tensor passed twice to a Function: a view stands in
        b = b.view_as(b) if b is not None and b is a else b
        c = c.view_as(c) if c is not None and (c is a or c is b) else c
    alibi_slopes, _, dropout_seed, cu_seqlens_q, cu_seqlens_k, _ = tensors
    if cu_seqlens_k is cu_seqlens_q:
        cu_seqlens_k = None  # FlashAttnFunction's spelling of "the same" (Dynamo refuses one tensor passed twice)
    function = TransformableFlashAttnFunction if transformed else FlashAttnFunction
    return function.apply(layout, a, b, c, alibi_slopes, bias, dropout_seed, cu_seqlens_q, cu_seqlens_k, sink, options)
