"""flashtile's operators and the one place that picks the device path.

``flashtile::fwd`` and ``flashtile::bwd`` are one attention call's forward and backward as
plain operators (no autograd), registered with ``torch.library`` when this module is imported,
with fake implementations that give the output shapes without running anything:
``torch.compile(fullgraph=True)`` traces through them with no graph break and no host sync. The
backward writes into ``dq``/``dk``/``dv`` buffers it is given (it mutates them), so the packed
functions can hand it the slices of one packed gradient. ``fwd_op`` and ``bwd_op`` are their
Python handles, which ``flashtile.autograd`` imports.

Their schemas are the call's one representation flattened: the fields of
``_options.AttentionTensors`` and then of ``_options.AttentionOptions``, in order, generated
from those NamedTuples, so the two cannot drift apart. They are defined with explicit schemas
and one CompositeExplicitAutograd kernel each (``torch.library.Library``), not with
``torch.library.custom_op``, which wraps every call in a Python autograd kernel and a Dynamo
guard and, for the mutating backward, re-reads the schema's defaults: a forward+backward's host
time fell from ~390 to ~220 µs on a CPU core without them (benchmarks/NOTES.md, "Host
overhead"). Gradients come from ``flashtile.autograd``'s Function, around the operators; the forward
operator also has an autograd formula of its own, for traced graphs that hold it without the Function
(torch.compile over torch.func.grad), which eager calls never reach. :func:`attention_forward` and
:func:`attention_backward` below are not differentiable and refuse inputs that need grad.

Device dispatch (:func:`backend`, :func:`uses_triton`): CUDA tensors run the Triton kernels
(``flashtile.triton.launch``); CPU tensors run the CPU path (``flashtile.cpu``: PyTorch's fused CPU
attention where its semantics are flashtile's, ``flashtile.reference``'s tiled algorithm otherwise,
O(N) memory), except under ``TRITON_INTERPRET=1``, where the Triton kernels themselves run on the
CPU. The KV-cache forward and the merge of partial results dispatch the same way.

Layout (batch, seqlen, nheads, headdim), or (total, nheads, headdim) with ``cu_seqlens``; the
log-sum-exp is (batch, nheads, seqlen_q), or (nheads, total_q), natural log, float32.
"""

from __future__ import annotations

import math

import torch

from . import cpu, reference
from ._options import AttentionOptions, AttentionTensors, fold_causal
from .triton import launch
from .triton._interpreter import interpreting

__all__ = ["attention_backward", "attention_forward", "backend", "bwd_op", "call_bwd", "call_fwd", "differentiable",
           "differentiable_fwd", "direct", "fwd_op",
           "kvcache_append", "kvcache_attention", "merge_states", "out_shape", "uses_triton"]

BACKENDS = {
    "cuda": "the Triton kernels on the GPU (on sm_90 the plain forward is the Gluon kernel)",
    "interpreter": "the Triton kernels in Triton's CPU interpreter (TRITON_INTERPRET=1): exact, slow",
    "cpu": "the PyTorch path: PyTorch's fused CPU attention where its semantics are flashtile's (flashtile.cpu), "
           "else the tiled FlashAttention reference; O(N) memory",
}


def backend(device=None) -> str:
    """The path flashtile's calls take for tensors on a device: "cuda", "interpreter" or "cpu"
    (``flashtile.ops.BACKENDS`` says what each is). The one place that decides it: every operator
    dispatches by this rule.

    Arguments:
        device: a torch.device or string; default the GPU if there is one, else the CPU.
    """
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if torch.device(device).type == "cuda":
        return "cuda"
    return "interpreter" if interpreting() else "cpu"


def uses_triton(t: torch.Tensor) -> bool:
    """Whether tensors on ``t``'s device run the Triton kernels (else the PyTorch path); the same
    rule as :func:`backend`, without building a device object on every call."""
    return t.is_cuda or interpreting()


# ----------------------------------------------------------------------------------------------
# The registered operators

_SCHEMA_TYPES = {"torch.Tensor | None": "Tensor?", "float": "float", "int": "SymInt", "bool": "bool"}


def _schema_arguments(fields: type) -> str:
    # a NamedTuple keeps its annotations as written (strings, or ForwardRefs wrapping them)
    return ", ".join(f"{_SCHEMA_TYPES[getattr(annotation, '__forward_arg__', annotation)]} {name}"
                     for name, annotation in fields.__annotations__.items())


