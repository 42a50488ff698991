"""``flashtile bench --compare BEFORE.json AFTER.json``: flashtile's rates in two runs, shape by
shape, and whether anything got slower beyond the threshold and beyond noise.

A change is within noise where the p20–p80 ranges of the repeats' times in the two runs overlap;
such a slowdown is shown but does not count against the threshold. A bench.json from before
spreads were recorded has none: its changes all count.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import NamedTuple

from .providers import PER_TFLOPS
from .report import NO_RATE, grid, number_text, rate_unit
from .spread import NOISE_WARNING, quantiles, within_noise
from .timing import MODES

WITHIN_NOISE = "≈"


def _shape_key(r: dict):
    return tuple(r[f] for f in ("dtype", "batch", "seqlen_q", "seqlen_k", "nheads", "nheads_k", "headdim", "causal"))


def _warnings(runs: dict[str, dict], paths: dict[str, Path]) -> list[str]:
    """What makes the comparison less trustworthy: other devices, noisy runs, missing spreads."""
    before, after = runs["before"], runs["after"]
    lines = []
    if before["environment"]["device"] != after["environment"]["device"]:
        lines.append("warning: the two runs are on different devices")
    for name, run in runs.items():
        warning = (run.get("noise") or {}).get("warning")
        if warning:
            lines.append(f"warning: the {name} run ({paths[name]}) warned that its timings may be noise: "
                         f"{warning.removeprefix(NOISE_WARNING)}")
        flashtile = [r for r in run["measurements"] if r["provider"] == "flashtile" and r["status"] == "ok"]
        if flashtile and all(quantiles(r, "fwd") is None for r in flashtile):
            lines.append(f"note: the {name} run ({paths[name]}) has no spreads (an older bench.json): "
                         "its changes cannot be told from noise and all count")
    return lines


class Change(NamedTuple):
    pct: float  # of the rate: < 0 is slower
    mode: str
    case: str
    seqlen_q: int
    within_noise: bool | None  # None: a run without spreads


def compare(before_path: Path, after_path: Path, threshold_pct: float) -> int:
    """Before/after table of flashtile's rates; exit status 1 if any is slower by more than
    ``threshold_pct`` and beyond noise."""
    paths = dict(before=Path(before_path), after=Path(after_path))
    runs = {name: json.loads(path.read_text()) for name, path in paths.items()}
    before, after = runs["before"], runs["after"]
    unit = rate_unit(after)
    per_tflops = PER_TFLOPS[unit]
    print(f"flashtile {unit}, before = {before_path} ({before['environment']['date']}, "
          f"{before['environment']['device']}), after = {after_path} ({after['environment']['date']}, "
          f"{after['environment']['device']})")
    for line in _warnings(runs, paths):
        print(line)
    old = {_shape_key(r): r for r in before["measurements"] if r["provider"] == "flashtile" and r["status"] == "ok"}
    rows, changes = [], []
    for r in after["measurements"]:
        if r["provider"] != "flashtile" or r["status"] != "ok" or _shape_key(r) not in old:
            continue
        then = old[_shape_key(r)]
        cells = []
        for mode in MODES:
            a, b = then.get(f"{mode}_tflops"), r.get(f"{mode}_tflops")
            if a and b:
                change = Change(100 * (b / a - 1), mode, r["case"], r["seqlen_q"], within_noise(then, r, mode))
                changes.append(change)
                cells.append(f"{number_text(a * per_tflops)} → {number_text(b * per_tflops)} ({change.pct:+.1f}%)"
                             + (f" {WITHIN_NOISE}" if change.within_noise else ""))
            else:
                cells.append(NO_RATE)
        rows.append([r["case"], str(r["seqlen_q"]), *cells])
    if not rows:
        print("no flashtile measurement of the same shape in both files")
        return 1
    print("\n".join(grid(["case", "N", *MODES], rows)))
    if not changes:
        print("no rate measured in both files")
        return 1
    legend = [f"{NO_RATE}: no rate in one of the two (not timed, or a backward ≤ 0)"] if any(
        NO_RATE in row[2:] for row in rows) else []
    if any(c.within_noise for c in changes):
        legend.append(f"{WITHIN_NOISE}: within noise, the p20–p80 ranges of the repeats' times overlap "
                      "(not counted against --threshold)")
    if legend:
        print("legend: " + "; ".join(legend))
    return _summary(changes, threshold_pct)


def _summary(changes: list[Change], threshold_pct: float) -> int:
    """Print the geometric means and the worst change → the exit status: 1 if any change is slower
    than ``-threshold_pct`` and not within noise."""
    geomeans = []
    for mode in MODES:
        ratios = [1 + c.pct / 100 for c in changes if c.mode == mode]
        if ratios:
            geomeans.append(f"{mode} {100 * (math.prod(ratios) ** (1 / len(ratios)) - 1):+.1f}%")
    quiet = sum(bool(c.within_noise) for c in changes)
    slower = [c for c in changes if c.pct < -threshold_pct and not c.within_noise]
    slower_within_noise = sum(c.pct < -threshold_pct and bool(c.within_noise) for c in changes)
    worst = min(changes, key=lambda c: c.pct)
    print(f"\ngeometric mean change: {', '.join(geomeans)}"
          + (f" ({quiet} of {len(changes)} changes within noise)" if quiet else ""))
    print(f"worst change: {worst.pct:+.1f}% ({worst.mode}, {worst.case}, N={worst.seqlen_q}"
          + (", within noise" if worst.within_noise else "") + "); "
          + (f"{len(slower)} of {len(changes)} slower by more than {threshold_pct:g}% beyond noise" if slower
             else f"none slower by more than {threshold_pct:g}% beyond noise")
          + (f" ({slower_within_noise} more slower by that much but within noise)" if slower_within_noise else ""))
    return 1 if slower else 0
