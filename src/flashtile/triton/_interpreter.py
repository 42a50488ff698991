"""A fix for Triton's CPU interpreter (``TRITON_INTERPRET=1``), applied only when it is active.

Triton 3.6's interpreter stores bfloat16 as raw uint16 and its ``tl.dot`` multiplies
those raw bits as integers, so any bfloat16 dot is garbage. The patched dot widens
bfloat16 operands to float32 first: exact, since every bfloat16 is a float32, and
the same arithmetic as the GPU's tensor cores, which form bfloat16 products exactly
and accumulate them in float32.
"""

from __future__ import annotations

import os

import triton.language as tl
from triton.runtime import interpreter


def interpreting() -> bool:
    """Whether Triton kernels run in the CPU interpreter. Read at each call: the tests switch a
    process between the interpreter and the PyTorch path through the environment."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def apply_fixes() -> None:
    """Patch the interpreter if it is active (idempotent); ``flashtile.triton.launch`` calls this
    once when it is imported, before any kernel runs."""
    if interpreting():
        patch_bf16_dot()


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


__all__ = ["apply_fixes", "interpreting", "patch_bf16_dot"]
