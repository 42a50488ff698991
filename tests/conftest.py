"""Test configuration: kernels run on the GPU when there is one, else under Triton's interpreter.

TRITON_INTERPRET must be set before triton is first imported, hence here and not in a fixture.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def device():
    return DEVICE
