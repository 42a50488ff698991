"""Measuring one provider on one shape: the timers (the time of each repeat), the clock ramp
before timing, peak memory, the rates, and the accuracy check against float64 standard
attention on sampled query rows."""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
import warnings
from typing import Callable

import torch

from ...accuracy import error_bound, max_error
from .machine import gpu_state
from .providers import BWD_FLOPS_FACTOR, Provider, Shape, forward_flops
from .spread import backward_fields, spread_fields

MODES = ("fwd", "bwd", "fwd_bwd")
BWD_METHOD = "bwd = (fwd+bwd) - fwd, each timed separately"
ACCURACY_FACTOR = 2  # flash-attn's rule for outputs (flashtile.accuracy)
CHECKED_ROWS = 64  # query rows compared with float64: first, last and evenly spaced ones


def make_repeat_timer(device: str, warmup_ms: float, rep_ms: float) -> Callable[[Callable], list[float]]:
    """→ timer(fn) returning the time of each timed call of ``fn`` in ms: do_bench's repeats on CUDA
    (as many as fit in ``rep_ms``), on the CPU as many as fit and at least ``MIN_CPU_REPEATS``."""
    if device == "cuda":
        from triton.testing import do_bench  # triton is a dependency on Linux only

        return lambda fn: do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="all")
    return lambda fn: _cpu_times_ms(fn, warmup_ms, rep_ms)


def make_timer(device: str, warmup_ms: float, rep_ms: float) -> Callable[[Callable], float]:
    """→ timer(fn) returning the median time of one call of ``fn`` in ms, for scripts that want one
    figure (benchmarks/variants_bench.py)."""
    repeat_timer = make_repeat_timer(device, warmup_ms, rep_ms)
    return lambda fn: statistics.median(repeat_timer(fn))


# A spread needs a few repeats, and a CPU call of a large shape can outlast the whole --rep budget.
# With 5, the 20th and 80th percentiles lie mostly on the second and fourth times, so that one stray
# call moves them little.
MIN_CPU_REPEATS = 5


def _cpu_times_ms(fn, warmup_ms, rep_ms):
    def run_for(budget_ms, min_calls):
        times, start = [], time.perf_counter()
        while len(times) < min_calls or (time.perf_counter() - start) * 1e3 < budget_ms:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return times

    run_for(warmup_ms, 1)  # at least once, like do_bench
    return run_for(rep_ms, MIN_CPU_REPEATS)


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
            record.update(status="skipped", reason=failure_reason(error, caught))
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
            result.update(spread_fields("fwd", timer(forward)))
        if "fwd_bwd" in modes or "bwd" in modes:
            result.update(spread_fields("fwd_bwd", timer(forward_backward)))
        if device == "cuda":
            result["gpu_state_after"] = gpu_state(torch.cuda.current_device())
    result["output"] = out
    result.update(backward_fields(result))
    result.update(rate_fields(result, forward_flops(shape)))
    return result


def rate_fields(timings: dict, flops: float) -> dict:
    """``{mode}_tflops`` of each mode timed in ``timings`` (its ``{mode}_ms``, bwd's included), for
    a forward of ``flops``."""
    rates = {}
    for mode, factor in (("fwd", 1.0), ("bwd", BWD_FLOPS_FACTOR), ("fwd_bwd", 1.0 + BWD_FLOPS_FACTOR)):
        # timing noise can make bwd = (fwd+bwd) − fwd ≤ 0 on tiny shapes: no rate then
        if timings.get(f"{mode}_ms", 0) > 0:
            rates[f"{mode}_tflops"] = factor * flops / (timings[f"{mode}_ms"] * 1e9)
    return rates


def failure_reason(error: Exception, caught) -> str:
    """What a skipped record says: the error, then the UserWarnings ``caught`` while it ran (SDPA's
    reasons for refusing a case)."""
    return " | ".join([f"{type(error).__name__}: {error}".strip(), *_user_warnings(caught)])
