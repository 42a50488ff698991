"""The tests' assertion of flash-attn's accuracy rule (``flashtile.accuracy`` states the rule)."""

import torch

from flashtile.accuracy import error_bound, max_error


def assert_accurate(name, actual, ref64, ref_lowp, factor):
    assert not torch.isnan(actual).any(), f"{name}: NaN in result"
    err, bound = max_error(actual, ref64), error_bound(ref64, ref_lowp, factor)
    assert err <= bound, (f"{name}: error {err:.3e} > bound {bound:.3e} "
                          f"({factor} x torch's {max_error(ref_lowp, ref64):.3e} + float32-ulp floor)")
