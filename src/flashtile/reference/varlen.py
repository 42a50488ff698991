"""Variable-length batches (flash-attn's packed layout): each sequence attends alone.

q (total_q, Hq, D), k and v (total_k, Hk, D), with ``cu_seqlens_*`` int32 (batch + 1,) the
cumulative lengths. Each sequence runs through the functions of ``reference.attention`` on its
own, so masks and ALiBi are aligned per sequence, and the dropout counter uses the sequence
index as the batch index and positions within the sequence.

Sequence ``b`` is tokens ``[cu[b], cu[b + 1])`` of cu_seqlens made non-decreasing by a running
maximum (:func:`nondecreasing`), with both bounds clamped into the token axis
(:func:`sequence_slices`). This is the rule the kernels apply too (the operators of
``flashtile.ops`` and the KV-cache entry points pass them ``nondecreasing(cu)``), so that any
values, however malformed, give disjoint sequences inside the tensors and one defined result on
every path: a sequence whose bound falls below an earlier one loses the tokens before that bound (``[0, 5, 3, 10]`` is ``[0, 5, 5, 10]``), and tokens outside every
sequence keep output 0 and log-sum-exp −inf. The public functions refuse malformed cu_seqlens before
this wherever reading them is free (``flashtile._validate``).
"""

from __future__ import annotations

import itertools
import math

import torch

from .attention import compute_dtype, score_options, standard_forward, tiled_backward, tiled_forward

__all__ = ["nondecreasing", "packed_rows", "sequence_slices", "varlen_attention_forward",
           "tiled_varlen_attention_forward", "tiled_varlen_attention_backward"]


def nondecreasing(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """cu_seqlens with each value raised to the largest before it: the identity on well-formed values,
    one small kernel and no host sync on a GPU. Every path reads packed bounds through it."""
    return torch.cummax(cu_seqlens, 0).values


def packed_rows(cu_seqlens: torch.Tensor, total: int) -> list[slice]:
    """The rows of each sequence of a packed axis of ``total`` tokens: bounds made non-decreasing
    (:func:`nondecreasing`), then clamped into [0, total]."""
    bounds = [min(max(bound, 0), total) for bound in itertools.accumulate(cu_seqlens.tolist(), max)]
    return [slice(start, end) for start, end in zip(bounds, bounds[1:])]


def sequence_slices(cu_seqlens_q, cu_seqlens_k, total_q: int, total_k: int):
    """(index, q rows, k rows) of each sequence of a packed batch (:func:`packed_rows`)."""
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k differ in length: {cu_seqlens_q.numel()} vs "
                         f"{cu_seqlens_k.numel()}")
    yield from ((i, *rows) for i, rows in enumerate(zip(packed_rows(cu_seqlens_q, total_q),
                                                        packed_rows(cu_seqlens_k, total_k))))


def _sequences(q, k, cu_seqlens_q, cu_seqlens_k, attn_bias=None):
    if attn_bias is not None:
        raise NotImplementedError("attn_bias is not supported for packed (variable-length) batches")
    return sequence_slices(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0])


def _unpack(t: torch.Tensor, rows: slice) -> torch.Tensor:
    """(total, H, D) rows of one sequence → [1, H, N, D]."""
    return t[rows].transpose(0, 1)[None]


def _sequence_options(q_i, k_i, dtype, i, softmax_scale, causal, window_size, softcap, alibi_slopes, dropout_p,
                      dropout_seed, learnable_sink=None):
    slopes = alibi_slopes[i] if alibi_slopes is not None and alibi_slopes.dim() == 2 else alibi_slopes
    return score_options(q_i, k_i, dtype, softmax_scale, causal, window_size, softcap, slopes, None, dropout_p,
                         dropout_seed, first_batch=i, learnable_sink=learnable_sink)


