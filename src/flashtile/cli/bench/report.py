"""What ``flashtile bench`` prints while it runs: the progress, and the tables of a case with the
legend of their symbols."""

from __future__ import annotations

import sys
import textwrap

from .providers import PER_TFLOPS, RATE_UNITS
from .spread import NOISY_SPREAD, TIMED_MODES, is_noisy, relative_spread
from .timing import ACCURACY_FACTOR, BWD_METHOD, CHECKED_ROWS


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


def number_text(x) -> str:
    return f"{x:.0f}" if abs(x) >= 100 else f"{x:.3g}"


def rate_unit(results: dict) -> str:
    """The unit of a run's tables; bench.json files from before it was recorded are told by device."""
    return results["settings"].get("rate_unit") or RATE_UNITS[
        "cpu" if results["environment"]["device"].startswith("CPU") else "cuda"]


LEGEND_COLUMNS = 110
# The symbols of the tables' speed cells, and what the legend under a table says of each
NO_RATE, NOT_TIMED, SKIPPED, NOISY = "—", "n/t", "skip", "!"


def _spread_text(spread: float) -> str:
    half = 50 * spread  # ± half the p20–p80 range, in % of the median
    if half >= 100:  # the figure means nothing then; keep the column narrow
        return "±>100%"
    return "±<1%" if half < 1 else f"±{half:.0f}%"


def _speed_cell(r: dict, mode: str, per_tflops: float) -> str:
    if f"{mode}_ms" not in r:
        return NOT_TIMED
    rate = r.get(f"{mode}_tflops")
    if rate is None:  # bwd = (fwd+bwd) − fwd came out ≤ 0
        return NO_RATE
    spread_text = _spread_text(relative_spread(r, mode))
    return f"{number_text(rate * per_tflops)} {spread_text}" + (NOISY if is_noisy(r, mode) else "")


def _ratio_text(x) -> str:
    return NO_RATE if x is None else f"{x:.2f}"


def _ratio(a, b):
    return a / b if a is not None and b else None


def format_case_table(label: str, records: list[dict], unit: str) -> str:
    """Rows providers, columns seqlens; cells fwd / bwd rates in ``unit`` with their spreads, then
    ratios, memory, the skips, and a legend of the symbols the table uses."""
    seqlens = sorted({r["seqlen_q"] for r in records})
    providers = list(dict.fromkeys(r["provider"] for r in records))
    cell = {(r["provider"], r["seqlen_q"]): r for r in records}

    def speed(p, n):
        r = cell.get((p, n))
        if r is None or r["status"] != "ok":
            return SKIPPED if r is not None else ""
        return " / ".join(_speed_cell(r, mode, PER_TFLOPS[unit]) for mode in ("fwd", "bwd"))

    rows = [[p, *(speed(p, n) for n in seqlens), _accuracy_note(p, records)] for p in providers]
    ratio_rows = []
    if "flashtile" in providers:
        for peer in providers:
            if peer == "flashtile":
                continue
            ratios = []
            for n in seqlens:
                ours, theirs = cell.get(("flashtile", n), {}), cell.get((peer, n), {})
                fwd, bwd = (_ratio(ours.get(f"{m}_tflops"), theirs.get(f"{m}_tflops")) for m in ("fwd", "bwd"))
                ratios.append("" if fwd is None and bwd is None else f"{_ratio_text(fwd)} / {_ratio_text(bwd)}")
            if any(ratios):
                ratio_rows.append([f"flashtile/{peer}", *ratios, ""])
    lines = [f"\n{label} — fwd / bwd {unit}, median ±spread of the repeats ({BWD_METHOD})"]
    lines += grid(["provider", *(f"N={n}" for n in seqlens), "accuracy"], rows + ratio_rows)
    memory_rows = [[p, *(_mib(cell.get((p, n))) for n in seqlens)] for p in providers]
    if any(c for row in memory_rows for c in row[1:]):
        lines.append("peak memory of one fwd+bwd beyond the inputs, MiB")
        lines += grid(["provider", *(f"N={n}" for n in seqlens)], memory_rows)
    else:
        lines.append("peak memory: measured on CUDA only")
    skips = {}
    for r in records:
        if r["status"] != "ok":
            skips.setdefault((r["provider"], r["reason"]), []).append(r["seqlen_q"])
    for (p, reason), ns in skips.items():
        short = reason if len(reason) <= 300 else reason[:297] + "..."
        lines.append(f"  skipped {p} at N={','.join(map(str, ns))}: {short}")
    used = {word for row in rows for text in row[1:-1] for word in text.split()}
    return "\n".join(lines + _legend(records, used, bool(ratio_rows)))


def _legend(records: list[dict], used: set[str], ratios: bool) -> list[str]:
    """What each symbol in the table means, for the symbols it uses (``used``: the words of its
    speed cells)."""
    ok = [r for r in records if r["status"] == "ok"]
    repeats = sorted({r[f"{mode}_repeats"] for r in ok for mode in TIMED_MODES if f"{mode}_repeats" in r})
    entries = []
    if any(word.startswith("±") for word in used):
        counts = f"{repeats[0]}" if len(repeats) == 1 else f"{repeats[0]}–{repeats[-1]}"
        entries.append(("±x%", f"half the p20–p80 range of the {counts} repeats' times, relative to their "
                               "median (bwd: the widest range that the fwd and fwd+bwd ranges allow)"))
    if any(word.endswith(NOISY) for word in used):
        entries.append((NOISY, f"the repeats disagree: p80 − p20 is more than {NOISY_SPREAD:.0%} of the median "
                               f"(beyond ±{50 * NOISY_SPREAD:.0f}%; for bwd, in fwd's or fwd+bwd's); see the "
                               "warning at the end"))
    if NO_RATE in used:
        entries.append((NO_RATE, "no rate: the backward, (fwd+bwd) − fwd, came out ≤ 0: the two timings are "
                                 "within noise of each other at this size"))
    if NOT_TIMED in used:
        entries.append((NOT_TIMED, "not timed (--modes)"))
    if SKIPPED in used:
        entries.append((SKIPPED, "the provider refused this shape (why: above)"))
    if ratios:
        entries.append(("flashtile/X", f"flashtile's rate ÷ X's: > 1 where flashtile is faster; {NO_RATE} where "
                                       "either has no rate"))
    if ok:
        entries.append(("accuracy", f"ok: the output on <= {CHECKED_ROWS} sampled query rows is within "
                                    f"flash-attn's bound of float64 attention ({ACCURACY_FACTOR}x PyTorch's own "
                                    "error in the input dtype + a float32-ulp floor); MISMATCH: beyond it; "
                                    "max |Δ flashtile|: the largest difference from flashtile's output"))
    width = max(len(symbol) for symbol, _ in entries)
    return ["legend:"] + [textwrap.fill(text, LEGEND_COLUMNS, initial_indent=f"  {symbol.ljust(width)}  ",
                                        subsequent_indent=" " * (width + 4)) for symbol, text in entries]
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
    return "" if r["peak_memory_bytes"] is None else number_text(r["peak_memory_bytes"] / 2**20)


def grid(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]
    return ["  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
            for row in [header, *rows]]


