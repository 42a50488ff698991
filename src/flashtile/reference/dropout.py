"""Dropout: Philox-4x32-10 as ``triton.language.random``, in int64 arithmetic.

``P_ij`` is kept iff the Philox uniform ``u ≥ p``, the counter being
``(j, i, batch·nheads + head, 0)`` and the key the 64-bit seed, exactly as the kernels'
``tl.random.philox`` draws it: any block of the mask can be rebuilt on its own
(:func:`keep_mask_block`), so neither the kernels nor the tiled path store it.
"""

from __future__ import annotations

import torch

__all__ = ["philox_uniform", "keep_mask_block", "dropout_keep_mask"]

_UINT32 = 0xFFFFFFFF
_PHILOX_KEY_A, _PHILOX_KEY_B = 0x9E3779B9, 0xBB67AE85
_PHILOX_ROUND_A, _PHILOX_ROUND_B = 0xD2511F53, 0xCD9E8D57
_PHILOX_ROUNDS = 10
_INT32_TO_UNIFORM = 4.6566127342e-10  # tl.random.uint_to_uniform_float: max int32 · this < 1 in float32


def _mul_wide(a: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(high, low) 32-bit words of ``a · x`` for a uint32 constant and uint32 values held in int64.

    Split into 16-bit halves so that no partial product overflows int64.
    """
    a_hi, a_lo = a >> 16, a & 0xFFFF
    x_hi, x_lo = x >> 16, x & 0xFFFF
    low_low = a_lo * x_lo  # < 2^32
    middle = a_hi * x_lo + a_lo * x_hi + (low_low >> 16)  # < 2^34
    high = a_hi * x_hi + (middle >> 16)
    low = ((middle & 0xFFFF) << 16) | (low_low & 0xFFFF)
    return high, low


def philox_uniform(seed, seq_head: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """float32 uniforms in [0, 1) of the dropout mask, bit-identical to the kernels' draw.

    Philox-4x32-10 (``triton.language.random.philox``) with key
    ``(seed mod 2³², seed >> 32)`` and counter ``(j, i, seq_head, 0)``; the first
    output word is mapped to [0, 1) as ``tl.random.uint_to_uniform_float`` does.
    ``seed`` is a non-negative int, or an int64 tensor of one element, which is never read on
    the host (under ``torch.vmap`` each entry has its own). ``seq_head`` [..., 1, 1] is
    ``batch·nheads + head``; rows [BM] and cols [BN] are query and key positions. Returns [..., BM, BN].
    """
    device = rows.device
    seed = seed.to(device=device, dtype=torch.int64).reshape(()) if isinstance(seed, torch.Tensor) else int(seed)
    k0, k1 = seed & _UINT32, (seed >> 32) & _UINT32
    c0 = cols.to(torch.int64)[None, :] & _UINT32  # [1, BN]
    c1 = rows.to(torch.int64)[:, None] & _UINT32  # [BM, 1]
    c2 = seq_head.to(device=device, dtype=torch.int64) & _UINT32  # [..., 1, 1]
    c3 = torch.zeros((), dtype=torch.int64, device=device)
    for _ in range(_PHILOX_ROUNDS):
        high_b, low_b = _mul_wide(_PHILOX_ROUND_B, c2)
        high_a, low_a = _mul_wide(_PHILOX_ROUND_A, c0)
        c0, c1, c2, c3 = high_b ^ c1 ^ k0, low_b, high_a ^ c3 ^ k1, low_a
        # -- raise the key
        k0 = (k0 + _PHILOX_KEY_A) & _UINT32
        k1 = (k1 + _PHILOX_KEY_B) & _UINT32
    # bitcast the first word to int32, fold negatives onto [0, 2^31), scale in float32
    x = torch.where(c0 >= 2**31, c0 - 2**32, c0)
    x = torch.where(x < 0, -x - 1, x)
    return x.to(torch.float32) * torch.tensor(_INT32_TO_UNIFORM, dtype=torch.float32, device=device)


def keep_mask_block(seed, seq_head, rows, cols, dropout_p: float) -> torch.Tensor:
    """Boolean [..., BM, BN]: kept iff the Philox uniform of :func:`philox_uniform` is ≥ dropout_p (float32)."""
    return philox_uniform(seed, seq_head, rows, cols) >= torch.tensor(dropout_p, dtype=torch.float32)


def dropout_keep_mask(seed, batch: int, nheads: int, seqlen_q: int, seqlen_k: int, dropout_p: float,
                      device=None) -> torch.Tensor:
    """Boolean [batch, nheads, seqlen_q, seqlen_k]: which probabilities survive dropout.

    Bit-identical to ``flashtile.triton.scores.dropout_keep``: kept iff the Philox uniform of
    counter ``(j, i, b·nheads + h, 0)`` is ≥ dropout_p (in float32).
    """
    seq_head = torch.arange(batch * nheads, device=device).view(batch, nheads, 1, 1)
    return keep_mask_block(seed, seq_head, torch.arange(seqlen_q, device=device),
                           torch.arange(seqlen_k, device=device), dropout_p)
