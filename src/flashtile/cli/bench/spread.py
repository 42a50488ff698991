"""How far the repeats of a timing spread, and when not to trust them: the spread fields of a
record, the noise warning of a run, and whether a before/after pair differs beyond noise.

A timing is several repeats of one call; its figure is their median, its spread the range from
their 20th to their 80th percentile (do_bench's own quantiles), which one slow repeat does not
move as it moves the min and max (also recorded).
"""

from __future__ import annotations

import torch

SPREAD_QUANTILES = (0.2, 0.5, 0.8)
# (p80 − p20) / median beyond which a timing's repeats disagree. On the project's shared 2-core CPU
# at a load of ~1, most timings spread 3–16%; past 20% the ratio of two providers' figures is
# uncertain by about as much, far beyond --compare's 3%. A busy machine spreads much wider (a run
# beside other jobs read up to ~100× off), and where it is busy throughout, the load says so.
NOISY_SPREAD = 0.2
# Relative difference of the SM clocks that two providers of one shape left the GPU at, beyond which their ratio
# is suspect: a GPU at its power cap (an H100's 700 W) sets its clock by the power drawn, and one sweep read 1680
# against 1830 MHz after the same forward kernel under two provider names, 508 against 609 TFLOP/s
# (benchmarks/NOTES.md, nineteenth session).
CLOCK_DISPARITY = 0.05
NOISE_WARNING = "warning: these timings may be noise: "
TIMED_MODES = ("fwd", "fwd_bwd")  # bwd is their difference, not timed itself


def spread_fields(mode: str, times_ms: list[float]) -> dict:
    """The record's fields of one timing from its per-repeat times: ``{mode}_ms`` (the median),
    ``_ms_min``, ``_ms_p20``, ``_ms_p80``, ``_ms_max`` and ``{mode}_repeats``."""
    p20, median, p80 = torch.tensor(times_ms, dtype=torch.float64).quantile(
        torch.tensor(SPREAD_QUANTILES, dtype=torch.float64)).tolist()
    return {f"{mode}_ms": median, f"{mode}_ms_min": min(times_ms), f"{mode}_ms_p20": p20, f"{mode}_ms_p80": p80,
            f"{mode}_ms_max": max(times_ms), f"{mode}_repeats": len(times_ms)}


def backward_fields(record: dict) -> dict:
    """bwd = (fwd+bwd) − fwd, with the widest spread that the two timings' spreads allow (the
    fastest fwd+bwd minus the slowest fwd, ...); empty unless both were timed."""
    if "fwd_ms" not in record or "fwd_bwd_ms" not in record:
        return {}
    fields = {"bwd_ms": record["fwd_bwd_ms"] - record["fwd_ms"]}
    for low, high in (("min", "max"), ("p20", "p80")):
        if f"fwd_ms_{low}" in record:
            fields[f"bwd_ms_{low}"] = record[f"fwd_bwd_ms_{low}"] - record[f"fwd_ms_{high}"]
            fields[f"bwd_ms_{high}"] = record[f"fwd_bwd_ms_{high}"] - record[f"fwd_ms_{low}"]
    return fields


def quantiles(record: dict, mode: str) -> tuple[float, float, float] | None:
    """(p20, median, p80) of a timing in ms; None where unknown (a bench.json from before spreads)."""
    values = tuple(record.get(f"{mode}_ms{suffix}") for suffix in ("_p20", "", "_p80"))
    return None if None in values else values


def relative_spread(record: dict, mode: str) -> float | None:
    """(p80 − p20) / median of a timing; None where unknown or the median is ≤ 0."""
    known = quantiles(record, mode)
    if known is None or known[1] <= 0:
        return None
    p20, median, p80 = known
    return (p80 - p20) / median


def is_noisy(record: dict, mode: str) -> bool:
    """Whether the repeats of a timing disagree beyond NOISY_SPREAD; for bwd, those of either timing
    it comes from (its own range is theirs added, wide by construction)."""
    spreads = (relative_spread(record, m) for m in (TIMED_MODES if mode == "bwd" else (mode,)))
    return any(spread is not None and spread > NOISY_SPREAD for spread in spreads)


