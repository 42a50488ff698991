"""A fix for Triton's CPU interpreter (``TRITON_INTERPRET=1``), applied only when it is active.

Triton 3.6's interpreter stores bfloat16 as raw uint16 and its ``tl.dot`` multiplies
those raw bits as integers, so any bfloat16 dot is garbage. The patched dot widens
bfloat16 operands to float32 first: exact, since every bfloat16 is a float32, and
the same arithmetic as the GPU's tensor cores, which form bfloat16 products exactly
and accumulate them in float32.
"""

from __future__ import annotations

import triton.language as tl
from triton.runtime import interpreter


def patch_bf16_dot() -> None:
    builder = interpreter.InterpreterBuilder
    if getattr(builder.create_dot, "_flashtile_bf16", False):
        return
    original = builder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype.scalar == tl.bfloat16:
            a = self.cast_impl(a, tl.float32)
        if b.dtype.scalar == tl.bfloat16:
            b = self.cast_impl(b, tl.float32)
        return original(self, a, b, d, input_precision, max_num_imprecise_acc)

    create_dot._flashtile_bf16 = True
    builder.create_dot = create_dot


__all__ = ["patch_bf16_dot"]
