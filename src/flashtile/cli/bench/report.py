"""What ``flashtile bench`` shows: progress, the tables of a case, the plots, and the
before/after comparison of two runs (``--compare``)."""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path

from .timing import BWD_METHOD, MODES


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
