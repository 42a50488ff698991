"""The CPU path (:func:`attention_forward`, :func:`attention_backward`): PyTorch's own fused CPU attention
where its semantics are flashtile's, ``flashtile.reference``'s tiled algorithm everywhere else.

PyTorch's flash-attention CPU kernel (``aten::_scaled_dot_product_flash_attention_for_cpu`` and its
backward; what ``scaled_dot_product_attention`` runs on a CPU) computes the same online softmax,
returns the same natural-log log-sum-exp, and rebuilds P from a given log-sum-exp in its backward,
so it can stand in for the tiled reference wherever the two agree exactly:

* no variant but an additive bias (SDPA's attn_mask, whose gradient is not asked for): no sliding
  window, softcap, ALiBi or dropout (PyTorch draws its own dropout mask; flashtile's is Philox,
  regenerated in the backward);
* full attention, or causal attention with seqlen_q = seqlen_k (PyTorch aligns causal masks to the
  top-left corner, flashtile to the bottom-right: the two coincide only on square masks) or with
  seqlen_q = 1 (a decoding step: its one query sees every key, which is full attention). A packed
  batch runs sequence by sequence, each as a call of its own would: fused where that sequence
  qualifies, the tiled reference where it does not, so packing never changes a sequence's result.

Inputs are widened to float32 before the call (exactly: every bfloat16 and float16 is a float32),
as flashtile's kernels compute, wherever the caller reads the log-sum-exp: on 16-bit inputs
PyTorch's kernel returned log-sum-exps ~5e-5 off float64 (measured at 2×4×37×40 and 2×4×113×64),
where flashtile keeps them within 1e-5. A call that does not return it (``options.returns_lse``
False: the default of the public functions) runs PyTorch's 16-bit kernel as SDPA does, forward and
backward, consistently with its own log-sum-exp: its outputs and gradients meet flash-attn's rule
(tests/test_flash_attn.py), at 16-bit speed (benchmarks/NOTES.md, "The CPU path"); the backward of
short sequences, and every backward on a CPU without 16-bit arithmetic, runs in float32, which PyTorch
computes faster there (:data:`SHORT_BACKWARD_SEQLEN`, :func:`computes_16bit_natively`); a call
that runs both ways in the inputs' own dtype takes its gradients from PyTorch's autograd of the kernel
(:func:`differentiable_applies`). GQA/MQA run
without K/V copies where the mask allows (:class:`_Layout`).
Everything else runs ``flashtile.reference``'s tiled algorithm (O(N) memory). ``flashtile.attention``,
SDPA's drop-in, leaves the calls that SDPA computes exactly as this module would to SDPA itself
(:func:`sdpa_attention`).
"""

from __future__ import annotations

import functools

import torch

from . import reference
from ._options import NO_TENSORS, AttentionOptions, AttentionTensors

__all__ = ["attention_backward", "attention_forward", "differentiable_applies", "fused_applies",
           "fused_attention_backward", "fused_attention_forward", "sdpa_attention", "varlen_attention_backward",
           "varlen_attention_forward"]

# the forward through its torch binding: ~2 µs a call less than the operator handle (which the
# backward, with no binding, keeps)
_FORWARD = torch._scaled_dot_product_flash_attention_for_cpu
_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def _pytorch_causal(options: AttentionOptions, seqlen_q: int, seqlen_k: int) -> bool | None:
    """PyTorch's ``is_causal`` (top-left) that gives flashtile's mask, or None if none does."""
    window = options.window
    if window == (-1, -1) or (window == (-1, 0) and seqlen_q == 1):
        return False
    if window == (-1, 0) and seqlen_q == seqlen_k:
        return True
    return None


