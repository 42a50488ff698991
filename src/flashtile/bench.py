"""``python -m flashtile bench``: speed and peak memory of flashtile next to the attention
kernels present on this machine, on the standard sweep or on shapes from the command line.

For each shape and provider:

* **time** of the forward and of forward+backward: ``triton.testing.do_bench`` medians on
  CUDA (``--warmup``/``--rep`` in ms; it flushes L2 between calls), a ``time.perf_counter``
  median over the same budgets on the CPU. On CUDA each shape first runs for ``CLOCK_RAMP_S``
  after its first (compiling) call, so that the GPU's clocks are up. The backward is not timed alone:
  backward = (forward+backward) − forward, as in the H200 anchors (benchmarks/NOTES.md).
* **TFLOP/s**: forward FLOPs 4·B·H·Nq·Nk·D (the QKᵀ and PV matmuls), ×0.5 when causal with
  Nq = Nk (the usual convention, which the anchors use); when causal with Nq ≠ Nk,
  4·B·H·D·(exact number of visible query-key pairs, bottom-right alignment). Backward FLOPs
  are 2.5× the forward's, forward+backward 3.5×.
* **peak memory**: ``torch.cuda.max_memory_allocated`` over one forward+backward, minus what
  was allocated before it (q, k, v and dout are not counted). Not measured on the CPU.
* **accuracy**: the output of that forward+backward on sampled query rows against float64
  standard attention, with flash-attn's rule (error ≤ 2× PyTorch's own error in the input
  dtype, plus a float32-ulp floor), and the largest difference from flashtile's output.

Inputs are random normal, in each provider's own layout: (batch, seqlen, nheads, headdim)
for flashtile and flash-attn, (batch, nheads, seqlen, headdim) for SDPA and FlexAttention.
A peer that refuses a case (SDPA backend constraints, out of memory, ...) is recorded as
skipped, with the reason it gave. FlexAttention is compiled once per shape (dynamic=False),
with its causal block mask built once per shape, outside the timing.

The standard sweep (no shape arguments) is the anchors': bf16, batch·seqlen = 16384,
nheads·headdim = 2048, headdim 64 and 128, non-causal and causal, seqlen 512..16384; on a
machine without CUDA, a scaled-down one (batch·seqlen = 1024, nheads·headdim = 256,
seqlen 128..512).

Outputs, in ``--out-dir``: ``bench.json`` (every measurement and the environment) and
``bench.txt`` (the tables), both rewritten after each case, and with matplotlib one PNG per
case; the tables also go to stdout, the progress to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import functools
import importlib
import importlib.metadata
import json
import math
import platform
import re
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from . import __version__
from .accuracy import error_bound, max_error
from .interface import flash_attn_func

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
MODES = ("fwd", "bwd", "fwd_bwd")
BWD_FLOPS_FACTOR = 2.5
BWD_METHOD = "bwd = (fwd+bwd) - fwd, each timed separately"
FLOPS_RULE = ("fwd 4*B*H*Nq*Nk*D, x0.5 if causal and Nq = Nk, exact visible pairs if causal and Nq != Nk; "
              "bwd 2.5x fwd; fwd_bwd 3.5x fwd")
ACCURACY_FACTOR = 2  # flash-attn's rule for outputs (flashtile.accuracy)
CHECKED_ROWS = 64  # query rows compared with float64: first, last and evenly spaced ones

# The anchors' sweep (benchmarks/NOTES.md) on CUDA: batch·seqlen and nheads·headdim fixed.
# On the CPU the same design, scaled down so that it runs in seconds.
STANDARD_SWEEP = {
    "cuda": dict(tokens=16384, hidden=2048, seqlens=(512, 1024, 2048, 4096, 8192, 16384), headdims=(64, 128)),
    "cpu": dict(tokens=1024, hidden=256, seqlens=(128, 256, 512), headdims=(64, 128)),
}


@dataclasses.dataclass(frozen=True)
class Shape:
    batch: int
    seqlen_q: int
    seqlen_k: int
    nheads: int
    nheads_k: int
    headdim: int
    causal: bool
    dtype: str  # a key of DTYPES

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.headdim)


def forward_flops(shape: Shape) -> float:
    """FLOPs of QKᵀ and PV over the visible pairs (see the module docstring)."""
    nq, nk = shape.seqlen_q, shape.seqlen_k
    if not shape.causal:
        pairs = nq * nk
    elif nq == nk:
        pairs = nq * nk / 2
    else:  # query i sees keys j ≤ i + nk − nq (bottom-right), at most nk of them
        pairs = sum(min(nk, max(0, i + nk - nq + 1)) for i in range(nq))
    return 4.0 * shape.batch * shape.nheads * shape.headdim * pairs


# ----------------------------------------------------------------------------------------------
# Providers: build(shape, q, k, v) → (attend(q, k, v) → out, context to measure in)


class Unsupported(Exception):
    """A provider cannot run a case; the message says why."""


@dataclasses.dataclass(frozen=True)
class Provider:
    name: str
    label: str
    layout: str  # "bshd" (flash-attn's) or "bhsd" (SDPA's)
    present: Callable[[str], bool]
    build: Callable


def _flashtile(shape, q, k, v):
    return (lambda q, k, v: flash_attn_func(q, k, v, softmax_scale=shape.scale, causal=shape.causal)), \
        contextlib.nullcontext()


def _sdpa(backend_name: str):
    def build(shape, q, k, v):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        kwargs = dict(scale=shape.scale, enable_gqa=shape.nheads != shape.nheads_k)
        if shape.causal and shape.seqlen_q != shape.seqlen_k:
            kwargs["attn_mask"] = _sdpa_bottom_right_causal(backend_name, shape, q, k, v)
        else:
            kwargs["is_causal"] = shape.causal
        return (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, **kwargs)), \
            sdpa_kernel(getattr(SDPBackend, backend_name))

    return build


def _sdpa_bottom_right_causal(backend_name, shape, q, k, v):
    # SDPA's is_causal aligns top-left. Bottom-right needs CausalBias, which bypasses
    # sdpa_kernel and calls the flash kernel itself when it can, so only sdpa_flash is
    # measurable, and only where the flash kernel takes the inputs.
    from torch.backends.cuda import SDPAParams, can_use_flash_attention
    from torch.nn.attention.bias import causal_lower_right

    if backend_name != "FLASH_ATTENTION":
        raise Unsupported("causal with seqlen_q != seqlen_k: SDPA's is_causal is top-left aligned, and "
                          "CausalBias (bottom-right) picks its own kernel (flash when it can)")
    if not can_use_flash_attention(SDPAParams(q, k, v, None, 0.0, False, shape.nheads != shape.nheads_k), True):
        raise Unsupported("CausalBias (bottom-right causal) would not use the flash kernel for these inputs")
    return causal_lower_right(shape.seqlen_q, shape.seqlen_k)


@functools.cache
def _compiled_flex_attention():
    from torch.nn.attention.flex_attention import flex_attention

    # dynamic=False: kernels specialised to each shape, as a model with fixed shapes gets
    # them. The sweep has more shapes than dynamo's default recompile limit (8), past
    # which it would silently fall back to eager flex_attention.
    config = torch._dynamo.config
    limit_name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    setattr(config, limit_name, max(getattr(config, limit_name), 256))
    return torch.compile(flex_attention, dynamic=False)


def _flex(shape, q, k, v):
    from torch.nn.attention.flex_attention import create_block_mask

    flex_attention = _compiled_flex_attention()
    block_mask = None
    if shape.causal:
        diagonal = shape.seqlen_k - shape.seqlen_q

        def bottom_right_causal(b, h, q_idx, kv_idx):
            return kv_idx <= q_idx + diagonal

        # once per shape, outside the timing, as a training loop builds it once
        block_mask = create_block_mask(bottom_right_causal, None, None, shape.seqlen_q, shape.seqlen_k,
                                       device=q.device)
    gqa = shape.nheads != shape.nheads_k
    return (lambda q, k, v: flex_attention(q, k, v, block_mask=block_mask, scale=shape.scale, enable_gqa=gqa)), \
        contextlib.nullcontext()


def _flash_attn_2(shape, q, k, v):
    from flash_attn import flash_attn_func as fa2

    return (lambda q, k, v: fa2(q, k, v, softmax_scale=shape.scale, causal=shape.causal)), contextlib.nullcontext()


def _flash_attn_4(shape, q, k, v):
    from flash_attn.cute import flash_attn_func as fa4

    def attend(q, k, v):
        result = fa4(q, k, v, softmax_scale=shape.scale, causal=shape.causal)
        return result[0] if isinstance(result, tuple) else result  # (out, lse) in recent versions

    return attend, contextlib.nullcontext()


def _importable(module: str, attribute: str) -> bool:
    try:
        return hasattr(importlib.import_module(module), attribute)
    except Exception:  # a broken install (missing CUDA libraries, ...) counts as absent
        return False


def _always(device):
    return True


def _cuda_only(device):
    return device == "cuda"


PROVIDERS = {p.name: p for p in [
    Provider("flashtile", "flashtile", "bshd", _always, _flashtile),
    Provider("sdpa_flash", "SDPA flash (FA2)", "bhsd", _always, _sdpa("FLASH_ATTENTION")),
    Provider("sdpa_cudnn", "SDPA cuDNN", "bhsd", _cuda_only, _sdpa("CUDNN_ATTENTION")),
    Provider("sdpa_efficient", "SDPA mem-efficient", "bhsd", _cuda_only, _sdpa("EFFICIENT_ATTENTION")),
    Provider("sdpa_math", "SDPA math", "bhsd", _always, _sdpa("MATH")),
    Provider("flex", "FlexAttention (compiled)", "bhsd",
             lambda d: d == "cuda" and _importable("torch.nn.attention.flex_attention", "flex_attention"), _flex),
    Provider("fa2", "flash-attn 2", "bshd",
             lambda d: d == "cuda" and _importable("flash_attn", "flash_attn_func"), _flash_attn_2),
    Provider("fa4", "FA4 (flash-attn-4 CuTe)", "bshd",
             lambda d: d == "cuda" and _importable("flash_attn.cute", "flash_attn_func"), _flash_attn_4),
]}


# ----------------------------------------------------------------------------------------------
# Measuring


def make_timer(device: str, warmup_ms: float, rep_ms: float) -> Callable[[Callable], float]:
    """→ timer(fn) returning the median time of one call of ``fn`` in ms."""
    if device == "cuda":
        from triton.testing import do_bench

        return lambda fn: do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")
    return lambda fn: _cpu_median_ms(fn, warmup_ms, rep_ms)


def _cpu_median_ms(fn, warmup_ms, rep_ms):
    def run_for(budget_ms):  # at least once, like do_bench
        times, start = [], time.perf_counter()
        while not times or (time.perf_counter() - start) * 1e3 < budget_ms:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return times

    run_for(warmup_ms)
    return statistics.median(run_for(rep_ms))


def _to_layout(t: torch.Tensor, layout: str) -> torch.Tensor:
    """(batch, seqlen, nheads, headdim) → the provider's layout, contiguous, as a new leaf."""
    return (t.transpose(1, 2).contiguous() if layout == "bhsd" else t).detach()


