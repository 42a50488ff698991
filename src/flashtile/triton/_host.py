"""Host-side helpers for the launchers.

``triton.cdiv`` and ``triton.next_power_of_2`` are constexpr functions: called from the
host, each costs ~3 µs of Python (measured on a CPU core), and one training step's forward
and backward of an attention layer call them six times. ``cdiv`` and ``next_power_of_2``
here give the same values on Python ints.
"""

import contextlib
import functools

import torch


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two ≥ n, for n ≥ 1."""
    return 1 << (n - 1).bit_length()


@functools.cache
def cuda_properties(device: torch.device):
    """The GPU's properties (capability, SM count), asked for once per device: launchers consult them
    on every call."""
    return torch.cuda.get_device_properties(device)


def launch_device(t: torch.Tensor):
    """A context in which Triton launches on ``t``'s GPU: Triton uses the current CUDA device, which
    need not be the tensors' (a model spread over GPUs, with cuda:0 current). A no-op when it is."""
    if t.is_cuda and t.device.index != torch.cuda.current_device():
        return torch.cuda.device(t.device)
    return contextlib.nullcontext()