def fused_applies(q_shape, k_shape, head_dim_v: int, options: AttentionOptions, tensors: AttentionTensors,
                  bias_grad: bool = False) -> bool:
    """Whether this module's fused path computes a call of q [B, Nq, Hq, D], k [B, Nk, Hk, D] (their shapes)
    that PyTorch's fused kernel computes exactly — an additive bias included (SDPA's attn_mask: added to the
    scaled scores in both), unless its gradient is wanted —, or a packed batch (total, H, D) of full or
    causal attention without variants (:func:`varlen_attention_forward` picks the path per sequence).
    The kernel needs v's head dim to be q's."""
    if head_dim_v != q_shape[-1]:
        return False
    # spelled out, not any() over a generator: this runs on every call
    if (tensors.alibi_slopes is not None or tensors.dropout_seed is not None or tensors.learnable_sink is not None
            or options.softcap != 0 or options.dropout_p != 0):
        return False
    if tensors.is_varlen:
        return tensors.attn_bias is None and options.window in ((-1, -1), (-1, 0))
    causal = _pytorch_causal(options, q_shape[1], k_shape[1])
    if tensors.attn_bias is not None:
        # with a causal mask on top, a row that the bias leaves without a visible key would not be
        # told apart from one the bias empties (see fused_attention_forward's log-sum-exp)
        return not bias_grad and causal is False
    return causal is not None


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask, options: AttentionOptions,
                   learnable_sink) -> torch.Tensor | None:
    """``flashtile.attention``'s call (q, k, v in SDPA's layout (batch, nheads, seqlen, headdim), its mask
    and options validated, GQA allowed) computed by PyTorch's ``scaled_dot_product_attention``, or None
    where that would not compute it exactly as this module does. PyTorch runs the same fused kernel (its
    bool mask as the −inf bias flashtile forms; a row the mask empties gives 0) behind its own C++ layers
    instead of flashtile's Python: a padded decoding step in transformers (4 × 8:2 heads, 150 keys) ~21 µs
    against ~50. Not: dropout (PyTorch draws its own mask) or a sink (not an SDPA argument); a float mask in
    another dtype than q's (PyTorch refuses it) or whose gradient is wanted (PyTorch's math backend then
    forms the N² scores), or v's head dim unlike q's (the same; flashtile's tiled path keeps O(N) memory);
    GQA that wants gradients (PyTorch's node would keep K/V repeated over the group until the backward, see
    :func:`differentiable_applies`), or gradients that flashtile computes in float32 (:func:`_differentiated_alike`);
    causal attention with seqlen_q ∉ {1, seqlen_k} (bottom-right against
    PyTorch's top-left)."""
    if options.dropout_p != 0 or learnable_sink is not None or v.shape[-1] != q.shape[-1]:
        return None
    if attn_mask is not None and attn_mask.dtype != torch.bool and (attn_mask.dtype != q.dtype
                                                                    or attn_mask.requires_grad):
        return None
    batch, nheads_q, seqlen_q, head_dim = q.shape
    nheads_k = k.shape[1]
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad) and not (
            _differentiated_alike(q.dtype, (batch, seqlen_q, nheads_q, head_dim),
                                  (batch, k.shape[2], nheads_k, head_dim), options, attn_mask)):
        return None
    causal = _pytorch_causal(options, seqlen_q, k.shape[2])
    if causal is None:
        return None
    if attn_mask is not None and attn_mask.dim() < 2:  # SDPA wants (…, seqlen_q, seqlen_k)
        attn_mask = attn_mask.reshape(1, -1)
    # GQA as _Layout folds it, where the mask is the same for every query row and head of a group (a padding
    # mask): each group's query rows against its KV head, with no K/V repeated (~10 µs of a decoding step)
    if nheads_q != nheads_k and not causal and (attn_mask is None or (
            attn_mask.shape[-2] == 1 and (attn_mask.dim() == 2 or attn_mask.shape[-3] == 1))):
        rows = q.reshape(batch, nheads_k, nheads_q // nheads_k * seqlen_q, head_dim)
        out = torch.nn.functional.scaled_dot_product_attention(rows, k, v, attn_mask, 0.0, False,
                                                               scale=options.softmax_scale)
        return out.view(batch, nheads_q, seqlen_q, head_dim)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask, 0.0, causal,
                                                           scale=options.softmax_scale,
                                                           enable_gqa=nheads_q != nheads_k)