def varlen_attention_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale=None, causal=False,
                             window_size=(-1, -1), softcap=0.0, alibi_slopes=None, dropout_p=0.0,
                             dropout_seed=None, learnable_sink=None):
    """Standard attention of each sequence of a packed batch alone. Differentiable by autograd.

    q (total_q, Hq, D), k (total_k, Hk, D) and v (total_k, Hk, Dv); cu_seqlens_* int32 (batch + 1,)
    cumulative lengths; alibi_slopes (Hq,) or (batch, Hq). Masks and ALiBi are
    aligned per sequence; the dropout counter uses the sequence index as the batch
    index and positions within the sequence. Returns (out (total_q, Hq, Dv),
    lse (Hq, total_q)).
    """
    outs, lses = [], []
    for i, rows_q, rows_k in _sequences(q, k, cu_seqlens_q, cu_seqlens_k):
        q_i, k_i, v_i = _unpack(q, rows_q), _unpack(k, rows_k), _unpack(v, rows_k)
        opts = _sequence_options(q_i, k_i, q.dtype, i, softmax_scale, causal, window_size, softcap, alibi_slopes,
                                 dropout_p, dropout_seed, learnable_sink)
        out, lse, _ = standard_forward(q_i, k_i, v_i, opts)
        outs.append(out[0].transpose(0, 1))
        lses.append(lse[0])
    empty_lse = q.new_empty((q.shape[1], 0))
    empty_out = q.new_zeros((*q.shape[:-1], v.shape[-1]))
    return torch.cat(outs) if outs else empty_out, torch.cat(lses, 1) if lses else empty_lse


def tiled_varlen_attention_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale=None, causal=False,
                                   window_size=(-1, -1), softcap=0.0, alibi_slopes=None, attn_bias=None,
                                   dropout_p=0.0, dropout_seed=None, learnable_sink=None, block_m=256, block_n=256):
    """The CPU path of a packed batch: the tiled forward per sequence.

    Shapes as :func:`varlen_attention_forward`; returns (out (total_q, Hq, D) in q's
    dtype, lse (Hq, total_q) in the compute dtype). ``attn_bias`` must be None.
    """
    out = q.new_zeros((*q.shape[:-1], v.shape[-1]))  # (total_q, Hq, Dv)
    lse = torch.full((q.shape[1], q.shape[0]), -math.inf, dtype=compute_dtype(q.dtype), device=q.device)
    for i, rows_q, rows_k in _sequences(q, k, cu_seqlens_q, cu_seqlens_k, attn_bias):
        q_i, k_i, v_i = _unpack(q, rows_q), _unpack(k, rows_k), _unpack(v, rows_k)
        opts = _sequence_options(q_i, k_i, compute_dtype(q.dtype), i, softmax_scale, causal, window_size, softcap,
                                 alibi_slopes, dropout_p, dropout_seed, learnable_sink)
        out_i, lse_i = tiled_forward(q_i, k_i, v_i, opts, block_m, block_n)
        out[rows_q] = out_i[0].transpose(0, 1)
        lse[:, rows_q] = lse_i[0]
    return out, lse


def tiled_varlen_attention_backward(q, k, v, out, lse, dout, cu_seqlens_q, cu_seqlens_k, softmax_scale=None,
                                    causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                                    attn_bias=None, dropout_p=0.0, dropout_seed=None, block_m=256, block_n=256):
    """Backward of :func:`tiled_varlen_attention_forward` → (dq, dk, dv) shaped like q, k, v."""
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for i, rows_q, rows_k in _sequences(q, k, cu_seqlens_q, cu_seqlens_k, attn_bias):
        q_i, k_i, v_i = _unpack(q, rows_q), _unpack(k, rows_k), _unpack(v, rows_k)
        opts = _sequence_options(q_i, k_i, compute_dtype(q.dtype), i, softmax_scale, causal, window_size, softcap,
                                 alibi_slopes, dropout_p, dropout_seed)
        grads = tiled_backward(q_i, k_i, v_i, _unpack(out, rows_q), lse[None, :, rows_q], _unpack(dout, rows_q),
                               opts, None, block_m, block_n)
        dq[rows_q], dk[rows_k], dv[rows_k] = (g[0].transpose(0, 1) for g in grads[:3])
    return dq, dk, dv