_CALL = f"{_schema_arguments(AttentionTensors)}, {_schema_arguments(AttentionOptions)}"
_SCHEMAS = {
    "fwd": f"fwd(Tensor q, Tensor k, Tensor v, {_CALL}) -> (Tensor, Tensor)",
    "bwd": f"bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor(a!) dq, Tensor(b!) dk, "
           f"Tensor(c!) dv, bool bias_grad, {_CALL}) -> (Tensor, Tensor)",
}
_NUM_TENSORS = len(AttentionTensors._fields)


def _fields(arguments) -> tuple[AttentionTensors, AttentionOptions]:
    """The operators' flat trailing arguments → the call's (tensors, options), as given."""
    return AttentionTensors(*arguments[:_NUM_TENSORS]), AttentionOptions(*arguments[_NUM_TENSORS:])


def _prepared(tensors: AttentionTensors) -> AttentionTensors:
    """A packed batch's bounds made non-decreasing (``reference.nondecreasing``): every path then sees
    the same disjoint sequences, whatever values reached it unchecked."""
    if not tensors.is_varlen:
        return tensors
    cu_q = reference.nondecreasing(tensors.cu_seqlens_q)
    same = tensors.cu_seqlens_k is tensors.cu_seqlens_q
    return tensors._replace(cu_seqlens_q=cu_q,
                            cu_seqlens_k=cu_q if same else reference.nondecreasing(tensors.cu_seqlens_k))


def out_shape(q, v) -> tuple[int, ...]:
    """The output's shape: q's, with v's head dim (MLA's differs from q's)."""
    return (*q.shape[:-1], v.shape[-1])


def _lse_shape(q, tensors: AttentionTensors):
    return (q.shape[1], q.shape[0]) if tensors.is_varlen else (q.shape[0], q.shape[2], q.shape[1])


def _attends_nothing(q, k, tensors: AttentionTensors) -> bool:
    token_axis = 0 if tensors.is_varlen else 1
    return q.numel() == 0 or k.shape[token_axis] == 0


def _fwd(q, k, v, *arguments):
    tensors, options = _fields(arguments)
    out, lse = _forward(q, k, v, _prepared(tensors), options)
    # contiguous, as _fwd_fake declares it (torch.compile checks): the CPU path leaves an lse that its caller
    # does not read as PyTorch's kernel lays it out (cpu.fused_attention_forward)
    return out, lse.contiguous()


def _forward(q, k, v, tensors: AttentionTensors, options: AttentionOptions):
    if _attends_nothing(q, k, tensors):
        # nothing to attend: output 0, log-sum-exp -inf, or the sink's logit (its mass alone)
        lse = torch.full(_lse_shape(q, tensors), -math.inf, device=q.device)
        if tensors.learnable_sink is not None:
            heads = (-1, 1) if tensors.is_varlen else (1, -1, 1)
            lse.copy_(tensors.learnable_sink.view(heads).expand_as(lse))
        return q.new_zeros(out_shape(q, v)), lse
    if uses_triton(q):
        return launch.attention_forward(q, k, v, options, tensors)
    return cpu.attention_forward(q, k, v, options, tensors)


def _fwd_fake(q, k, v, *arguments):
    tensors, _ = _fields(arguments)  # shapes only: the bounds' values do not matter
    return q.new_empty(out_shape(q, v)), q.new_empty(_lse_shape(q, tensors), dtype=torch.float32)


def _bwd(dout, q, k, v, out, lse, dq, dk, dv, bias_grad, *arguments):
    """Writes dq, dk, dv; returns (the bias gradient shaped like attn_bias, or an empty tensor; the
    learnable sink's gradient [Hq] float32, or an empty tensor). The sink's gradient needs only
    D = rowsum(dO ∘ O), which the kernels form anyway: it is reduced from theirs, and formed here on
    the PyTorch paths."""
    tensors, options = _fields(arguments)
    return _backward(dout, q, k, v, out, lse, dq, dk, dv, bias_grad, _prepared(tensors), options)


def _backward(dout, q, k, v, out, lse, dq, dk, dv, bias_grad, tensors: AttentionTensors, options: AttentionOptions):
    dbias, delta = _gradients(dout, q, k, v, out, lse, dq, dk, dv, bias_grad, tensors, options)
    dsink = q.new_empty((0,), dtype=torch.float32)  # outputs must not alias: one empty tensor each
    if tensors.learnable_sink is not None:
        if delta is None:
            delta = reference.output_delta(dout, out, tensors.is_varlen)
        dsink = reference.sink_gradient(delta, lse, tensors.learnable_sink, tensors.is_varlen)
    return (dbias if bias_grad else q.new_empty((0,), dtype=torch.float32)), dsink


def _gradients(dout, q, k, v, out, lse, dq, dk, dv, bias_grad, tensors: AttentionTensors, options: AttentionOptions):
    """dq, dk, dv written by the device's path → (the bias gradient or None, the kernels' D or None)."""
    if _attends_nothing(q, k, tensors):
        for grad in (dq, dk, dv):
            grad.zero_()
        return (torch.zeros_like(tensors.attn_bias) if bias_grad else None), None
    if uses_triton(q):
        return launch.attention_backward(dout, q, k, v, out, lse, options, tensors, dq, dk, dv, bias_grad)
    return cpu.attention_backward(dout, q, k, v, out, lse, options, tensors, dq, dk, dv, bias_grad), None


def _bwd_fake(dout, q, k, v, out, lse, dq, dk, dv, bias_grad, *arguments):
    tensors, _ = _fields(arguments)
    dbias = torch.empty_like(tensors.attn_bias) if bias_grad else q.new_empty((0,), dtype=torch.float32)
    sink = tensors.learnable_sink
    return dbias, (q.new_empty((0,), dtype=torch.float32) if sink is None else torch.empty_like(sink))


# ----------------------------------------------------------------------------------------------
# torch.vmap over the operators (and so torch.func.jacrev, vmap of grad: per-sample gradients)


def _foldable(in_dims, tensors: AttentionTensors, options: AttentionOptions, shared_gradient: bool) -> bool:
    """Whether a vmapped call can run as one call whose batch is the vmapped entries' batches side by side:
    separate batch entries (not packed), no dropout (an entry's mask depends on its batch index), no
    optional tensor vmapped, a bias only if the batch shares it whole (batch dim 1) and ALiBi slopes only per
    head, and no gradient of a tensor the whole batch shares (``shared_gradient``: it would be summed
    over the vmapped entries)."""
    if tensors.is_varlen or options.dropout_p > 0 or shared_gradient:
        return False
    if any(d is not None for d in in_dims[-(_NUM_TENSORS + len(AttentionOptions._fields)):]):
        return False
    bias, slopes = tensors.attn_bias, tensors.alibi_slopes
    return (bias is None or bias.dim() < 4 or bias.shape[0] == 1) and (slopes is None or slopes.dim() == 1)


def _folded(t: torch.Tensor, dim, size: int) -> torch.Tensor:
    """``t`` with its vmapped dim ``dim`` (None: not vmapped, repeated) joined to its batch dim."""
    t = t.movedim(dim, 0) if dim is not None else t.expand(size, *t.shape)
    return t.reshape(size * t.shape[1], *t.shape[2:])


def _folded_buffer(t: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """A buffer the operator writes, its vmapped dim first, with that dim joined to its batch dim → (a view
    of it where the layout allows, else a copy to be copied back; whether it is a copy)."""
    shape = (t.shape[0] * t.shape[1], *t.shape[2:])
    try:
        return t.view(shape), False
    except RuntimeError:
        return t.reshape(shape), True


def _slices(arguments, in_dims, i: int) -> list:
    return [a if d is None else a.select(d, i) for a, d in zip(arguments, in_dims)]


def _fwd_vmap(info, in_dims, q, k, v, *arguments):
    tensors, options = _fields(arguments)
    size = info.batch_size
    if size > 0 and not _foldable(in_dims, tensors, options, False):  # entry by entry (no entry: folded)
        outputs = [fwd_op(*_slices((q, k, v, *arguments), in_dims, i)) for i in range(size)]
        return tuple(torch.stack(parts) for parts in zip(*outputs)), (0, 0)
    out, lse = fwd_op(*(_folded(t, d, size) for t, d in zip((q, k, v), in_dims)), *arguments)
    # each entry's batch (its tokens, packed: folded only with no entry), lse's dim 1 where packed
    rows = q.shape[0] if in_dims[0] is None else q.shape[1 if in_dims[0] == 0 else 0]
    lse_axis = 1 if tensors.is_varlen else 0
    return (out.unflatten(0, (size, rows)), lse.unflatten(lse_axis, (size, rows))), (0, lse_axis)


def _bwd_vmap(info, in_dims, dout, q, k, v, out, lse, dq, dk, dv, bias_grad, *arguments):
    tensors, options = _fields(arguments)
    size = info.batch_size
    if any(d is None for d in in_dims[6:9]):
        raise ValueError("flashtile::bwd under torch.vmap: dq, dk and dv must be vmapped like its inputs "
                         "(the gradients differ per vmapped entry)")
    shared_gradient = bias_grad or tensors.learnable_sink is not None
    if size > 0 and not _foldable(in_dims, tensors, options, shared_gradient):  # entry by entry, into views of dq, dk, dv
        outputs = [bwd_op(*_slices((dout, q, k, v, out, lse, dq, dk, dv, bias_grad, *arguments), in_dims, i))
                   for i in range(size)]
        return tuple(torch.stack(parts) for parts in zip(*outputs)), (0, 0)
    grads = [g.movedim(d, 0) for g, d in zip((dq, dk, dv), in_dims[6:9])]
    folded, copied = zip(*(_folded_buffer(g) for g in grads))  # views where the layout allows, else copies
    empty = bwd_op(*(_folded(t, d, size) for t, d in zip((dout, q, k, v, out, lse), in_dims)), *folded,
                   bias_grad, *arguments)
    for grad, written, copy in zip(grads, folded, copied):
        if copy:
            grad.copy_(written.view(grad.shape))
    return empty, (None, None)


# ----------------------------------------------------------------------------------------------
# flashtile::fwd's own autograd formula, for graphs that hold the operator where no Function was recorded:
# torch.compile over torch.func.grad shows the call tensors that do not say they need a gradient, so
# flashtile.autograd leaves the Function out and the traced graph holds the bare operator. Eager calls never
# reach it (they skip the dispatcher, or run the operator inside the Function with gradients off).


def _fwd_setup_context(ctx, inputs, output):
    q, k, v, *arguments = inputs
    tensors, ctx.options = _fields(arguments)
    ctx.save_for_backward(q, k, v, *output, *tensors)
    ctx.mark_non_differentiable(output[1])


def _fwd_backward(ctx, dout, _dlse):
    q, k, v, out, lse, *saved = ctx.saved_tensors
    tensors = AttentionTensors(*saved)
    dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
    bias_grad = tensors.attn_bias is not None and ctx.needs_input_grad[4]
    dbias, dsink = call_bwd(dout, q, k, v, out, lse, dq, dk, dv, bias_grad, tensors, ctx.options)
    sink_grad = tensors.learnable_sink is not None and ctx.needs_input_grad[8]
    return (dq, dk, dv, None, dbias if bias_grad else None, None, None, None, dsink if sink_grad else None,
            *(None for _ in AttentionOptions._fields))


if not hasattr(torch.ops.flashtile, "fwd"):  # a reload of this module (notebook autoreload) keeps the first
    _LIBRARY = torch.library.Library("flashtile", "DEF")  # registrations live as long as this object
    # pt2_compliant_tag: what custom_op would add, and what torch.compile's strict op check asks for
    for _name, _kernel, _fake in (("fwd", _fwd, _fwd_fake), ("bwd", _bwd, _bwd_fake)):
        _LIBRARY.define(_SCHEMAS[_name], tags=(torch.Tag.pt2_compliant_tag,))
        _LIBRARY.impl(_name, _kernel, "CompositeExplicitAutograd")
        torch.library.register_fake(f"flashtile::{_name}", _fake, lib=_LIBRARY)
    torch.library.register_vmap("flashtile::fwd", _fwd_vmap, lib=_LIBRARY)
    torch.library.register_vmap("flashtile::bwd", _bwd_vmap, lib=_LIBRARY)
    torch.library.register_autograd("flashtile::fwd", _fwd_backward, setup_context=_fwd_setup_context, lib=_LIBRARY)

fwd_op = torch.ops.flashtile.fwd.default
bwd_op = torch.ops.flashtile.bwd.default


def _plain_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Plain tensors with data, in an eager call: not while torch.compile traces (checked first: Dynamo must
    see the operator) or ``torch.jit.trace`` records (the trace must hold the operator, not the path one
    call took), not on meta tensors (the operator's fake kernel gives their shapes), not under a functorch
    transform."""
    return (not torch.compiler.is_compiling() and type(q) is torch.Tensor and type(k) is torch.Tensor
            and type(v) is torch.Tensor and not q.is_meta and not torch._C._get_tracing_state()
            and not torch._C._are_functorch_transforms_active())


def _observed() -> bool:
    """A torch function or dispatch mode (fake tensors, FlopCounterMode) or a profiler is active: they
    see, and name, the operators."""
    return (torch._C._is_torch_function_mode_enabled() or torch._C._len_torch_dispatch_stack() > 0
            or torch._C._autograd._profiler_enabled())


def direct(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether a call on ``q``, ``k``, ``v`` may run its operator's kernel (``_forward``, ``_backward``, ...)
    without the dispatcher, which would only find that same kernel and costs ~4 µs of a CPU core per call
    (~13 µs on an H100 host; benchmarks/NOTES.md, "Host time"): a plain eager call (:func:`_plain_call`),
    no gradient asked of q, nothing observing the operators (:func:`_observed`)."""
    return not (q.requires_grad and torch.is_grad_enabled()) and _plain_call(q, k, v) and not _observed()


def differentiable(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tensors: AttentionTensors,
                   options: AttentionOptions) -> bool:
    """Whether an eager call that wants gradients may leave them to PyTorch's own autograd: on the CPU path
    (not :func:`uses_triton`, asked last, as the other answers are pure: the calls that PyTorch's kernel does
    not compute both ways, short 16-bit ones, read the environment once, in their forward; :func:`_plain_call`
    first, so that torch.compile traces nothing on shapes here), where PyTorch's fused kernel computes the call
    forward and backward in the inputs' dtype
    (``cpu.differentiable_applies``), its C++ backward node does what ``flashtile.autograd``'s Python
    Function would, with the same kernels, without that Function's host time and its copies of the
    gradients into buffers (benchmarks/NOTES.md, thirteenth session, "The CPU path: PyTorch's autograd
    where its kernel computes the call"). Not for calls with nothing to attend (PyTorch's kernel divides
    by zero on empty inputs; the operator gives their zeros). Modes and profilers (:func:`_observed`) do
    not change the answer: the graph a call records must not depend on them (a non-reentrant checkpoint
    recomputes the forward without the mode the first forward ran under, and compares what both saved)."""
    return (_plain_call(q, k, v) and cpu.differentiable_applies(q, k, v, options, tensors)
            and not _attends_nothing(q, k, tensors) and not uses_triton(q))


def differentiable_fwd(q, k, v, tensors: AttentionTensors, options: AttentionOptions):
    """The forward of a call :func:`differentiable` accepts → (out, lse): out differentiable by PyTorch's
    autograd, lse not (PyTorch's kernel declares it so)."""
    return cpu.fused_attention_forward(q, k, v, options, tensors.attn_bias)


def call_fwd(q, k, v, tensors: AttentionTensors, options: AttentionOptions):
    """``fwd_op(q, k, v, *tensors, *options)``: its kernel directly where :func:`direct` allows, else the
    operator."""
    if direct(q, k, v):
        return _forward(q, k, v, _prepared(tensors), options)
    return fwd_op(q, k, v, *tensors, *options)


def call_bwd(dout, q, k, v, out, lse, dq, dk, dv, bias_grad: bool, tensors: AttentionTensors,
             options: AttentionOptions):
    """``bwd_op(..., bias_grad, *tensors, *options)``: its kernel directly where :func:`direct` allows,
    else the operator."""
    if direct(q, k, v):
        return _backward(dout, q, k, v, out, lse, dq, dk, dv, bias_grad, _prepared(tensors), options)
    return bwd_op(dout, q, k, v, out, lse, dq, dk, dv, bias_grad, *tensors, *options)


# ----------------------------------------------------------------------------------------------
# Non-differentiable entry points, for code that composes attention calls itself (ring attention)


def _refuse_autograd(*tensors) -> None:
    # the operators have no autograd formula (flashtile.autograd is the differentiable layer), and
    # PyTorch's fallback would only warn at backward time and leave the gradients None
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        raise RuntimeError("flashtile.ops.attention_forward/attention_backward are not differentiable: call them "
                           "under torch.no_grad() or inside an autograd.Function, or use flash_attn_func")


def _seed_tensor(dropout_seed, device):
    if isinstance(dropout_seed, int):
        return torch.tensor([dropout_seed], dtype=torch.int64, device=device)
    return dropout_seed


def attention_forward(q, k, v, softmax_scale: float, causal: bool, *, window_size=(-1, -1), softcap=0.0,
                      alibi_slopes=None, attn_bias=None, dropout_p=0.0, dropout_seed=None, learnable_sink=None):
    """One attention call's forward, no autograd: (q, k, v) → (out, lse).

    ``dropout_seed``: an int, or an int64 tensor of one element (needed when dropout_p > 0);
    ``learnable_sink``: float32 (nheads,) logits in the denominator (the lse includes them).
    """
    _refuse_autograd(q, k, v, alibi_slopes, attn_bias, learnable_sink)
    options = AttentionOptions(softmax_scale, *fold_causal(window_size, causal), softcap, dropout_p)
    tensors = AttentionTensors(alibi_slopes, attn_bias, _seed_tensor(dropout_seed, q.device),
                               learnable_sink=learnable_sink)
    return call_fwd(q, k, v, tensors, options)


def attention_backward(dout, q, k, v, out, lse, softmax_scale: float, causal: bool, *, window_size=(-1, -1),
                       softcap=0.0, alibi_slopes=None, dropout_p=0.0, dropout_seed=None, deterministic=False,
                       learnable_sink=None):
    """→ (dq, dk, dv), with P rebuilt from ``lse`` and D = rowsum(dout ∘ out); with ``learnable_sink``
    (whose mass ``lse`` includes) also its gradient over these rows, last.

    ``out`` and ``lse`` may be those of a larger attention that this call is a part of
    (ring attention): the gradients are then this part's share. ``deterministic``: bitwise
    identical gradients run to run (the fused sm_90 backward, which sums dQ with atomic
    adds, is then not used).
    """
    _refuse_autograd(dout, q, k, v, out, lse, alibi_slopes)
    options = AttentionOptions(softmax_scale, *fold_causal(window_size, causal), softcap, dropout_p,
                               deterministic=bool(deterministic))
    tensors = AttentionTensors(alibi_slopes, None, _seed_tensor(dropout_seed, q.device),
                               learnable_sink=learnable_sink)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    _, dsink = call_bwd(dout, q, k, v, out, lse, dq, dk, dv, False, tensors, options)
    return (dq, dk, dv) if learnable_sink is None else (dq, dk, dv, dsink)


# ----------------------------------------------------------------------------------------------
# KV-cache forward and merging, by device


def _kvcache_append(k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table, cu_seqlens_new,
                    max_seqlen_new, k_descale, v_descale, rotary_cos, rotary_sin, rotary_interleaved) -> None:
    if uses_triton(k):
        launch.kvcache_append(k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table, cu_seqlens_new,
                              max_seqlen_new, k_descale, v_descale, rotary_cos, rotary_sin, rotary_interleaved)
        return
    if rotary_cos is not None:
        rows = k.shape[0] if cu_seqlens_new is not None else k.shape[1]
        positions = reference.rotary_positions(cache_seqlens, rows, rotary_cos.shape[0], cu_seqlens_new)
        k = reference.apply_rotary(k, rotary_cos, rotary_sin, positions, rotary_interleaved)
    reference.kvcache_append_reference(k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table,
                                       cu_seqlens_new, k_descale, v_descale)


def _kvcache_append_fake(*arguments) -> None:
    return None


def _kvcache_fwd(q, k_cache, v_cache, seqlens_k, cache_batch_idx, block_table, softmax_scale, window_left,
                 window_right, softcap, alibi_slopes, num_splits, learnable_sink, cu_seqlens_q, max_seqlen_q,
                 cache_leftpad, k_descale, v_descale, rotary_cos, rotary_sin, rotary_start, rotary_interleaved,
                 out=None):
    options = AttentionOptions(softmax_scale, window_left, window_right, softcap)
    if uses_triton(q):
        return launch.kvcache_attention_forward(q, k_cache, v_cache, seqlens_k, cache_batch_idx, block_table,
                                                options, alibi_slopes, num_splits, learnable_sink=learnable_sink,
                                                cu_seqlens_q=cu_seqlens_q, max_seqlen_q=max_seqlen_q,
                                                cache_leftpad=cache_leftpad, k_descale=k_descale, v_descale=v_descale,
                                                out=out, rotary_cos=rotary_cos, rotary_sin=rotary_sin,
                                                rotary_start=rotary_start, rotary_interleaved=rotary_interleaved)
    if rotary_cos is not None:
        rows = q.shape[0] if cu_seqlens_q is not None else q.shape[1]
        positions = reference.rotary_positions(rotary_start, rows, rotary_cos.shape[0], cu_seqlens_q,
                                               at_start=options.window == (-1, -1))
        q = reference.apply_rotary(q, rotary_cos, rotary_sin, positions, rotary_interleaved)
    result, lse = reference.kvcache_attention_reference(
        q, k_cache, v_cache, seqlens_k, cache_batch_idx, block_table, softmax_scale, False,
        options.window, softcap, alibi_slopes, compute_dtype=torch.float32, learnable_sink=learnable_sink,
        cu_seqlens_q=cu_seqlens_q, cache_leftpad=cache_leftpad, k_descale=k_descale, v_descale=v_descale,
    )
    # the CPU path computes in float32: its result is rounded into out (the GPU kernels write out directly)
    return (result.to(q.dtype) if out is None else out.copy_(result)), lse.float()


def _kvcache_fwd_out(q, k_cache, v_cache, seqlens_k, *arguments):
    *call, out = arguments
    return _kvcache_fwd(q, k_cache, v_cache, seqlens_k, *call, out=out)[1]


def _kvcache_fwd_out_fake(q, k_cache, v_cache, seqlens_k, *arguments):
    return _kvcache_fwd_fake(q, k_cache, v_cache, seqlens_k, *arguments[:-1])[1]


def _kvcache_fwd_fake(q, k_cache, v_cache, seqlens_k, cache_batch_idx, block_table, softmax_scale, window_left,
                      window_right, softcap, alibi_slopes, num_splits, learnable_sink, cu_seqlens_q, *rest):
    out = q.new_empty(out_shape(q, v_cache))
    if cu_seqlens_q is not None:  # packed: lse (Hq, total_q)
        return out, q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)
    return out, q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32)