# Up to this many queries and keys, PyTorch's 16-bit CPU backward costs more than its float32 one with
# the conversions: a training step's backward 0.55-0.8x the 16-bit one at seqlen 128, 1.07-1.42x at 256
# (bf16, 2 cores, torch 2.13; benchmarks/NOTES.md, "The CPU backward's dtype"). Its 16-bit forward is
# 2-5x faster than float32 at every size, so the forward stays 16-bit.
SHORT_BACKWARD_SEQLEN = 128


@functools.cache
def computes_16bit_natively(dtype: torch.dtype) -> bool:
    """Whether this CPU has the instructions with which PyTorch's CPU attention computes ``dtype`` (bfloat16:
    AVX512-BF16 or AMX; float16: AMX-FP16). Without them its 16-bit backward converts block by block and runs
    6-10x slower than the float32 one with the conversions, at every seqlen (an AVX2 CPU, torch 2.13:
    benchmarks/NOTES.md, twenty-third session); the 16-bit forward stays the faster there."""
    def has(name: str) -> bool:  # torch.cpu's capability queries (private, so absent means "no")
        query = getattr(torch.cpu, name, None)
        return bool(query()) if query is not None else False
    if dtype == torch.bfloat16:
        return has("_is_avx512_bf16_supported") or has("_is_amx_tile_supported")
    return has("_is_amx_fp16_supported")


def _compute_dtype(dtype: torch.dtype, q_shape, k_shape, options: AttentionOptions, bias,
                   backward: bool) -> torch.dtype:
    """The dtype PyTorch's kernel runs in, for inputs of ``dtype`` and shapes ``q_shape``, ``k_shape``:
    their own 16-bit type where the caller does not read the log-sum-exp (and no bias, which the kernel
    would want in that type too), except a backward over short sequences (:data:`SHORT_BACKWARD_SEQLEN`)
    or on a CPU without 16-bit arithmetic (:func:`computes_16bit_natively`); else float32. A float32
    backward of a 16-bit forward rebuilds the same P: both kernels form the scores in float32 from the
    same 16-bit values."""
    native = not options.returns_lse and bias is None and dtype in (torch.float16, torch.bfloat16)
    if native and backward and (max(q_shape[1], k_shape[1]) <= SHORT_BACKWARD_SEQLEN
                                or not computes_16bit_natively(dtype)):
        return torch.float32
    return dtype if native else torch.float32


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t.to(dtype)``, without the dispatch where it is a no-op (~1 µs a call on a CPU core), with unit
    stride in the head dim: PyTorch's kernel assumes it (SDPA copies such inputs before calling it), and
    read a head dim sliced with a step, transposed or expanded as if it were contiguous."""
    t = t if t.dtype == dtype else t.to(dtype)
    return t if t.stride()[-1] == 1 else t.contiguous()  # stride() whole: ~50 ns less than stride(-1)


def differentiable_applies(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, options: AttentionOptions,
                           tensors: AttentionTensors) -> bool:
    """Whether a call that wants gradients can be left to PyTorch's autograd of its fused kernel: a call
    :func:`fused_applies` accepts (no bias gradient), not packed (its sequences are separate calls), with
    as many K/V heads as query heads, that runs both ways in the inputs' own dtype
    (:func:`_compute_dtype`): not the float32 backward of short 16-bit sequences, and not a 16-bit call
    computed in float32, whose backward PyTorch would run on the float32 output it saved where
    flashtile's runs on the rounded one it returned. Then :func:`fused_attention_forward`, run with the
    inputs' gradients on, records PyTorch's backward of the same kernel on the same tensors: the gradients
    are flashtile's own backward's, bit for bit. GQA stays with flashtile's Function: PyTorch's node would
    keep what the kernel was given until the backward, the folded output beside the returned one or K/V
    repeated over the group (+44% and +78% of a Llama-style layer's saved tensors, found by a review),
    and hand back gradients in the folded layout."""
    bias = tensors.attn_bias
    if tensors.is_varlen or not _differentiated_alike(q.dtype, q.shape, k.shape, options, bias):
        return False
    return fused_applies(q.shape, k.shape, v.shape[-1], options, tensors, _wants_grad(bias))


def _differentiated_alike(dtype: torch.dtype, q_shape, k_shape, options: AttentionOptions, bias) -> bool:
    """Whether PyTorch's autograd of its fused kernel differentiates a call of these shapes (q [B, Nq, Hq, D],
    k [B, Nk, Hk, D]) as flashtile's backward would (:func:`differentiable_applies` says why): as many K/V
    heads as query heads, and both directions in the inputs' own dtype (:func:`_compute_dtype`)."""
    return q_shape[2] == k_shape[2] and (
        _compute_dtype(dtype, q_shape, k_shape, options, bias, backward=False) == dtype
        == _compute_dtype(dtype, q_shape, k_shape, options, bias, backward=True))


class _Layout:
    """How one call's tensors meet PyTorch's kernel, which wants as many K/V heads as query heads.

    Full attention folds each GQA group of query heads into the query rows of its KV head: query
    rows are independent, so [B, Hk, G·Nq, D] against [B, Hk, Nk, D] is the same attention with no
    K/V copy, and dK/dV come out summed over the group. A causal mask depends on the row's
    position, so causal attention repeats K/V over the group instead (and sums dK/dV back).
    """

    def __init__(self, dtype: torch.dtype, q_shape, k_shape, options: AttentionOptions, bias,
                 backward: bool = False):
        self.dtype = _compute_dtype(dtype, q_shape, k_shape, options, bias, backward)
        self.batch, self.seqlen_q, self.nheads_q = q_shape[:3]
        self.nheads_k = k_shape[2]
        self.group = self.nheads_q // self.nheads_k
        self.causal = _pytorch_causal(options, q_shape[1], k_shape[1])
        if bias is not None:  # as 4-D; PyTorch's kernel takes it in its own dtype (float32 here)
            bias = bias.float()
            if bias.dim() < 4:
                bias = bias.reshape((1,) * (4 - bias.dim()) + tuple(bias.shape))
        # a bias that differs between query heads cannot follow their rows into a KV head's
        self.fold = self.group > 1 and not self.causal and (bias is None or bias.shape[1] == 1)
        if self.fold and bias is not None and bias.shape[2] > 1:  # each query head of a group: row g·Nq + i
            # a copy (repeat): with the zero strides of an expand kept, PyTorch's kernel ran ~100x slower. A
            # bias of one row (a padding mask) needs none: the kernel broadcasts a size-1 row dim over every
            # folded row, at the repeated copy's speed (a decoding step at 4×8:2×1×150, float32: the repeat ~15 µs,
            # the kernel ~24)
            bias = bias.expand(bias.shape[0], 1, self.seqlen_q, bias.shape[3]).repeat(1, 1, self.group, 1)
        self.bias = bias

    def rows(self, t: torch.Tensor) -> torch.Tensor:
        """q, out or dout [B, Nq, Hq, D] → [B, H, rows, D] in the compute dtype, as the kernel takes them."""
        t = _as(t.transpose(1, 2), self.dtype)
        return t.reshape(self.batch, self.nheads_k, self.group * self.seqlen_q, -1) if self.fold else t

    def keys(self, t: torch.Tensor) -> torch.Tensor:
        """k or v [B, Nk, Hk, D] → [B, H, Nk, D] in the compute dtype."""
        t = _as(t.transpose(1, 2), self.dtype)
        return t.repeat_interleave(self.group, dim=1) if self.group > 1 and not self.fold else t

    def unfold_rows(self, t: torch.Tensor) -> torch.Tensor:
        """The kernel's [B, H, rows, ...] → [B, Hq, Nq, ...]."""
        return t.reshape(self.batch, self.nheads_q, self.seqlen_q, *t.shape[3:]) if self.fold else t

    def output(self, out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The kernel's out [B, H, rows, Dv] → [B, Nq, Hq, Dv] contiguous in ``dtype``, with one copy at most
        (the kernel lays its out as [B, rows, H, Dv] in memory: unfolded rows are a permutation of it)."""
        if not self.fold:  # .contiguous() gives the head dim unit stride: no _as
            out = out.transpose(1, 2)
            return (out if out.dtype == dtype else out.to(dtype)).contiguous()
        # [B, Hk, G·Nq, Dv] → [B, Nq, Hk, G, Dv]: query head h = hk·G + g
        unfolded = out.unflatten(2, (self.group, self.seqlen_q)).permute(0, 3, 1, 2, 4)
        if dtype == out.dtype:  # the one copy (a reshape alone can return a strided view of the kernel's out)
            return unfolded.reshape(self.batch, self.seqlen_q, self.nheads_q, -1).contiguous()
        result = out.new_empty((self.batch, self.seqlen_q, self.nheads_q, out.shape[-1]), dtype=dtype)
        result.view(self.batch, self.seqlen_q, self.nheads_k, self.group, -1).copy_(unfolded)
        return result

    def fold_lse(self, lse: torch.Tensor) -> torch.Tensor:
        """lse [B, Hq, Nq] → the kernel's [B, H, rows]."""
        return lse.reshape(self.batch, self.nheads_k, self.group * self.seqlen_q) if self.fold else lse

    def sum_keys(self, t: torch.Tensor) -> torch.Tensor:
        """The kernel's dK or dV [B, H, Nk, D] → [B, Hk, Nk, D]."""
        return t.unflatten(1, (self.nheads_k, self.group)).sum(2) if self.group > 1 and not self.fold else t


@functools.lru_cache(maxsize=256)
def _bias_free_layout(dtype: torch.dtype, q_shape, k_shape, head_dim_v: int, options: AttentionOptions,
                      backward: bool) -> _Layout | None:
    """The :class:`_Layout` of a call without optional tensors (no bias, no variant, not packed) of this key,
    or None where PyTorch's kernel does not compute such a call (:func:`fused_applies`). It depends on the
    key alone, and a layer's calls repeat one key: decided and built once per key, not per call (~2 µs of a
    CPU core a call, more after a kernel has run)."""
    if not fused_applies(q_shape, k_shape, head_dim_v, options, NO_TENSORS):
        return None
    return _Layout(dtype, q_shape, k_shape, options, None, backward)


def _layout(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, options: AttentionOptions, bias,
            backward: bool = False) -> _Layout:
    """The :class:`_Layout` of a call :func:`fused_applies` accepts: the one of its key where it has no bias
    (the call then has no optional tensor: the fused kernel takes none but the bias), else its own."""
    if bias is None:
        return _bias_free_layout(q.dtype, q.shape, k.shape, v.shape[-1], options, backward)
    return _Layout(q.dtype, q.shape, k.shape, options, bias, backward)


def _wants_grad(t) -> bool:
    # inside autograd.Function.forward grad mode is off, but a leaf that will want its gradient
    # still says so: then the backward needs the bias gradient, which the fused kernel lacks
    return t is not None and t.requires_grad


def attention_forward(q, k, v, options: AttentionOptions, tensors: AttentionTensors):
    """The CPU path's forward of a call with something to attend → (out, lse): PyTorch's kernel where
    :func:`fused_applies` accepts the call, else the tiled reference. Layouts as ``flashtile.ops``'."""
    bias = tensors.attn_bias
    # spelled out: this runs on every call
    if (bias is None and tensors.alibi_slopes is None and tensors.dropout_seed is None
            and tensors.learnable_sink is None and not tensors.is_varlen):
        # no optional tensor: the path and the layout are its key's, decided once per key
        layout = _bias_free_layout(q.dtype, q.shape, k.shape, v.shape[-1], options, False)
        if layout is not None:
            return _fused_forward(q, k, v, options, layout, None)
    elif fused_applies(q.shape, k.shape, v.shape[-1], options, tensors, _wants_grad(bias)):
        if tensors.is_varlen:
            return varlen_attention_forward(q, k, v, options, tensors)
        return fused_attention_forward(q, k, v, options, bias)
    if tensors.is_varlen:
        out, lse = reference.tiled_varlen_attention_forward(q, k, v, tensors.cu_seqlens_q, tensors.cu_seqlens_k,
                                                            learnable_sink=tensors.learnable_sink,
                                                            **_reference_arguments(options, tensors))
        return out, lse.float()
    out, lse = reference.tiled_attention_forward(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                 learnable_sink=tensors.learnable_sink,
                                                 **_reference_arguments(options, tensors))
    return out.transpose(1, 2).contiguous(), lse.float()


def attention_backward(dout, q, k, v, out, lse, options: AttentionOptions, tensors: AttentionTensors, dq, dk, dv,
                       bias_grad: bool):
    """The CPU path's backward of a call with something to attend: writes dq, dk, dv; → the bias gradient
    where ``bias_grad``, else None. PyTorch's kernel where :func:`fused_applies` accepts the call (its
    sink aside: the log-sum-exp that P is rebuilt from includes it), else the tiled reference."""
    dbias = None
    if fused_applies(q.shape, k.shape, v.shape[-1], options, tensors._replace(learnable_sink=None), bias_grad):
        if tensors.is_varlen:
            grads = varlen_attention_backward(dout, q, k, v, out, lse, options, tensors)
        else:
            grads = fused_attention_backward(dout, q, k, v, out, lse, options, tensors.attn_bias)
    elif tensors.is_varlen:
        grads = reference.tiled_varlen_attention_backward(
            q, k, v, out, lse, dout, tensors.cu_seqlens_q, tensors.cu_seqlens_k,
            **_reference_arguments(options, tensors),
        )
    else:
        *grads, dbias = reference.tiled_attention_backward(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), out.transpose(1, 2), lse, dout.transpose(1, 2),
            **_reference_arguments(options, tensors),
        )
        grads = [grad.transpose(1, 2) for grad in grads]
        dbias = dbias.to(tensors.attn_bias.dtype) if bias_grad else None
    for buffer, grad in zip((dq, dk, dv), grads):
        buffer.copy_(grad)
    return dbias


def _reference_arguments(options: AttentionOptions, tensors: AttentionTensors) -> dict:
    seed = tensors.dropout_seed
    return dict(softmax_scale=options.softmax_scale, window_size=options.window, softcap=options.softcap,
                alibi_slopes=tensors.alibi_slopes, attn_bias=tensors.attn_bias, dropout_p=options.dropout_p,
                dropout_seed=int(seed.item()) if seed is not None else None)


def fused_attention_forward(q, k, v, options: AttentionOptions, bias=None):
    """→ (out like q, lse [B, Hq, Nq] float32, natural log), for a call :func:`fused_applies` accepts.
    The lse is contiguous where the caller reads it (``options.returns_lse``), else left as the kernel lays
    it out ([B, Nq, Hq] in memory, where it is not folded): unread but by a backward, which takes any
    layout, it is not worth a copy (~1.7 µs of a small call). A row that a bias leaves no key gets output 0,
    as flashtile's, and log-sum-exp −inf (PyTorch's kernel reports 0 there) where the caller reads it: the
    backward rebuilds such a row's P as 0 from either, and the check costs five tensor operations a call."""
    return _fused_forward(q, k, v, options, _layout(q, k, v, options, bias), bias)


def _fused_forward(q, k, v, options: AttentionOptions, layout: _Layout, bias):
    out, lse = _FORWARD(layout.rows(q), layout.keys(k), layout.keys(v), 0.0, layout.causal,
                        attn_mask=layout.bias, scale=options.softmax_scale)
    lse = layout.unfold_rows(lse)
    if options.returns_lse:
        lse = lse.contiguous()
        if bias is not None:
            lse = lse.masked_fill(torch.isneginf(bias).all(-1).expand(lse.shape), float("-inf"))
    return layout.output(out, q.dtype), lse


