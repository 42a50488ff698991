"""The plots of ``flashtile bench``, one PNG per case: a panel per direction (fwd, bwd, fwd+bwd)
with each provider's rate against seqlen and the p20–p80 range of its repeats as error bars, and
a panel of peak memory where it was measured (CUDA). A provider has the same colour in every
panel of every plot."""

from __future__ import annotations

import re
from pathlib import Path

from .providers import PER_TFLOPS, PROVIDERS
from .report import rate_unit
from .spread import quantiles
from .timing import MODES

PANEL_TITLES = {"fwd": "forward", "bwd": "backward = (fwd+bwd) − fwd", "fwd_bwd": "forward+backward"}
COLOURS = {name: f"C{i}" for i, name in enumerate(PROVIDERS)}  # matplotlib's cycle has 10, PROVIDERS 8


def _rate_errors(r: dict, mode: str, rate: float) -> tuple[float, float]:
    """(below, above) ``rate``: its range over the p20–p80 range of the times (rate ∝ 1/time), or
    (0, 0) where that is unknown or unbounded (a bwd whose range reaches ≤ 0)."""
    known = quantiles(r, mode)
    if known is None or known[0] <= 0:
        return 0.0, 0.0
    p20, median, p80 = known
    return max(0.0, rate - rate * median / p80), max(0.0, rate * median / p20 - rate)  # ≥ 0 despite rounding


def write_plots(results: dict, out_dir: Path) -> list[Path]:
    """One PNG per case that has a measurement → the paths; [] without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    unit = rate_unit(results)
    per_tflops = PER_TFLOPS[unit]
    paths = []
    by_case = {}
    for r in results["measurements"]:
        if r["status"] == "ok":
            by_case.setdefault(r["case"], []).append(r)
    for case, records in by_case.items():
        records.sort(key=lambda r: r["seqlen_q"])
        modes = [m for m in MODES if any(r.get(f"{m}_tflops") for r in records)]
        with_memory = any(r["peak_memory_bytes"] for r in records)
        panels = len(modes) + with_memory
        fig, axes = plt.subplots(1, panels, figsize=(4.6 * panels, 4.4), squeeze=False)
        axes = list(axes[0])
        providers = list(dict.fromkeys(r["provider"] for r in records))
        for ax, mode in zip(axes, modes):
            for provider in providers:
                points = [(r["seqlen_q"], r[f"{mode}_tflops"] * per_tflops, r) for r in records
                          if r["provider"] == provider and r.get(f"{mode}_tflops")]
                if not points:
                    continue
                seqlens, rates, rows = zip(*points)
                errors = list(zip(*(_rate_errors(r, mode, rate) for r, rate in zip(rows, rates))))
                ax.errorbar(seqlens, rates, yerr=errors, marker="o", capsize=3, color=COLOURS[provider],
                            label=provider)
            ax.set(xlabel="seqlen", ylabel=unit, title=PANEL_TITLES[mode], ylim=(0, None))
        if with_memory:
            ax = axes[-1]
            for provider in providers:
                points = [(r["seqlen_q"], r["peak_memory_bytes"] / 2**20) for r in records
                          if r["provider"] == provider and r["peak_memory_bytes"]]
                if points:
                    ax.plot(*zip(*points), marker="o", color=COLOURS[provider], label=provider)
            ax.set(xlabel="seqlen", ylabel="MiB", title="peak memory of one fwd+bwd beyond the inputs",
                   yscale="log")
        seqlens = sorted({r["seqlen_q"] for r in records})
        for ax in axes:
            ax.set_xscale("log", base=2)
            ax.set_xticks(seqlens, [str(n) for n in seqlens])
            ax.minorticks_off()
            ax.grid(True, alpha=0.3)
        axes[0].legend(fontsize=8)  # the colours are the same in every panel
        fig.suptitle(f"{case} — {results['environment']['device']}, {results['environment']['date']}\n"
                     f"median of the repeats, bars: p20–p80", fontsize=10)
        fig.tight_layout()
        path = out_dir / (re.sub(r"[^a-z0-9]+", "_", case.lower()).strip("_") + ".png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths
