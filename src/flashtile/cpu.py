"""The CPU path's fast case: PyTorch's own fused CPU attention, where its semantics are flashtile's.

PyTorch's flash-attention CPU kernel (``aten::_scaled_dot_product_flash_attention_for_cpu`` and its
backward; what ``scaled_dot_product_attention`` runs on a CPU) computes the same online softmax,
returns the same natural-log log-sum-exp, and rebuilds P from a given log-sum-exp in its backward,
so it can stand in for the tiled reference wherever the two agree exactly:

* no variant: no sliding window, softcap, ALiBi, bias or dropout (PyTorch draws its own dropout
  mask; flashtile's is Philox, regenerated in the backward);
* full attention, or causal attention with seqlen_q = seqlen_k (PyTorch aligns causal masks to the
  top-left corner, flashtile to the bottom-right: the two coincide only on square masks) or with
  seqlen_q = 1 (a decoding step: its one query sees every key, which is full attention). A packed
  batch runs sequence by sequence, each as a call of its own would: fused where that sequence
  qualifies, the tiled reference where it does not, so packing never changes a sequence's result.

Inputs are widened to float32 before the call (exactly: every bfloat16 and float16 is a float32),
as flashtile's kernels compute: on 16-bit inputs PyTorch's kernel returned log-sum-exps ~5e-5 off
float64 (measured at 2×4×37×40), where flashtile keeps them within 1e-5. The speed of that choice is
in benchmarks/NOTES.md, "The CPU path". GQA/MQA repeat K/V over the query group (O(N) memory) and
sum dK/dV back over it. Everything else runs ``flashtile.reference``'s tiled algorithm.
"""

from __future__ import annotations

import torch

from . import reference
from ._options import AttentionOptions, AttentionTensors

__all__ = ["fused_applies", "fused_attention_backward", "fused_attention_forward", "varlen_attention_backward",
           "varlen_attention_forward"]

_FORWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def _pytorch_causal(options: AttentionOptions, seqlen_q: int, seqlen_k: int) -> bool | None:
    """PyTorch's ``is_causal`` (top-left) that gives flashtile's mask, or None if none does."""
    if options.window == (-1, -1) or (options.window == (-1, 0) and seqlen_q == 1):
        return False
    if options.window == (-1, 0) and seqlen_q == seqlen_k:
        return True
    return None


def fused_applies(q: torch.Tensor, k: torch.Tensor, options: AttentionOptions, tensors: AttentionTensors) -> bool:
    """Whether this module computes the call: q [B, Nq, Hq, D], k [B, Nk, Hk, D] that PyTorch's fused
    kernel computes exactly, or a packed batch (total, H, D) of full or causal attention without
    variants (:func:`varlen_attention_forward` then picks the path per sequence)."""
    variants = (tensors.alibi_slopes, tensors.attn_bias, tensors.dropout_seed)
    if any(t is not None for t in variants) or options.softcap != 0 or options.dropout_p != 0:
        return False
    if tensors.is_varlen:
        return options.window in ((-1, -1), (-1, 0))
    return _pytorch_causal(options, q.shape[1], k.shape[1]) is not None


def _heads_first(t: torch.Tensor, group: int = 1) -> torch.Tensor:
    """[B, N, H, D] → float32 [B, H·group, N, D] (K/V repeated over a GQA group of queries)."""
    t = t.transpose(1, 2).float()
    return t.repeat_interleave(group, dim=1) if group > 1 else t


def fused_attention_forward(q, k, v, options: AttentionOptions):
    """→ (out like q, lse [B, Hq, Nq] float32, natural log), for a call :func:`fused_applies` accepts."""
    group = q.shape[2] // k.shape[2]
    causal = _pytorch_causal(options, q.shape[1], k.shape[1])
    out, lse = _FORWARD(_heads_first(q), _heads_first(k, group), _heads_first(v, group), 0.0, causal,
                        scale=options.softmax_scale)
    return out.transpose(1, 2).to(q.dtype).contiguous(), lse


def fused_attention_backward(dout, q, k, v, out, lse, options: AttentionOptions):
    """→ (dq, dk, dv) in the inputs' layouts (float32), P rebuilt from ``lse``."""
    group = q.shape[2] // k.shape[2]
    causal = _pytorch_causal(options, q.shape[1], k.shape[1])
    dq, dk, dv = _BACKWARD(_heads_first(dout), _heads_first(q), _heads_first(k, group), _heads_first(v, group),
                           _heads_first(out), lse.contiguous(), 0.0, causal, scale=options.softmax_scale)
    if group > 1:  # the gradient of repeat_interleave: sum over each KV head's group of query heads
        dk, dv = (g.unflatten(1, (k.shape[2], group)).sum(2) for g in (dk, dv))
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


def _sequences(tensors: AttentionTensors):
    """(q rows, k rows) of each sequence of a packed batch that has queries and keys: a sequence
    without either keeps output 0 and log-sum-exp −inf (zero gradients). cu_seqlens are CPU tensors
    here: reading them costs no sync."""
    starts_q, starts_k = tensors.cu_seqlens_q.tolist(), tensors.cu_seqlens_k.tolist()
    for b in range(len(starts_q) - 1):
        rows_q, rows_k = slice(starts_q[b], starts_q[b + 1]), slice(starts_k[b], starts_k[b + 1])
        if rows_q.stop > rows_q.start and rows_k.stop > rows_k.start:
            yield rows_q, rows_k


def _heads_second(t: torch.Tensor) -> torch.Tensor:
    """[1, N, H, D] ↔ the reference's [1, H, N, D]."""
    return t.transpose(1, 2)


def varlen_attention_forward(q, k, v, options: AttentionOptions, tensors: AttentionTensors):
    """Packed (total, H, D) → (out like q, lse [Hq, total_q] float32), each sequence as its own call."""
    out = torch.zeros_like(q)
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float32, device=q.device)
    for rows_q, rows_k in _sequences(tensors):
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
    for rows_q, rows_k in _sequences(tensors):
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