def fused_attention_backward(dout, q, k, v, out, lse, options: AttentionOptions, bias=None):
    """→ (dq, dk, dv) in the inputs' layouts (in the compute dtype), P rebuilt from ``lse``."""
    layout = _layout(q, k, v, options, bias, backward=True)
    # a row that sees no key: any finite lse rebuilds its P as 0 (its scores are −inf), −inf would give NaN
    lse = lse.masked_fill(torch.isneginf(lse), 0.0).contiguous()
    dq, dk, dv = _BACKWARD(layout.rows(dout), layout.rows(q), layout.keys(k), layout.keys(v), layout.rows(out),
                           layout.fold_lse(lse), 0.0, layout.causal, attn_mask=layout.bias,
                           scale=options.softmax_scale)
    dk, dv = layout.sum_keys(dk), layout.sum_keys(dv)
    return layout.unfold_rows(dq).transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


def _sequences(q, k, tensors: AttentionTensors):
    """(q rows, k rows) of each sequence of a packed batch that has queries and keys, by the kernels'
    clamping rule (``reference.sequence_slices``): a sequence without either keeps output 0 and
    log-sum-exp −inf (zero gradients). cu_seqlens are CPU tensors here: reading them costs no sync."""
    for _, rows_q, rows_k in reference.sequence_slices(tensors.cu_seqlens_q, tensors.cu_seqlens_k,
                                                        q.shape[0], k.shape[0]):
        if rows_q.stop > rows_q.start and rows_k.stop > rows_k.start:
            yield rows_q, rows_k


