"""The machine a measurement ran on: software versions, the device, how busy its CPUs are, and
the GPU's state (clocks, power, temperature, throttling) as nvidia-smi reports it."""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import subprocess

import torch

from ... import __version__


def _distribution_version(name: str):
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _nvidia_smi(*args: str):
    """nvidia-smi's output lines for ``args``, or None where it is missing or fails."""
    try:
        done = subprocess.run(["nvidia-smi", *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = done.stdout.strip().splitlines()
    return lines if done.returncode == 0 and lines else None


def _nvidia_driver():
    lines = _nvidia_smi("--query-gpu=driver_version", "--format=csv,noheader")
    return lines[0].strip() if lines else None


# What nvidia-smi says of the GPU right after a timing: two runs of one kernel on one machine read up to
# 14% apart, and the runs recorded no clocks to tell why (benchmarks/NOTES.md, fifth session).
GPU_STATE_QUERY = {"sm_clock_mhz": "clocks.sm", "power_w": "power.draw", "temperature_c": "temperature.gpu",
                   "throttle_reasons": "clocks_event_reasons.active"}


def gpu_state(device_index: int):
    """{sm_clock_mhz, power_w, temperature_c, throttle_reasons} of CUDA device ``device_index`` by
    nvidia-smi (the reasons as its bit mask, e.g. 0x4 = power cap), or None where it cannot tell."""
    try:
        uuid = str(torch.cuda.get_device_properties(device_index).uuid)
    except (RuntimeError, AttributeError):
        return None
    lines = _nvidia_smi(f"--id=GPU-{uuid}", "--query-gpu=" + ",".join(GPU_STATE_QUERY.values()),
                        "--format=csv,noheader,nounits")
    fields = [field.strip() for field in lines[0].split(",")] if lines else []
    if len(fields) != len(GPU_STATE_QUERY):
        return None
    state = {}
    for key, text in zip(GPU_STATE_QUERY, fields):
        try:
            state[key] = text if key == "throttle_reasons" else float(text)
        except ValueError:  # "[N/A]"
            state[key] = None
    return state


def cpu_load():
    """{load_1min, cpus, busy} now, or None where the OS keeps no load average (Windows). Busy: more
    runnable threads than CPUs over the last minute, so that timed calls wait for a CPU (the host side
    of a GPU run too)."""
    try:
        load_1min = os.getloadavg()[0]
    except (AttributeError, OSError):
        return None
    cpus = os.cpu_count() or 1
    return dict(load_1min=load_1min, cpus=cpus, busy=load_1min > cpus)


def environment(device: str) -> dict:
    env = dict(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        device=(torch.cuda.get_device_name() if device == "cuda"
                else f"CPU ({platform.processor() or platform.machine()})"),
        python=platform.python_version(), torch=torch.__version__, triton=_distribution_version("triton"),
        flashtile=__version__, platform=platform.platform(),
    )
    if device == "cuda":
        env.update(cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version(), driver=_nvidia_driver())
    else:
        env.update(torch_threads=torch.get_num_threads())
    for dist in ("flash-attn", "flash-attn-4", "nvidia-cutlass-dsl"):
        env[dist] = _distribution_version(dist)
    return env