def _from_layout(t: torch.Tensor, layout: str) -> torch.Tensor:
    return t.transpose(1, 2) if layout == "bhsd" else t


def _checked_rows(seqlen_q: int, device) -> torch.Tensor:
    if seqlen_q <= CHECKED_ROWS:
        return torch.arange(seqlen_q, device=device)
    edges = [0, 1, 2, 3, seqlen_q - 4, seqlen_q - 3, seqlen_q - 2, seqlen_q - 1]
    spaced = torch.linspace(0, seqlen_q - 1, CHECKED_ROWS - len(edges)).round().long().tolist()
    return torch.tensor(sorted(set(edges + spaced)), device=device)


def _standard_attention_rows(q, k, v, rows, shape: Shape, dtype):
    """Standard attention for query ``rows`` only, in ``dtype``: q [B, Nq, H, D] → [B, R, H, D].

    The causal mask of those rows is bottom-right aligned as in the full matrix; a row
    that sees no key gets 0 (flashtile's convention).
    """
    group = shape.nheads // shape.nheads_k
    q_rows = q[:, rows].transpose(1, 2).to(dtype)  # [B, H, R, D]
    k_full = k.transpose(1, 2).to(dtype).repeat_interleave(group, dim=1)  # [B, H, Nk, D]
    v_full = v.transpose(1, 2).to(dtype).repeat_interleave(group, dim=1)  # [B, H, Nk, D]
    s = (q_rows @ k_full.transpose(-1, -2)) * shape.scale  # [B, H, R, Nk]
    if shape.causal:
        keys = torch.arange(shape.seqlen_k, device=q.device)
        visible = keys[None, :] <= rows[:, None] + (shape.seqlen_k - shape.seqlen_q)  # [R, Nk]
        s = s.masked_fill(~visible, -math.inf)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # rows with no visible key: 0, not NaN
    return (p @ v_full).transpose(1, 2)  # [B, R, H, D]


