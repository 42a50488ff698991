"""The arithmetic the Triton kernels rely on, as the GPU does it: bfloat16 products accumulated in float32,
and float32 → bfloat16 rounded to the nearest (ties to even). On a CPU the kernels run under Triton's
interpreter, which gets both wrong unless ``flashtile.triton._interpreter``'s fixes are applied (importing
flashtile's launchers applies them): the tests then judge the interpreter's arithmetic, not flashtile's."""

import pytest
import torch
import triton
import triton.language as tl

import flashtile  # noqa: F401 - its launchers apply the interpreter's fixes
from helpers import DEVICE


@triton.jit
def _to_bf16_kernel(X, Y, N: tl.constexpr):
    offsets = tl.arange(0, N)
    tl.store(Y + offsets, tl.load(X + offsets).to(tl.bfloat16))


@triton.jit
def _bf16_dot_kernel(A, B, C, N: tl.constexpr):
    rows = tl.arange(0, N)
    a = tl.load(A + rows[:, None] * N + rows[None, :])  # [N, N] bfloat16
    b = tl.load(B + rows[:, None] * N + rows[None, :])
    tl.store(C + rows[:, None] * N + rows[None, :], tl.dot(a, b))  # float32


@pytest.mark.parametrize("source", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_conversion_to_bf16_rounds_to_nearest_even(source):
    g = torch.Generator().manual_seed(61)
    # ties (1 + 2⁻⁸ rounds down to even, 1 + 3·2⁻⁸ up), values just past a tie, the extremes, then random ones
    special = [1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-8 + 2**-12, -2.2627258, 1e-40, -0.0, float("inf"), float("-inf")]
    if source == torch.float16:
        special = [1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-8 + 2**-10, -2.2627258, 6e-8, -0.0, 65504.0, float("-inf")]
    x = torch.cat([torch.tensor(special), torch.randn(248, generator=g) * 100]).to(source).to(DEVICE)
    y = torch.empty(256, dtype=torch.bfloat16, device=DEVICE)
    _to_bf16_kernel[(1,)](x, y, N=256)
    expected = x.to(torch.bfloat16)
    assert torch.equal(y.view(torch.int16), expected.view(torch.int16)), (y[:8], expected[:8])


def test_bf16_dot_accumulates_exact_products_in_float32():
    g = torch.Generator().manual_seed(67)
    a, b = (torch.randn(16, 16, generator=g).to(torch.bfloat16).to(DEVICE) for _ in range(2))
    c = torch.empty(16, 16, device=DEVICE)
    _bf16_dot_kernel[(1,)](a, b, c, N=16)
    torch.testing.assert_close(c, a.float() @ b.float(), rtol=1e-6, atol=1e-5)