_KVCACHE_SCHEMAS = {
    "kvcache_append": "kvcache_append(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor k, Tensor v, "
                      "Tensor cache_seqlens, Tensor? cache_batch_idx, Tensor? block_table, Tensor? cu_seqlens_new, "
                      "SymInt max_seqlen_new, Tensor? k_descale, Tensor? v_descale, Tensor? rotary_cos, "
                      "Tensor? rotary_sin, bool rotary_interleaved) -> ()",
}
_KVCACHE_CALL = ("Tensor q, Tensor k_cache, Tensor v_cache, Tensor seqlens_k, Tensor? cache_batch_idx, "
                 "Tensor? block_table, float softmax_scale, SymInt window_left, SymInt window_right, float softcap, Tensor? alibi_slopes, "
                 "SymInt num_splits, Tensor? learnable_sink, Tensor? cu_seqlens_q, SymInt max_seqlen_q, "
                 "Tensor? cache_leftpad, Tensor? k_descale, Tensor? v_descale, Tensor? rotary_cos, "
                 "Tensor? rotary_sin, Tensor? rotary_start, bool rotary_interleaved")
_KVCACHE_SCHEMAS["kvcache_fwd"] = f"kvcache_fwd({_KVCACHE_CALL}) -> (Tensor, Tensor)"
# the same call writing its output into ``out`` (an engine's preallocated buffer); returns the lse
_KVCACHE_SCHEMAS["kvcache_fwd_out"] = f"kvcache_fwd_out({_KVCACHE_CALL}, Tensor(c!) out) -> Tensor"
if not hasattr(torch.ops.flashtile, "kvcache_fwd"):  # as the attention operators above
    _KVCACHE_LIBRARY = torch.library.Library("flashtile", "FRAGMENT")
    for _name, _kernel, _fake in (("kvcache_append", _kvcache_append, _kvcache_append_fake),
                                  ("kvcache_fwd", _kvcache_fwd, _kvcache_fwd_fake),
                                  ("kvcache_fwd_out", _kvcache_fwd_out, _kvcache_fwd_out_fake)):
        _KVCACHE_LIBRARY.define(_KVCACHE_SCHEMAS[_name], tags=(torch.Tag.pt2_compliant_tag,))
        _KVCACHE_LIBRARY.impl(_name, _kernel, "CompositeExplicitAutograd")
        torch.library.register_fake(f"flashtile::{_name}", _fake, lib=_KVCACHE_LIBRARY)


