"""Kernels in Gluon (``triton.experimental.gluon``) for one GPU architecture each.

``sm90_fwd``: the forward on Hopper (sm_90) with FlashAttention-3's warp-specialised schedule.
Gluon has no interpreter, so these are tested on the GPU only (tests/test_hopper.py).

Gluon is experimental and its API changes between Triton releases: these kernels are written for
``TRITON_SERIES`` and the launcher takes them only when the installed Triton is of that series
(:func:`written_for`); with any other Triton, everything runs the portable Triton kernels.
"""

import triton

TRITON_SERIES = "3.6"


def written_for(version: str = triton.__version__) -> bool:
    """Whether Triton ``version`` is of the series these kernels are written for."""
    return version.split(".")[:2] == TRITON_SERIES.split(".")