def _heads_second(t: torch.Tensor) -> torch.Tensor:
    """[1, N, H, D] ↔ the reference's [1, H, N, D]."""
    return t.transpose(1, 2)


def varlen_attention_forward(q, k, v, options: AttentionOptions, tensors: AttentionTensors):
    """Packed (total, H, D) → (out like q, lse [Hq, total_q] float32), each sequence as its own call."""
    out = torch.zeros_like(q)
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float32, device=q.device)
    for rows_q, rows_k in _sequences(q, k, tensors):
        q_b, k_b, v_b = q[None, rows_q], k[None, rows_k], v[None, rows_k]
        if _pytorch_causal(options, q_b.shape[1], k_b.shape[1]) is not None:
            out_b, lse_b = fused_attention_forward(q_b, k_b, v_b, options)
        else:
            out_b, lse_b = reference.tiled_attention_forward(*map(_heads_second, (q_b, k_b, v_b)),
                                                             options.softmax_scale, window_size=options.window)
            out_b = _heads_second(out_b)
        out[rows_q], lse[:, rows_q] = out_b[0], lse_b[0]
    return out, lse


def varlen_attention_backward(dout, q, k, v, out, lse, options: AttentionOptions, tensors: AttentionTensors):
    """→ (dq, dk, dv) of :func:`varlen_attention_forward`, shaped like q, k, v."""
    grads = [torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in (q, k, v)]
    for rows_q, rows_k in _sequences(q, k, tensors):
        q_b, k_b, v_b = q[None, rows_q], k[None, rows_k], v[None, rows_k]
        dout_b, out_b, lse_b = dout[None, rows_q], out[None, rows_q], lse[None, :, rows_q]
        if _pytorch_causal(options, q_b.shape[1], k_b.shape[1]) is not None:
            parts = fused_attention_backward(dout_b, q_b, k_b, v_b, out_b, lse_b, options)
        else:
            *parts, _ = reference.tiled_attention_backward(
                *map(_heads_second, (q_b, k_b, v_b, out_b)), lse_b, _heads_second(dout_b), options.softmax_scale,
                window_size=options.window)
            parts = [_heads_second(part) for part in parts]
        for grad, part, rows in zip(grads, parts, (rows_q, rows_k, rows_k)):
            grad[rows] = part[0]
    return grads