def kvcache_append(k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx=None, block_table=None,
                   cu_seqlens_new=None, max_seqlen_new: int = 0, k_descale=None, v_descale=None, rotary_cos=None,
                   rotary_sin=None, rotary_interleaved: bool = False) -> None:
    """Write k, v [B, Sn, Hk, D] (or packed [total_new, Hk, D] with ``cu_seqlens_new``) into the caches
    in place at cache_seqlens[b] + 0..Sn-1; a write outside the cache is dropped (the Triton kernel,
    or the reference's indexing on the CPU path); a float8 cache stores them divided by its scales;
    with ``rotary_cos``/``rotary_sin``, k is stored rotated at its positions (``reference.rotary``).
    The operator ``flashtile::kvcache_append`` (it mutates the caches; torch.compile traces it)."""
    torch.ops.flashtile.kvcache_append(k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table,
                                       cu_seqlens_new, max_seqlen_new, k_descale, v_descale, rotary_cos, rotary_sin,
                                       rotary_interleaved)


def kvcache_attention(q, k_cache, v_cache, seqlens_k, cache_batch_idx, block_table, options: AttentionOptions,
                      alibi_slopes=None, num_splits: int = 0, learnable_sink=None, cu_seqlens_q=None,
                      max_seqlen_q: int = 0, cache_leftpad=None, k_descale=None, v_descale=None, out=None,
                      rotary_cos=None, rotary_sin=None, rotary_start=None, rotary_interleaved: bool = False):
    """Attention of q against each sequence's first ``seqlens_k[b]`` cached keys (after any append):
    the split-KV Triton kernel, or per sequence through the reference in float32 on the CPU path.
    → (out in q's dtype, lse [B, Hq, Sq] float32); with ``cu_seqlens_q`` q is packed [total_q, Hq, D]
    and → (out [total_q, Hq, Dv], lse [Hq, total_q]); ``cache_leftpad`` [B]: each sequence's first key slot;
    ``k_descale``, ``v_descale`` [B, Hk]: a float8 cache's scales; ``rotary_cos``, ``rotary_sin`` and
    ``rotary_start`` [B] (the cache lengths before the append): q rotated at its positions
    (``reference.rotary_positions``; all at the start for full attention). The operator ``flashtile::kvcache_fwd``
    (no autograd; its fake implementation gives the shapes to torch.compile); with ``out``,
    ``flashtile::kvcache_fwd_out``, which writes the output there → (out, lse)."""
    call = (q, k_cache, v_cache, seqlens_k, cache_batch_idx, block_table, options.softmax_scale, options.window_left,
            options.window_right, options.softcap, alibi_slopes, num_splits, learnable_sink, cu_seqlens_q,
            max_seqlen_q, cache_leftpad, k_descale, v_descale, rotary_cos, rotary_sin, rotary_start,
            bool(rotary_interleaved))
    if direct(q, k_cache, v_cache):
        result, lse = _kvcache_fwd(*call, out=out)
        return (result if out is None else out), lse
    if out is None:
        return torch.ops.flashtile.kvcache_fwd(*call)
    return out, torch.ops.flashtile.kvcache_fwd_out(*call, out)


