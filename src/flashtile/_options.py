"""One attention call's options: the single representation every layer passes on.

Validation (``flashtile._validate``) builds an :class:`AttentionOptions` (the scalars) and an
:class:`AttentionTensors` (the optional tensors) once per call; autograd saves them, the
operators (``flashtile.ops``) carry them through their schemas as flat arguments and rebuild
them, and the launchers (``flashtile.triton.launch``) turn them into kernel keyword arguments.
The reference (``flashtile.reference``) uses the same defaults, defined here once.

Conventions: ``window_left``/``window_right`` bound the keys a query sees
(``i + Nk − Nq − left ≤ j ≤ i + Nk − Nq + right``), −1 is unbounded, and causal attention
is already folded in as ``window_right = 0`` (bottom-right alignment).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

__all__ = ["AttentionOptions", "AttentionTensors", "NO_TENSORS", "cache_capacity", "default_softmax_scale",
           "fold_causal"]


def default_softmax_scale(head_dim: int, softmax_scale: float | None = None) -> float:
    """``softmax_scale`` as given, or 1 / √headdim by default (flash-attn's and SDPA's)."""
    return 1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)


def fold_causal(window_size, causal: bool) -> tuple[int, int]:
    """(left, right) of the sliding window with causal folded in: causal sets right = 0."""
    left, right = (int(w) for w in window_size)
    return left, 0 if causal else right


def cache_capacity(k_cache: torch.Tensor, block_table: torch.Tensor | None) -> int:
    """The positions a KV cache holds per sequence: a cache row's (batch, seqlen, nheads_k, headdim), or, paged
    (num_pages, page_size, nheads_k, headdim), its block table's pages per sequence times their size."""
    return k_cache.shape[1] if block_table is None else block_table.shape[1] * k_cache.shape[1]


class AttentionOptions(NamedTuple):
    """The non-tensor arguments of one call, validated; ``window_right`` already includes causal."""

    softmax_scale: float
    window_left: int = -1
    window_right: int = -1
    softcap: float = 0.0
    dropout_p: float = 0.0
    max_seqlen_q: int = 0  # packed batches: the longest sequence, which sizes the grid
    max_seqlen_k: int = 0
    deterministic: bool = False  # the backward may not sum with atomics (bitwise-identical gradients)
    # the caller reads the log-sum-exp, which must then meet flashtile's 1e-5 contract; False lets the CPU
    # path run PyTorch's 16-bit kernel as SDPA does (flashtile.cpu: its log-sum-exp is ~6e-5 off)
    returns_lse: bool = True

    @property
    def window(self) -> tuple[int, int]:
        return self.window_left, self.window_right

    @property
    def causal(self) -> bool:
        """Plain causal attention: no left bound, right bound on the diagonal."""
        return self.window == (-1, 0)


class AttentionTensors(NamedTuple):
    """The optional tensors of one call (None when absent).

    ``alibi_slopes`` float32 (nheads,) or (batch, nheads); ``attn_bias`` broadcastable to
    (batch, nheads, seqlen_q, seqlen_k); ``dropout_seed`` int64 (1,) on the inputs' device;
    ``cu_seqlens_q/k`` int32 (batch + 1,) mark a packed batch; ``learnable_sink`` float32
    (nheads,): one logit per query head that joins each row's softmax denominator and adds no value
    (gpt-oss's attention sinks, FA4's name), not scaled by softmax_scale.
    """

    alibi_slopes: torch.Tensor | None = None
    attn_bias: torch.Tensor | None = None
    dropout_seed: torch.Tensor | None = None
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None
    learnable_sink: torch.Tensor | None = None

    @property
    def is_varlen(self) -> bool:
        return self.cu_seqlens_q is not None


NO_TENSORS = AttentionTensors()
