"""Visibility: causal and sliding window, and the block ranges that skip invisible blocks.

Key ``j`` is visible to query ``i`` iff ``i + Nk − Nq − left ≤ j ≤ i + Nk − Nq + right``
(−1 = unbounded; causal is ``right = 0``, bottom-right alignment). :func:`visible` is the
rule itself, shared by the masks below and the block scores of ``reference.attention``.
"""

from __future__ import annotations

import torch

from .._options import fold_causal

__all__ = ["normalize_window", "visible_mask", "causal_mask", "visible", "key_range", "query_range"]


def normalize_window(causal: bool, window_size=(-1, -1)) -> tuple[int, int]:
    """(left, right) of the sliding window, −1 = unbounded; causal sets right = 0 (as flash-attn)."""
    return fold_causal(window_size, causal)


def visible_mask(seqlen_q: int, seqlen_k: int, causal: bool = False, window_size=(-1, -1), device=None):
    """Boolean [seqlen_q, seqlen_k]: True where query i may attend key j.

    ``i + Nk − Nq − left ≤ j ≤ i + Nk − Nq + right``, a bound of −1 being absent;
    causal means ``right = 0`` (bottom-right alignment).
    """
    return visible(torch.arange(seqlen_q, device=device), torch.arange(seqlen_k, device=device),
                   seqlen_k - seqlen_q, normalize_window(causal, window_size))


def causal_mask(seqlen_q: int, seqlen_k: int, device=None) -> torch.Tensor:
    """Boolean [seqlen_q, seqlen_k], True where query i may attend key j (bottom-right aligned)."""
    return visible_mask(seqlen_q, seqlen_k, causal=True, device=device)


def visible(rows, cols, diagonal: int, window: tuple[int, int]) -> torch.Tensor:
    """Boolean [len(rows), len(cols)] by the window rule; ``diagonal = Nk − Nq``."""
    left, right = window
    rel = cols[None, :] - rows[:, None] - diagonal  # j − (i + Nk − Nq)
    mask = torch.ones(rel.shape, dtype=torch.bool, device=rel.device)
    if left >= 0:
        mask &= rel >= -left
    if right >= 0:
        mask &= rel <= right
    return mask


def key_range(row_start: int, row_end: int, seqlen_q: int, seqlen_k: int, window: tuple[int, int],
              block_n: int) -> tuple[int, int]:
    """[lo, hi) of the keys that queries [row_start, row_end) can see; lo a multiple of block_n.

    ``window`` is the normalised (left, right). Mirrors ``flashtile.triton.scores.key_range``:
    the K blocks ``range(lo, hi, block_n)`` are exactly those holding a visible key.
    """
    left, right = window
    diagonal = seqlen_k - seqlen_q
    lo = max(row_start + diagonal - left, 0) // block_n * block_n if left >= 0 else 0
    hi = min(row_end + diagonal + right, seqlen_k) if right >= 0 else seqlen_k
    return lo, hi


def query_range(col_start: int, col_end: int, seqlen_q: int, seqlen_k: int, window: tuple[int, int],
                block_m: int) -> tuple[int, int]:
    """[lo, hi) of the queries that see any of keys [col_start, col_end); lo a multiple of block_m.

    Mirrors ``flashtile.triton.scores.query_range``.
    """
    left, right = window
    diagonal = seqlen_k - seqlen_q
    lo = max(col_start - diagonal - right, 0) // block_m * block_m if right >= 0 else 0
    hi = min(col_end - diagonal + left, seqlen_q) if left >= 0 else seqlen_q
    return lo, hi
