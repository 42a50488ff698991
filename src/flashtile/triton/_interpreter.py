"""Fixes for Triton's CPU interpreter (``TRITON_INTERPRET=1``), applied only when it is active.

Triton 3.6's interpreter stores bfloat16 as raw uint16, and gets two of its operations wrong:

* its ``tl.dot`` multiplies those raw bits as integers, so any bfloat16 dot is garbage. The
  patched dot widens bfloat16 operands to float32 first: exact, since every bfloat16 is a
  float32, and the same arithmetic as the GPU's tensor cores, which form bfloat16 products
  exactly and accumulate them in float32;
* its float32 → bfloat16 conversion (``x.to(tl.bfloat16)``) truncates the mantissa, where the
  GPU's ``cvt.rn.bf16.f32`` rounds to the nearest, ties to even: a bfloat16 result was up to a
  whole unit in the last place off instead of half, which the tests judged as flashtile's error
  (a dV of 0.88 ulp against PyTorch's 0.25). The patched conversion is PyTorch's, which rounds
  as the GPU does.
"""

from __future__ import annotations

import os

import numpy as np
import torch
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
        patch_bf16_rounding()


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


def patch_bf16_rounding() -> None:
    builder = interpreter.InterpreterBuilder
    if getattr(builder.cast_impl, "_flashtile_bf16", False):
        return
    original = builder.cast_impl

    def cast_impl(self, src, dst_type):
        if dst_type.scalar != tl.bfloat16 or not src.dtype.scalar.is_floating() or src.dtype.scalar == tl.bfloat16:
            return original(self, src, dst_type)
        # the interpreter's float32 (float16 widened exactly) → PyTorch's round-to-nearest-even bfloat16 → its
        # uint16 storage
        values = torch.from_numpy(np.array(src.data, dtype=np.float32, copy=True))  # writable, as torch wants
        bits = values.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
        return interpreter.TensorHandle(bits.reshape(src.data.shape), dst_type.scalar)

    cast_impl._flashtile_bf16 = True
    builder.cast_impl = cast_impl


__all__ = ["apply_fixes", "interpreting", "patch_bf16_dot", "patch_bf16_rounding"]