def within_noise(before: dict, after: dict, mode: str) -> bool | None:
    """Whether the p20–p80 ranges of one timing in two runs overlap; None where either is unknown.
    (The shapes are the same, so the times overlap exactly where the rates do.)"""
    known = [quantiles(r, mode) for r in (before, after)]
    if None in known:
        return None
    (low_a, _, high_a), (low_b, _, high_b) = known
    return low_a <= high_b and low_b <= high_a


def clock_disparities(records: list[dict]) -> tuple[list[dict], int]:
    """The shapes whose providers left the GPU at SM clocks more than ``CLOCK_DISPARITY`` apart (each
    record's ``gpu_state_after``; CUDA only), each with its lowest and highest clock and the providers
    that left them, and the number of shapes that had two clocked providers to compare."""
    shapes: dict = {}
    for r in records:
        clock = (r.get("gpu_state_after") or {}).get("sm_clock_mhz")
        if r["status"] == "ok" and clock:
            shapes.setdefault((r["case"], r["seqlen_q"]), []).append((clock, r["provider"]))
    compared = [(shape, clocks) for shape, clocks in shapes.items() if len(clocks) > 1]
    found = []
    for (case, seqlen_q), clocks in compared:
        (low, lowest), (high, highest) = min(clocks), max(clocks)
        if high > low * (1 + CLOCK_DISPARITY):
            found.append(dict(case=case, seqlen_q=seqlen_q, lowest=lowest, lowest_mhz=low, highest=highest,
                              highest_mhz=high))
    return found, len(compared)


def assess_noise(records: list[dict], load: dict | None) -> dict:
    """bench.json's ``noise``: the threshold, the machine's load before the run, the timings whose
    repeats disagree, the shapes whose providers ran at different GPU clocks, and the one warning for
    the run (None when there is nothing to warn of)."""
    noisy = [dict(case=r["case"], provider=r["provider"], seqlen_q=r["seqlen_q"], mode=mode, spread=spread)
             for r in records if r["status"] == "ok" for mode in TIMED_MODES
             if (spread := relative_spread(r, mode)) is not None and spread > NOISY_SPREAD]
    timed = sum(f"{mode}_ms" in r for r in records for mode in TIMED_MODES)
    reasons = []
    if noisy:
        worst = max(noisy, key=lambda n: n["spread"])
        reasons.append(f"the repeats of {len(noisy)} of {timed} timings disagree by more than {NOISY_SPREAD:.0%} "
                       f"of their median (p80 − p20), worst {worst['spread']:.0%}: {worst['provider']} "
                       f"{worst['mode']} N={worst['seqlen_q']}, {worst['case']}")
    busy = load is not None and load["busy"]
    if busy:
        reasons.append(f"the machine was busy before the run: 1-minute load average {load['load_1min']:.1f} "
                       f"on {load['cpus']} CPUs")
    clocks, compared = clock_disparities(records)
    if clocks:
        worst = max(clocks, key=lambda c: c["highest_mhz"] / c["lowest_mhz"])
        reasons.append(f"the GPU's clock after one shape's providers differed by more than {CLOCK_DISPARITY:.0%} in "
                       f"{len(clocks)} of {compared} shapes, worst {worst['lowest']} {worst['lowest_mhz']:.0f} MHz "
                       f"against {worst['highest']} {worst['highest_mhz']:.0f} MHz at N={worst['seqlen_q']}, "
                       f"{worst['case']} (a GPU at its power cap sets its clock by the power drawn: "
                       f"gpu_state_after in bench.json); their ratios can be off by as much")
    advice = ("Rerun on an idle machine (or with a longer --rep)" if noisy or busy
              else "Rerun, or time the providers in runs of their own")
    warning = (NOISE_WARNING + "; ".join(reasons) + f". {advice}.") if reasons else None
    return dict(threshold=NOISY_SPREAD, load=load, noisy=noisy, clocks=clocks, warning=warning)