def merge_states(outs: torch.Tensor, lses: torch.Tensor, out: torch.Tensor | None = None,
                 out_dtype: torch.dtype | None = None):
    """outs [P, ..., S, H, D], lses [P, ..., H, S] → (out [..., S, H, D], lse [..., H, S] float32): the
    Triton kernel, or the PyTorch formula on the CPU path and for inputs that need grad (the kernel
    has no backward). The merge runs in float32 and is rounded once, into ``out`` where given (written in
    place), else into a new tensor of ``out_dtype`` (default outs' dtype)."""
    # autograd sees a merge only through the formula: the kernel has no backward, and an in-place write
    # into an ``out`` that autograd tracks must be its copy_ (which refuses a leaf that needs grad)
    needs_grad = torch.is_grad_enabled() and (outs.requires_grad or lses.requires_grad
                                              or (out is not None and out.requires_grad))
    if needs_grad or not uses_triton(outs):
        merged, lse = reference.merge_split_states(outs, lses, out.dtype if out is not None else out_dtype)
        return (merged if out is None else out.copy_(merged)), lse
    num_parts, seqlen, nheads, head_dim = outs.shape[0], *outs.shape[-3:]
    lead = math.prod(outs.shape[1:-3])  # spelled out, not -1: a reshape cannot infer it when a size is 0
    if out is None:
        out = torch.empty(outs.shape[1:], dtype=out_dtype or outs.dtype, device=outs.device)
    lse = torch.empty(lses.shape[1:], dtype=torch.float32, device=outs.device)
    launch.merge_states_into(
        outs.reshape(num_parts, lead, seqlen, nheads, head_dim), lses.reshape(num_parts, lead, nheads, seqlen),
        out.view(lead, seqlen, nheads, head_dim), lse.view(lead, nheads, seqlen),
    )
    torch.autograd.graph.increment_version(out)  # written in place: a graph that saved it must see the change
    return out, lse
