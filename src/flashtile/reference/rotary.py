"""Rotary position embeddings as ``flash_attn_with_kvcache`` applies them (flash-attn 2's semantics).

``cos``, ``sin``: (seqlen_ro, rotary_dim / 2). The first ``rotary_dim`` channels of each head are
rotated by the angle of the token's position, the rest pass through: pairs (x[j], x[j + rotary_dim/2])
(GPT-NeoX's layout), or with ``interleaved`` the pairs (x[2j], x[2j + 1]) (GPT-J's):

    x₁' = x₁ · cos − x₂ · sin,    x₂' = x₁ · sin + x₂ · cos,

computed in float32 and rounded to x's dtype once, as flash-attn's kernel does.

Positions (:func:`rotary_positions`, flash-attn 2's rule): the new keys of sequence b at
``cache_seqlens[b] + i``; its queries there too when the call is causal or windowed, else all at
``cache_seqlens[b]``; clamped into the table, so that no length, however malformed, reads outside it.
The kernels (``flashtile.triton.decode``) apply the same rule to the tiles they load.
"""

from __future__ import annotations

import torch

__all__ = ["apply_rotary", "packed_sequences", "rotary_positions"]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                 interleaved: bool = False) -> torch.Tensor:
    """x (..., nheads, headdim) rotated at ``positions`` (x's leading shape, integer, < seqlen_ro)."""
    half = cos.shape[-1]
    rotary_dim = 2 * half
    angle_cos = cos.float()[positions][..., None, :]  # [..., 1, rotary_dim / 2]: one angle for every head
    angle_sin = sin.float()[positions][..., None, :]
    rotated = x[..., :rotary_dim].float()
    if interleaved:
        x1, x2 = rotated[..., 0::2], rotated[..., 1::2]
    else:
        x1, x2 = rotated[..., :half], rotated[..., half:]
    out1 = x1 * angle_cos - x2 * angle_sin
    out2 = x1 * angle_sin + x2 * angle_cos
    rotated = torch.stack((out1, out2), dim=-1).flatten(-2) if interleaved else torch.cat((out1, out2), dim=-1)
    return torch.cat((rotated.to(x.dtype), x[..., rotary_dim:]), dim=-1)


def packed_sequences(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """The sequence of each token of a packed axis, (total,) int64, on the device (no sync). Tokens outside
    every sequence get the last one (their rows are never read)."""
    tokens = torch.arange(total, device=cu_seqlens.device)
    return torch.searchsorted(cu_seqlens[1:].contiguous(), tokens, right=True).clamp(max=cu_seqlens.numel() - 2)


def rotary_positions(cache_seqlens: torch.Tensor, rows: int, seqlen_ro: int, cu_seqlens: torch.Tensor | None = None,
                     at_start: bool = False) -> torch.Tensor:
    """The table row of each new token: [B, rows] for tokens [B, rows, ...], or [rows] for a packed axis
    of ``rows`` tokens split by ``cu_seqlens`` (non-decreasing); token t of sequence b at
    ``cache_seqlens[b] + t`` (at ``cache_seqlens[b]`` itself with ``at_start``), clamped into [0, seqlen_ro)."""
    starts = cache_seqlens.long()
    if cu_seqlens is not None:
        sequence = packed_sequences(cu_seqlens, rows)  # [rows]
        starts, offsets = starts[sequence], torch.arange(rows, device=starts.device) - cu_seqlens.long()[sequence]
    else:
        starts, offsets = starts[:, None], torch.arange(rows, device=starts.device)  # [B, 1], [rows]
    positions = starts.expand(*starts.shape[:-1], rows) if at_start else starts + offsets
    return positions.clamp(0, seqlen_ro - 1)
