"""``python -m flashtile bench``: speed and peak memory of flashtile next to the attention
kernels present on this machine, on the standard sweep or on shapes from the command line.

For each shape and provider:

* **time** of the forward and of forward+backward, each as several repeats of one call:
  ``triton.testing.do_bench``'s on CUDA (``--warmup``/``--rep`` in ms; it flushes L2 between
  calls), ``time.perf_counter`` around each call on the CPU, over the same budgets and at least
  5 of them. The figure is the median; the **spread** is the range from the 20th to the 80th
  percentile of the repeats (bench.json also keeps the min, the max and the number of repeats).
  On CUDA each shape first runs for ``CLOCK_RAMP_S`` after its first (compiling) call, so that
  the GPU's clocks are up. The backward is not timed alone: backward = (forward+backward) −
  forward, as in the H200 anchors (benchmarks/NOTES.md), with the widest spread the two allow.
* **rate**: in TFLOP/s on CUDA, in GFLOP/s on the CPU (the unit is in every table header and in
  bench.json's ``settings.rate_unit``; the records' ``*_tflops`` fields stay in TFLOP/s). Forward
  FLOPs 4·B·H·Nq·Nk·D (the QKᵀ and PV matmuls), ×0.5 when causal with Nq = Nk (the usual
  convention, which the anchors use); when causal with Nq ≠ Nk, 4·B·H·D·(exact number of visible
  query-key pairs, bottom-right alignment). Backward FLOPs are 2.5× the forward's,
  forward+backward 3.5×.
* **peak memory**: ``torch.cuda.max_memory_allocated`` over one forward+backward, minus what
  was allocated before it (q, k, v and dout are not counted). Not measured on the CPU.
* **accuracy**: the output of that forward+backward on sampled query rows against float64
  standard attention, with flash-attn's rule (error ≤ 2× PyTorch's own error in the input
  dtype, plus a float32-ulp floor), and the largest difference from flashtile's output.

The tables show each rate as ``median ±x%``, x being half the p20–p80 range in % of the median;
a legend under each table explains every symbol it uses (``—`` where the backward came out ≤ 0
within noise, ``!`` where the repeats disagree, ``skip``, the ratios, the accuracy column). One
**noise warning** at the end of a run, also in bench.json's ``noise``, says when repeats disagree
by more than 20% of their median (p80 − p20, ``NOISY_SPREAD``), when the machine was busy before
the run (1-minute load average above its number of CPUs), or, on CUDA, when the providers of one
shape left the GPU at SM clocks more than 5% apart (``CLOCK_DISPARITY``: a GPU at its power cap
sets its clock by the power drawn, so their ratio carries that difference).

Inputs are random normal, in each provider's own layout: (batch, seqlen, nheads, headdim)
for flashtile and flash-attn, (batch, nheads, seqlen, headdim) for SDPA and FlexAttention.
A provider named in ``--providers`` that cannot run on this machine (not installed, or
CUDA only) is an error before anything runs; ``--providers all`` takes every provider that can.
A peer that refuses a case (SDPA backend constraints, out of memory, ...) is recorded as
skipped, with the reason it gave. FlexAttention is compiled once per shape (dynamic=False),
with its causal block mask built once per shape, outside the timing.

The standard sweep (no shape arguments) is the anchors': bf16, batch·seqlen = 16384,
nheads·headdim = 2048, headdim 64 and 128, non-causal and causal, seqlen 512..16384; on a
machine without CUDA, a scaled-down one (batch·seqlen = 1024, nheads·headdim = 256,
seqlen 128..512).

Outputs, in ``--out-dir``: ``bench.json`` (every measurement and the environment) and
``bench.txt`` (the tables), both rewritten after each case, and with matplotlib one PNG per
case (a panel per direction, and one of peak memory where measured); the tables also go to
stdout, the progress to stderr.
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

import torch

from .compare import compare
from .machine import cpu_load, environment, gpu_state
from .plots import write_plots
from .providers import BWD_FLOPS_FACTOR, DTYPES, FLOPS_RULE, PROVIDERS, RATE_UNITS, Shape, forward_flops
from .report import Progress, format_case_table
from .spread import assess_noise
from .timing import (ACCURACY_FACTOR, BWD_METHOD, CHECKED_ROWS, MIN_CPU_REPEATS, MODES, AccuracyCheck,
                     failure_reason, make_repeat_timer, make_timer, measure)

__all__ = [
    "BWD_FLOPS_FACTOR",
    "BWD_METHOD",
    "Shape",
    "add_arguments",
    "build_sweep",
    "environment",
    "failure_reason",
    "forward_flops",
    "gpu_state",
    "main_bench",
    "make_timer",
    "provider_names",
    "run_bench",
]

# The anchors' sweep (benchmarks/NOTES.md) on CUDA: batch·seqlen and nheads·headdim fixed.
# On the CPU the same design, scaled down so that it runs in seconds.
STANDARD_SWEEP = {
    "cuda": dict(tokens=16384, hidden=2048, seqlens=(512, 1024, 2048, 4096, 8192, 16384), headdims=(64, 128)),
    "cpu": dict(tokens=1024, hidden=256, seqlens=(128, 256, 512), headdims=(64, 128)),
}


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


def provider_names(requested: list[str] | None, device: str) -> list[str]:
    """The providers to run, flashtile first (the others are compared with its output): those named,
    or with "all" or none named, every one that can run here. ValueError, saying why, if a named one
    cannot."""
    available = [name for name, provider in PROVIDERS.items() if provider.unavailable(device) is None]
    named = [name for name in requested or [] if name != "all"]
    unavailable = {name: PROVIDERS[name].unavailable(device) for name in named if name not in available}
    if unavailable:
        raise ValueError("not available on this machine: " + "; ".join(
            f"{name} ({reason})" for name, reason in unavailable.items())
            + f". Available here: {', '.join(available)} (--providers all takes those)")
    names = list(dict.fromkeys(named + (available if not requested or "all" in requested else [])))
    return sorted(names, key=lambda name: name != "flashtile")


def run_bench(args, cases: list[tuple[str, list[Shape]]], device: str, names: list[str]) -> int:
    out_dir = args.out_dir or Path(f"flashtile-bench-{datetime.datetime.now():%Y%m%d-%H%M%S}")
    out_dir.mkdir(parents=True, exist_ok=True)
    load = cpu_load()  # before the run, which loads the machine itself
    timer = make_repeat_timer(device, args.warmup, args.rep)
    unit = RATE_UNITS[device]
    timer_text = ("triton.testing.do_bench repeats" if device == "cuda"
                  else f"time.perf_counter per call, >= {MIN_CPU_REPEATS} repeats") + \
        f" (warmup {args.warmup} ms, rep {args.rep} ms): median, spread p20-p80"
    results = dict(
        flashtile_bench=1,
        environment=environment(device),
        settings=dict(
            timer=timer_text, bwd_method=BWD_METHOD, flops=FLOPS_RULE, modes=list(args.modes),
            rate_unit=unit,
            spread="<mode>_ms is the median of <mode>_repeats calls; <mode>_ms_p20/_p80/_min/_max their "
                   "quantiles; bwd's from fwd_bwd's and fwd's, the widest they allow",
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
    print(f"rates in {unit}. FLOPs: {FLOPS_RULE}. Backward: {BWD_METHOD}.")
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
            results["noise"] = assess_noise(results["measurements"], load)
            json_path.write_text(json.dumps(results, indent=1))
            table = format_case_table(label, case_records, unit)
            with text_path.open("a") as f:
                f.write(table + "\n")
            progress.write(table)
    finally:
        progress.close()
    warning = results["noise"]["warning"]
    if warning:  # once per run, after every table
        print("\n" + warning)
        with text_path.open("a") as f:
            f.write("\n" + warning + "\n")
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
    parser.add_argument("--providers", type=_choice_list([*PROVIDERS, "all"]), metavar="NAME,...",
                        help=f"from {', '.join(PROVIDERS)}; a named one that cannot run here is an error; "
                             "'all' (the default): every one that can run here")
    parser.add_argument("--modes", type=_choice_list(MODES), default=list(MODES), metavar="MODE,...",
                        help="fwd, bwd, fwd_bwd (bwd needs the fwd and fwd_bwd timings; default all)")
    # Below do_bench's own 25/100 ms so that the standard sweep with every peer fits in ~6 min on
    # an H200; 50 ms is still ≥ 300 calls at N = 512 and ≥ 2 at the slowest fwd+bwd (N = 16384).
    parser.add_argument("--warmup", type=float, default=10.0, help="warmup per timing, ms (default 10)")
    parser.add_argument("--rep", type=float, default=50.0, help="timed repetitions per timing, ms (default 50)")
    parser.add_argument("--out-dir", type=Path, help="where bench.json and the plots go "
                        "(default ./flashtile-bench-<date>-<time>)")
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("BEFORE.json", "AFTER.json"),
                        help="print flashtile's before/after rates from two runs instead of measuring")
    parser.add_argument("--threshold", type=float, default=3.0,
                        help="with --compare: exit status 1 if anything is slower by more than this %% (default 3) "
                             "and beyond noise: a slowdown whose before and after p20-p80 ranges overlap is "
                             "shown as within noise and does not count")


def main_bench(args, parser: argparse.ArgumentParser) -> int:
    if args.compare:
        return compare(*args.compare, args.threshold)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        cases = build_sweep(args, device)
        names = provider_names(args.providers, device)
    except ValueError as error:
        parser.error(str(error))
    return run_bench(args, cases, device, names)
