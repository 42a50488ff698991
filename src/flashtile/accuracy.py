"""flash-attn's accuracy rule, shared by the tests, ``python -m flashtile check`` and the benchmark.

A result is judged against a float64 reference. The bar is relative to PyTorch's own rounding:
the same standard attention run in the input's dtype has some error against float64; flashtile
may have at most ``factor`` times that (2 for outputs, 3 for gradients, where rounding compounds
through three more products), plus a floor of a few float32 units in the last place (all dtypes
accumulate in float32) at the scale of the largest reference value, at least 1. The floor matters
only where PyTorch's own error is near zero: float32 inputs, and exact zeros such as dq for
seqlen_k = 1, which the kernel computes from the rounded output through D = rowsum(dO ∘ O).
"""

from __future__ import annotations

import torch

FLOAT32_ULPS_FLOOR = 8  # ~1e-6 at magnitude 1: far below any real bug's error


def max_error(actual: torch.Tensor, ref64: torch.Tensor) -> float:
    return (actual.double() - ref64.double()).abs().max().item() if ref64.numel() else 0.0


def error_bound(ref64: torch.Tensor, ref_lowp: torch.Tensor, factor: float) -> float:
    """The largest error the rule allows: factor × PyTorch's own error + the float32-ulp floor."""
    scale = max(ref64.abs().max().item() if ref64.numel() else 0.0, 1.0)
    return factor * max_error(ref_lowp, ref64) + FLOAT32_ULPS_FLOOR * torch.finfo(torch.float32).eps * scale