@dataclasses.dataclass
class AccuracyCheck:
    """float64 reference on sampled rows and the bound that flash-attn's rule allows."""

    rows: torch.Tensor
    expected: torch.Tensor
    bound: float

    @classmethod
    def for_inputs(cls, q, k, v, shape: Shape):
        rows = _checked_rows(shape.seqlen_q, q.device)
        expected = _standard_attention_rows(q, k, v, rows, shape, torch.float64)
        lowp = _standard_attention_rows(q, k, v, rows, shape, q.dtype)
        return cls(rows, expected, error_bound(expected, lowp, ACCURACY_FACTOR))


# The GPU idles while a first call compiles (seconds), and its clocks may take longer to climb back than
# the timer's 10 ms warm-up: in v0.5's sweep a shape timed right after a 4.7 s compile read 0.68x a later
# probe of it (benchmarks/NOTES.md, "Host overhead"). So each shape runs this long, after its first
# call, before it is timed.
CLOCK_RAMP_S = 0.3


def _keep_busy(fn, seconds: float) -> None:
    """Call ``fn`` for about ``seconds``: 8 calls queued at a time, so that short calls keep the GPU
    fed and slow ones do not queue minutes of work."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(8):
            fn()
        torch.cuda.synchronize()


def _forward_backward_once(attend, q, k, v, dout, device):
    """One forward+backward → (output, peak extra bytes on CUDA or None)."""
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    out = attend(q, k, v)
    torch.autograd.grad(out, (q, k, v), dout)
    if device != "cuda":
        return out.detach(), None
    torch.cuda.synchronize()
    return out.detach(), torch.cuda.max_memory_allocated() - before


def measure(provider: Provider, shape: Shape, inputs, check: AccuracyCheck, flashtile_out, timer, modes,
            device) -> dict:
    """Time, memory and accuracy of one provider on one shape → a record (the JSON row)."""
    record = dict(provider=provider.name, **dataclasses.asdict(shape), fwd_flops=forward_flops(shape))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            record.update(_measure(provider, shape, inputs, check, flashtile_out, timer, modes, device))
            record["status"] = "ok"
        except Exception as error:
            if provider.name == "flashtile" and not isinstance(error, torch.cuda.OutOfMemoryError):
                raise
            record.update(status="skipped", reason=_reason(error, caught))
        finally:
            if device == "cuda":
                torch.cuda.empty_cache()
    messages = _user_warnings(caught)
    if messages and record["status"] == "ok":
        record["warnings"] = messages
    return record


def _user_warnings(caught) -> list[str]:
    # SDPA explains why a backend refused a case in UserWarnings; deprecation notices are noise here
    return list(dict.fromkeys(str(w.message).strip() for w in caught if w.category is UserWarning))


def _measure(provider, shape, inputs, check, flashtile_out, timer, modes, device) -> dict:
    q, k, v, dout = (_to_layout(t, provider.layout) for t in inputs)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    attend, context = provider.build(shape, q, k, v)

    def forward():
        return attend(q, k, v)

    def forward_backward():
        torch.autograd.grad(attend(q, k, v), (q, k, v), dout)

    result = {}
    with context:
        start = time.perf_counter()
        forward_backward()  # compiles (Triton, torch.compile, CuTe) on the first call
        if device == "cuda":
            torch.cuda.synchronize()
        result["first_call_s"] = time.perf_counter() - start
        if device == "cuda":
            _keep_busy(forward_backward, CLOCK_RAMP_S)
        out, result["peak_memory_bytes"] = _forward_backward_once(attend, q, k, v, dout, device)
        out = _from_layout(out, provider.layout)
        err = max_error(out[:, check.rows], check.expected)
        result.update(max_error=err, error_bound=check.bound, accurate=bool(err <= check.bound))
        if flashtile_out is not None:
            result["max_diff_vs_flashtile"] = max_error(out, flashtile_out)
        if "fwd" in modes or "bwd" in modes:
            result["fwd_ms"] = timer(forward)
        if "fwd_bwd" in modes or "bwd" in modes:
            result["fwd_bwd_ms"] = timer(forward_backward)
        if device == "cuda":
            result["gpu_state_after"] = gpu_state(torch.cuda.current_device())
    result["output"] = out
    flops = forward_flops(shape)
    for mode, factor in (("fwd", 1.0), ("fwd_bwd", 1.0 + BWD_FLOPS_FACTOR)):
        if f"{mode}_ms" in result:
            result[f"{mode}_tflops"] = factor * flops / (result[f"{mode}_ms"] * 1e9)
    if "fwd_ms" in result and "fwd_bwd_ms" in result:
        result["bwd_ms"] = result["fwd_bwd_ms"] - result["fwd_ms"]
        # timing noise can make the difference ≤ 0 on tiny shapes: no rate then
        if result["bwd_ms"] > 0:
            result["bwd_tflops"] = BWD_FLOPS_FACTOR * flops / (result["bwd_ms"] * 1e9)
    return result


def _reason(error: Exception, caught) -> str:
    return " | ".join([f"{type(error).__name__}: {error}".strip(), *_user_warnings(caught)])


# ----------------------------------------------------------------------------------------------
# Sweep, environment, output


def build_sweep(args, device: str) -> list[tuple[str, list[Shape]]]:
    """→ [(case label, shapes in seqlen order)], the anchors' order: headdim, then causal."""
    standard = STANDARD_SWEEP[device]
    seqlens = args.seqlens or standard["seqlens"]
    causals = (False, True) if args.causal is None else (args.causal,)
    cases = []
    for headdim in args.headdims or standard["headdims"]:
        nheads = args.nheads or max(1, standard["hidden"] // headdim)
        nheads_k = args.nheads_k or nheads
        if nheads % nheads_k:
            raise ValueError(f"--nheads ({nheads}) must be a multiple of --nheads-k ({nheads_k})")
        for causal in causals:
            label = f"{args.dtype} hdim {headdim} {'causal' if causal else 'non-causal'}, " + (
                f"batch {args.batch}" if args.batch else f"batch·seqlen {standard['tokens']}") + (
                f", nheads {nheads}" if nheads == nheads_k else f", nheads {nheads}:{nheads_k} (GQA)") + (
                f", seqlen_k {args.seqlen_k}" if args.seqlen_k else "")
            shapes = [Shape(args.batch or max(1, standard["tokens"] // n), n, args.seqlen_k or n,
                            nheads, nheads_k, headdim, causal, args.dtype) for n in seqlens]
            cases.append((label, shapes))
    return cases


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


class Progress:
    """tqdm on a terminal when it is installed; else a counter line on stderr, rewritten
    in place on a terminal and one line per run in a log (where tqdm's redraws are noise)."""

    def __init__(self, total: int):
        self.total, self.done = total, 0
        self._overwrite = sys.stderr.isatty()
        self._bar = None
        if self._overwrite:
            try:
                from tqdm import tqdm
            except ImportError:
                pass
            else:
                self._bar = tqdm(total=total, file=sys.stderr, unit="run", dynamic_ncols=True)

    def step(self, text: str):
        """Announce the run that starts now."""
        if self._bar is not None:
            self._bar.set_description_str(text)
        else:
            line = f"[{self.done}/{self.total}] {text}"
            sys.stderr.write(f"\r\033[K{line}" if self._overwrite else line + "\n")
            sys.stderr.flush()

    def advance(self):
        self.done += 1
        if self._bar is not None:
            self._bar.update(1)

    def write(self, text: str):
        if self._bar is not None:
            self._bar.write(text, file=sys.stdout)
        else:
            if self._overwrite:
                sys.stderr.write("\r\033[K")
            print(text, flush=True)

    def close(self):
        if self._bar is not None:
            self._bar.close()
        else:
            if self._overwrite:
                sys.stderr.write("\r\033[K")
            sys.stderr.write(f"[{self.done}/{self.total}] done\n")


def _fmt(x) -> str:
    if x is None:
        return "—"
    return f"{x:.0f}" if abs(x) >= 100 else f"{x:.3g}"


def _fmt_ratio(x) -> str:
    return "—" if x is None else f"{x:.2f}"


def _ratio(a, b):
    return a / b if a is not None and b else None


def format_case_table(label: str, records: list[dict]) -> str:
    """Rows providers, columns seqlens; cells fwd / bwd TFLOP/s, then ratios, memory, notes."""
    seqlens = sorted({r["seqlen_q"] for r in records})
    providers = list(dict.fromkeys(r["provider"] for r in records))
    cell = {(r["provider"], r["seqlen_q"]): r for r in records}

    def speed(p, n):
        r = cell.get((p, n))
        if r is None or r["status"] != "ok":
            return "skip" if r is not None else ""
        return f"{_fmt(r.get('fwd_tflops'))} / {_fmt(r.get('bwd_tflops'))}"

    rows = [[p, *(speed(p, n) for n in seqlens), _accuracy_note(p, records)] for p in providers]
    if "flashtile" in providers:
        for peer in providers:
            if peer == "flashtile":
                continue
            ratios = []
            for n in seqlens:
                ours, theirs = cell.get(("flashtile", n), {}), cell.get((peer, n), {})
                fwd, bwd = (_ratio(ours.get(f"{m}_tflops"), theirs.get(f"{m}_tflops")) for m in ("fwd", "bwd"))
                ratios.append("" if fwd is None and bwd is None else f"{_fmt_ratio(fwd)} / {_fmt_ratio(bwd)}")
            if any(ratios):
                rows.append([f"flashtile/{peer}", *ratios, ""])
    lines = [f"\n{label} — fwd / bwd TFLOP/s ({BWD_METHOD})"]
    lines += _grid(["provider", *(f"N={n}" for n in seqlens), "accuracy"], rows)
    memory_rows = [[p, *(_mib(cell.get((p, n))) for n in seqlens)] for p in providers]
    if any(c not in ("", "—") for row in memory_rows for c in row[1:]):
        lines.append("peak memory of one fwd+bwd beyond the inputs, MiB")
        lines += _grid(["provider", *(f"N={n}" for n in seqlens)], memory_rows)
    else:
        lines.append("peak memory: measured on CUDA only")
    skips = {}
    for r in records:
        if r["status"] != "ok":
            skips.setdefault((r["provider"], r["reason"]), []).append(r["seqlen_q"])
    for (p, reason), ns in skips.items():
        short = reason if len(reason) <= 300 else reason[:297] + "..."
        lines.append(f"  skipped {p} at N={','.join(map(str, ns))}: {short}")
    return "\n".join(lines)


def _accuracy_note(provider: str, records: list[dict]) -> str:
    ok = [r for r in records if r["provider"] == provider and r["status"] == "ok"]
    bad = [r for r in ok if not r["accurate"]]
    if bad:
        return "MISMATCH " + ", ".join(
            f"N={r['seqlen_q']}: err {r['max_error']:.2e} > {r['error_bound']:.2e}" for r in bad)
    diffs = [r["max_diff_vs_flashtile"] for r in ok if r.get("max_diff_vs_flashtile") is not None]
    if not ok:
        return ""
    return "ok" if provider == "flashtile" or not diffs else f"ok (max |Δ flashtile| {max(diffs):.1e})"


def _mib(r):
    if r is None or r["status"] != "ok":
        return ""
    return _fmt(None if r["peak_memory_bytes"] is None else r["peak_memory_bytes"] / 2**20)


def _grid(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]
    return ["  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
            for row in [header, *rows]]


def write_plots(results: dict, out_dir: Path) -> list[Path]:
    """One PNG per case: TFLOP/s vs seqlen (a line per provider and mode), memory vs seqlen."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    paths = []
    by_case = {}
    for r in results["measurements"]:
        by_case.setdefault(r["case"], []).append(r)
    for case, records in by_case.items():
        fig, (ax_speed, ax_memory) = plt.subplots(1, 2, figsize=(13, 4.8))
        providers = list(dict.fromkeys(r["provider"] for r in records))
        for i, provider in enumerate(providers):
            ok = sorted((r for r in records if r["provider"] == provider and r["status"] == "ok"),
                        key=lambda r: r["seqlen_q"])
            for mode, style in (("fwd", "-"), ("bwd", "--"), ("fwd_bwd", ":")):
                points = [(r["seqlen_q"], r[f"{mode}_tflops"]) for r in ok if r.get(f"{mode}_tflops")]
                if points:
                    ax_speed.plot(*zip(*points), style, marker="o", color=f"C{i}", label=f"{provider} {mode}")
            points = [(r["seqlen_q"], r["peak_memory_bytes"] / 2**20) for r in ok if r["peak_memory_bytes"]]
            if points:
                ax_memory.plot(*zip(*points), marker="o", color=f"C{i}", label=provider)
        seqlens = sorted({r["seqlen_q"] for r in records})
        ax_speed.set(xlabel="seqlen", ylabel="TFLOP/s", title=f"speed ({BWD_METHOD})")
        ax_memory.set(xlabel="seqlen", ylabel="MiB", title="peak memory of one fwd+bwd beyond the inputs")
        for ax in (ax_speed, ax_memory):
            ax.set_xscale("log", base=2)
            ax.set_xticks(seqlens, [str(n) for n in seqlens])
            ax.minorticks_off()
            ax.grid(True, alpha=0.3)
            if ax.lines:
                ax.legend(fontsize=7, ncol=2)
        if ax_memory.lines:
            ax_memory.set_yscale("log")
        else:
            ax_memory.text(0.5, 0.5, "measured on CUDA only", ha="center", transform=ax_memory.transAxes)
        fig.suptitle(f"{case} — {results['environment']['device']}, {results['environment']['date']}")
        fig.tight_layout()
        path = out_dir / (re.sub(r"[^a-z0-9]+", "_", case.lower()).strip("_") + ".png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


# ----------------------------------------------------------------------------------------------
# Commands


def run_bench(args, cases: list[tuple[str, list[Shape]]], device: str) -> int:
    names = list(dict.fromkeys(args.providers or [n for n, p in PROVIDERS.items() if p.present(device)]))
    names.sort(key=lambda n: n != "flashtile")  # first: the others are compared with its output
    out_dir = args.out_dir or Path(f"flashtile-bench-{datetime.datetime.now():%Y%m%d-%H%M%S}")
    out_dir.mkdir(parents=True, exist_ok=True)
    timer = make_timer(device, args.warmup, args.rep)
    timer_text = ("triton.testing.do_bench median" if device == "cuda" else "time.perf_counter median") + \
        f" (warmup {args.warmup} ms, rep {args.rep} ms)"
    results = dict(
        flashtile_bench=1,
        environment=environment(device),
        settings=dict(
            timer=timer_text, bwd_method=BWD_METHOD, flops=FLOPS_RULE, modes=list(args.modes),
            providers={n: PROVIDERS[n].label for n in names},
            accuracy=f"output on <= {CHECKED_ROWS} query rows vs float64: error <= {ACCURACY_FACTOR}x "
                     "PyTorch's own error in the input dtype + float32-ulp floor",
            peak_memory="max_memory_allocated over one fwd+bwd minus memory allocated before (CUDA)",
        ),
        measurements=[],
    )
    env = results["environment"]
    print(f"flashtile bench on {env['device']}: torch {env['torch']}, triton {env['triton']}, "
          f"python {env['python']}{', driver ' + env['driver'] if env.get('driver') else ''}")
    print("providers: " + ", ".join(f"{n} ({PROVIDERS[n].label})" if PROVIDERS[n].label != n else n for n in names))
    print(f"timer: {timer_text}")
    print(f"FLOPs: {FLOPS_RULE}. Backward: {BWD_METHOD}.")
    json_path, text_path = out_dir / "bench.json", out_dir / "bench.txt"
    text_path.write_text("")
    progress = Progress(sum(len(shapes) for _, shapes in cases) * len(names))
    try:
        for label, shapes in cases:
            case_records = []
            for shape in shapes:
                inputs, check = _random_inputs(shape, device)
                flashtile_out = None
                for name in names:
                    progress.step(f"{label} N={shape.seqlen_q}: {name}")
                    record = measure(PROVIDERS[name], shape, inputs, check, flashtile_out, timer, args.modes, device)
                    output = record.pop("output", None)
                    if name == "flashtile":
                        flashtile_out = output
                    record["case"] = label
                    case_records.append(record)
                    progress.advance()
                del inputs, check, flashtile_out
            results["measurements"] += case_records
            json_path.write_text(json.dumps(results, indent=1))
            table = format_case_table(label, case_records)
            with text_path.open("a") as f:
                f.write(table + "\n")
            progress.write(table)
    finally:
        progress.close()
    plots = write_plots(results, out_dir)
    print(f"\nwrote {json_path}, the tables in {text_path}"
          + (f" and {len(plots)} plots in {out_dir}" if plots else " (no matplotlib: no plots)"))
    return 0


def _random_inputs(shape: Shape, device: str):
    torch.manual_seed(0)
    dtype = DTYPES[shape.dtype]
    q = torch.randn(shape.batch, shape.seqlen_q, shape.nheads, shape.headdim, device=device, dtype=dtype)
    k, v = (torch.randn(shape.batch, shape.seqlen_k, shape.nheads_k, shape.headdim, device=device, dtype=dtype)
            for _ in range(2))
    dout = torch.randn_like(q)
    return (q, k, v, dout), AccuracyCheck.for_inputs(q, k, v, shape)


def _shape_key(r: dict):
    return tuple(r[f] for f in ("dtype", "batch", "seqlen_q", "seqlen_k", "nheads", "nheads_k", "headdim", "causal"))


def compare(before_path: Path, after_path: Path, threshold_pct: float) -> int:
    """Before/after table of flashtile's TFLOP/s; exit status 1 if any is slower by > threshold."""
    before, after = (json.loads(Path(p).read_text()) for p in (before_path, after_path))
    print(f"flashtile TFLOP/s, before = {before_path} ({before['environment']['date']}, "
          f"{before['environment']['device']}), after = {after_path} ({after['environment']['date']}, "
          f"{after['environment']['device']})")
    if before["environment"]["device"] != after["environment"]["device"]:
        print("warning: the two runs are on different devices")
    old = {_shape_key(r): r for r in before["measurements"] if r["provider"] == "flashtile" and r["status"] == "ok"}
    rows, changes = [], []
    for r in after["measurements"]:
        if r["provider"] != "flashtile" or r["status"] != "ok" or _shape_key(r) not in old:
            continue
        cells = []
        for mode in MODES:
            a, b = old[_shape_key(r)].get(f"{mode}_tflops"), r.get(f"{mode}_tflops")
            if a and b:
                change = 100 * (b / a - 1)
                changes.append((change, mode, r["case"], r["seqlen_q"]))
                cells.append(f"{_fmt(a)} → {_fmt(b)} ({change:+.1f}%)")
            else:
                cells.append("—")
        rows.append([r["case"], str(r["seqlen_q"]), *cells])
    if not rows:
        print("no flashtile measurement of the same shape in both files")
        return 1
    print("\n".join(_grid(["case", "N", *MODES], rows)))
    if not changes:
        print("no rate measured in both files")
        return 1
    geomeans = []
    for mode in MODES:
        ratios = [1 + c[0] / 100 for c in changes if c[1] == mode]
        if ratios:
            geomeans.append(f"{mode} {100 * (math.prod(ratios) ** (1 / len(ratios)) - 1):+.1f}%")
    slower = [c for c in changes if c[0] < -threshold_pct]
    worst = min(changes)
    print(f"\ngeometric mean change: {', '.join(geomeans)}")
    print(f"worst change: {worst[0]:+.1f}% ({worst[1]}, {worst[2]}, N={worst[3]}); "
          + (f"{len(slower)} of {len(changes)} slower by more than {threshold_pct:g}%" if slower
             else f"none slower by more than {threshold_pct:g}%"))
    return 1 if slower else 0


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _choice_list(choices):
    def parse(text: str) -> list[str]:
        values = [x.strip() for x in text.split(",") if x.strip()]
        unknown = [x for x in values if x not in choices]
        if unknown or not values:
            raise argparse.ArgumentTypeError(f"unknown {unknown or text!r}; choose from {', '.join(choices)}")
        return values

    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    shapes = parser.add_argument_group("shapes (default: the standard sweep)")
    shapes.add_argument("--seqlens", "--seqlen", type=_int_list, metavar="N,...",
                        help="query lengths (default 512,...,16384 on CUDA)")
    shapes.add_argument("--seqlen-k", type=int, help="key length for every case (default: = seqlen)")
    shapes.add_argument("--batch", type=int, help="batch size (default: batch·seqlen = 16384 on CUDA)")
    shapes.add_argument("--nheads", type=int, help="query heads (default: nheads·headdim = 2048 on CUDA)")
    shapes.add_argument("--nheads-k", type=int, help="key/value heads, for GQA (default: = nheads)")
    shapes.add_argument("--headdims", "--headdim", type=_int_list, metavar="D,...", help="head dims (default 64,128)")
    shapes.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    shapes.add_argument("--causal", action=argparse.BooleanOptionalAction, default=None,
                        help="only causal (--causal) or only non-causal (--no-causal); default both")
    parser.add_argument("--providers", type=_choice_list(list(PROVIDERS)), metavar="NAME,...",
                        help=f"from {', '.join(PROVIDERS)} (default: those present on this machine)")
    parser.add_argument("--modes", type=_choice_list(MODES), default=list(MODES), metavar="MODE,...",
                        help="fwd, bwd, fwd_bwd (bwd needs the fwd and fwd_bwd timings; default all)")
    # Below do_bench's own 25/100 ms so that the standard sweep with every peer fits in ~6 min on
    # an H200; 50 ms is still ≥ 300 calls at N = 512 and ≥ 2 at the slowest fwd+bwd (N = 16384).
    parser.add_argument("--warmup", type=float, default=10.0, help="warmup per timing, ms (default 10)")
    parser.add_argument("--rep", type=float, default=50.0, help="timed repetitions per timing, ms (default 50)")
    parser.add_argument("--out-dir", type=Path, help="where bench.json and the plots go "
                        "(default ./flashtile-bench-<date>-<time>)")
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("BEFORE.json", "AFTER.json"),
                        help="print flashtile's before/after TFLOP/s from two runs instead of measuring")
    parser.add_argument("--threshold", type=float, default=3.0,
                        help="with --compare: exit status 1 if anything is slower by more than this %% (default 3)")


def main_bench(args, parser: argparse.ArgumentParser) -> int:
    if args.compare:
        return compare(*args.compare, args.threshold)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        cases = build_sweep(args, device)
    except ValueError as error:
        parser.error(str(error))
    return run_bench(args, cases, device)
