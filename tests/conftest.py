"""Test configuration: kernels run on the GPU when there is one, else under Triton's interpreter.

TRITON_INTERPRET must be set before triton is first imported, hence here and not in a fixture.
The ``backend`` fixture runs a test on each path this machine has: "triton" (the Triton kernels,
under the interpreter on a CPU), "torch" (the CPU tiled path, off the GPU only), and, where a
test asks for it by indirect parametrisation, "triton-tma" (the forward's tensor-descriptor loads,
which it takes only from ``configs.TMA_MIN_SEQLEN`` on, far beyond the shapes here). On an sm_90
GPU the launcher's Gluon forward is switched off here and tested in test_hopper.py.

The launchers decide once per call key (``flashtile.triton.plans``) under the policy in force then;
tests change that policy (the thresholds above, the code-path switches), so every test starts with
no plans. tests/test_plans.py checks the replays themselves.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from helpers import BACKENDS, DEVICE  # noqa: E402

from flashtile import cpu  # noqa: E402
from flashtile.triton import configs, plans  # noqa: E402


@pytest.fixture(autouse=True)
def no_plans_from_other_tests():
    plans.clear()
    yield
    plans.clear()


@pytest.fixture(params=[True, False], ids=["16-bit-cpu", "no-16-bit-cpu"])
def cpu_16bit_arithmetic(request, monkeypatch):
    """The CPU path as on a CPU with (True) and without (False) the 16-bit arithmetic PyTorch's CPU attention
    uses (``flashtile.cpu.computes_16bit_natively``: without it 16-bit backwards run in float32), whatever this
    machine has. The CPU path keeps its decisions per call key, hence the cache cleared on both sides."""
    monkeypatch.setattr(cpu, "computes_16bit_natively", lambda dtype: request.param)
    cpu._bias_free_layout.cache_clear()
    yield request.param
    cpu._bias_free_layout.cache_clear()


@pytest.fixture
def device():
    return DEVICE


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch):
    monkeypatch.setattr(configs, "GLUON_MIN_SEQLEN", {})
    if request.param == "torch":
        monkeypatch.setenv("TRITON_INTERPRET", "0")  # dispatch to the PyTorch path
    if request.param == "triton-tma":
        monkeypatch.setattr(configs, "TMA_MIN_SEQLEN", 1)
    return request.param
