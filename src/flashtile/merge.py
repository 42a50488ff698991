"""Merging partial attention results through their log-sum-exps.

Attention over a key set split into disjoint parts ``K = K_1 ∪ … ∪ K_P`` is
recovered exactly from the parts' normalised outputs ``O_p`` and natural-log
log-sum-exps ``L_p``::

    L = log Σ_p exp(L_p),        O = Σ_p exp(L_p − L) · O_p.

This is the online-softmax merge (``reference.merge_softmax_states``) written
for normalised outputs; it is what split-KV decoding, ring attention and prefix
caching use. It is associative and order-free; a part with ``L_p = −inf`` (no
visible key) contributes nothing, and if every part is −inf the result is
output 0 and log-sum-exp −inf. ``L_p = +inf`` (flash-attn 2's mark of a row that saw no
key) counts as −inf: an empty part, not NaN.

Layout (flash-attn's): outputs ``[..., seqlen, nheads, headdim]`` and
log-sum-exps ``[..., nheads, seqlen]``, float32. The weights and the sum are formed in
float32; the merged output has the dtype of the inputs' outputs (``flash_attn_combine``: the
``out``/``out_dtype`` asked for, rounded once).

Two implementations of the same formula, chosen by ``flashtile.ops.merge_states``: a Triton
kernel (``flashtile.triton.merge``; CUDA tensors, and CPU tensors under ``TRITON_INTERPRET=1``)
and the PyTorch expression ``reference.merge_split_states`` (CPU, and any input that requires
grad: the kernel has no backward).
"""

from __future__ import annotations

import torch

from . import _validate, ops

__all__ = ["flash_attn_combine", "merge_attention_states", "merge_split_attention_states"]


def merge_split_attention_states(outs: torch.Tensor, lses: torch.Tensor):
    """Merge P partial results stacked on a leading split dimension.

    Arguments:
        outs: [P, ..., seqlen, nheads, headdim], the parts' normalised outputs (any float dtype).
        lses: [P, ..., nheads, seqlen], their natural-log log-sum-exps (−inf for a part that saw no key).

    Returns:
        (out [..., seqlen, nheads, headdim] in outs' dtype, lse [..., nheads, seqlen] float32).
    """
    _validate.check_states(outs, lses)
    return ops.merge_states(outs, lses)


def merge_attention_states(out_a, lse_a, out_b, lse_b):
    """Merge two partial results over disjoint key sets; see the module docstring.

    Arguments:
        out_a, out_b: [..., seqlen, nheads, headdim].
        lse_a, lse_b: [..., nheads, seqlen], natural log.

    Returns:
        (out, lse) of the same shapes; lse float32.
    """
    _validate.check_state_pair(out_a, lse_a, out_b, lse_b)
    return merge_split_attention_states(torch.stack((out_a, out_b)), torch.stack((lse_a, lse_b)))


def flash_attn_combine(out_partial: torch.Tensor, lse_partial: torch.Tensor, out: torch.Tensor | None = None,
                       out_dtype: torch.dtype | None = None):
    """FlashAttention-3's combine: merge split-KV partial results, in FA3's layouts.

    Arguments:
        out_partial: (num_splits, batch, seqlen, nheads, headdim), the splits' normalised outputs.
        lse_partial: (num_splits, batch, seqlen, nheads), their natural-log log-sum-exps (−inf, or
            +inf as flash-attn 2 writes it, for a split that saw no key).
        out: optional (batch, seqlen, nheads, headdim) float16/bfloat16/float32 tensor to write the result into.
        out_dtype: the result's dtype, float16, bfloat16 or float32; default ``out``'s, else out_partial's
            (with ``out`` given, it must be out's, as in FA3).

    Returns:
        (out (batch, seqlen, nheads, headdim), lse (batch, seqlen, nheads) float32); rows whose
        splits are all empty give 0 and −inf.
    """
    _validate.check_combine(out_partial, lse_partial, out, out_dtype)
    # merged in float32 and rounded once, to the result's dtype (a float32 result of 16-bit partials keeps
    # float32's precision), straight into ``out`` where given
    out, lse = ops.merge_states(out_partial, lse_partial.transpose(-1, -2), out=out, out_dtype=out_dtype)
    return out, lse.transpose(-1, -2)
