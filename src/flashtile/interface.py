"""Public functions: thin, validating, documented. The work happens in ``flashtile.autograd``."""

from __future__ import annotations

import math

import torch

from .autograd import FlashAttnFunction

MAX_HEAD_DIM = 256
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _check_inputs(q, k, v, *, heads_axis: int, names=("q", "k", "v")):
    """Validate 4-D (batch, ..., headdim) inputs; ``heads_axis`` is where nheads is."""
    for name, t in zip(names, (q, k, v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D, got shape {tuple(t.shape)}")
        if t.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"{name} must be float16, bfloat16 or float32, got {t.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    shapes = f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {shapes}")
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"batch sizes differ: {shapes}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"head dims differ: {shapes}")
    head_dim = q.shape[-1]
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head dim must be in 1..{MAX_HEAD_DIM}, got {head_dim} ({shapes})")
    nheads_q, nheads_k = q.shape[heads_axis], k.shape[heads_axis]
    if nheads_k == 0 or nheads_q % nheads_k != 0:
        raise ValueError(
            f"nheads of q ({nheads_q}) must be a multiple of nheads of k/v ({nheads_k}): {shapes}"
        )


def _refuse(name: str, value, default) -> None:
    if value != default:
        raise NotImplementedError(f"{name}={value!r} is not supported yet (only {default!r})")


def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
):
    """Exact attention ``softmax(q kᵀ · softmax_scale) v``, argument-compatible with flash-attn 2.

    Arguments:
        q: (batch, seqlen_q, nheads, headdim), float16 / bfloat16 / float32.
        k, v: (batch, seqlen_k, nheads_k, headdim); nheads a multiple of nheads_k
            (GQA/MQA: query head h uses KV head h // (nheads // nheads_k)).
        dropout_p, window_size, softcap, alibi_slopes: only the defaults for now;
            other values raise NotImplementedError.
        softmax_scale: defaults to 1 / sqrt(headdim).
        causal: causal mask aligned to the bottom-right corner. With seqlen_q = 2
            and seqlen_k = 5 (1 = attended)::

                1 1 1 1 0
                1 1 1 1 1

            and with seqlen_q = 5, seqlen_k = 2 the first three rows see nothing
            (their output is 0, their log-sum-exp −inf)::

                0 0
                0 0
                0 0
                1 0
                1 1
        deterministic: accepted for compatibility; the backward never uses atomics,
            so it is bitwise deterministic whatever this says.
        return_attn_probs: also return the log-sum-exp (and None in place of the
            probabilities, which are never formed).

    Returns:
        out (batch, seqlen_q, nheads, headdim) in q's dtype; with return_attn_probs,
        ``(out, softmax_lse, None)`` where softmax_lse is (batch, nheads, seqlen_q),
        float32, natural log.
    """
    _check_inputs(q, k, v, heads_axis=2)
    _refuse("dropout_p", dropout_p, 0.0)
    _refuse("window_size", tuple(window_size), (-1, -1))
    _refuse("softcap", softcap, 0.0)
    _refuse("alibi_slopes", alibi_slopes, None)
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    out, lse = FlashAttnFunction.apply(q, k, v, scale, bool(causal))
    return (out, lse, None) if return_attn_probs else out


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """Drop-in for ``torch.nn.functional.scaled_dot_product_attention`` (no mask, no dropout).

    q: (batch, nheads, seqlen_q, headdim); k, v: (batch, nheads_k, seqlen_k, headdim).
    ``enable_gqa=True`` is required when nheads_k < nheads, as in SDPA. ``is_causal``
    is aligned to the bottom-right corner as in flash-attn (SDPA aligns it top-left;
    the two agree when seqlen_q = seqlen_k). Returns (batch, nheads, seqlen_q, headdim).
    """
    _check_inputs(q, k, v, heads_axis=1)
    if q.shape[1] != k.shape[1] and not enable_gqa:
        raise ValueError(
            f"nheads of q ({q.shape[1]}) and k ({k.shape[1]}) differ; pass enable_gqa=True for GQA/MQA"
        )
    softmax_scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    out, _ = FlashAttnFunction.apply(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), softmax_scale, bool(is_causal)
    )
    return out.transpose(1, 2)
