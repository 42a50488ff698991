"""Variable-length batches (flash-attn's packed layout): each sequence attends alone.

q (total_q, Hq, D), k and v (total_k, Hk, D), with ``cu_seqlens_*`` int32 (batch + 1,) the
cumulative lengths. Each sequence runs through the functions of ``reference.attention`` on its
own, so masks and ALiBi are aligned per sequence, and the dropout counter uses the sequence
index as the batch index and positions within the sequence.

Sequence ``b`` is tokens ``[cu[b], cu[b + 1])`` with both bounds clamped into the token axis and
an end below its start making it empty (:func:`sequence_slices`), the rule the kernels apply: in
the tiled functions (the CPU path) a malformed cu_seqlens can never reach outside the tensors, and
tokens outside every sequence keep output 0 and log-sum-exp −inf. The public functions refuse
malformed cu_seqlens before this wherever reading them is free (``flashtile._validate``).
"""

from __future__ import annotations

import math

import torch

from .attention import compute_dtype, score_options, standard_forward, tiled_backward, tiled_forward

__all__ = ["sequence_slices", "varlen_attention_forward", "tiled_varlen_attention_forward",
           "tiled_varlen_attention_backward"]


def _clamped(cu: list[int], b: int, total: int) -> slice:
    start = min(max(cu[b], 0), total)
    return slice(start, min(max(cu[b + 1], start), total))


def sequence_slices(cu_seqlens_q, cu_seqlens_k, total_q: int, total_k: int):
    """(index, q rows, k rows) of each sequence of a packed batch, bounds clamped into the token axes."""
    starts_q, starts_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    if len(starts_q) != len(starts_k):
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k differ in length: {len(starts_q)} vs {len(starts_k)}")
    for i in range(len(starts_q) - 1):
        yield i, _clamped(starts_q, i, total_q), _clamped(starts_k, i, total_k)


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
