"""Kernels in Gluon (``triton.experimental.gluon``) for one GPU architecture each.

``sm90_fwd``: the forward on Hopper (sm_90) with FlashAttention-3's warp-specialised schedule.
Gluon has no interpreter, so these are tested on the GPU only (tests/test_hopper.py).
"""
