"""What ``python -m flashtile bench`` shows, from records made by hand (no measuring): the tables'
legend, ``--compare`` with spreads that overlap or not (and from files without spreads), and the
plots' panels."""

import dataclasses
import json

import pytest
import torch

from flashtile.cli import main
from flashtile.cli.bench import Shape, forward_flops
from flashtile.cli.bench.plots import write_plots
from flashtile.cli.bench.report import format_case_table
from flashtile.cli.bench.spread import backward_fields, spread_fields
from flashtile.cli.bench.timing import rate_fields

CASE = "bf16 hdim 16 non-causal, batch 1, nheads 2"


def _record(provider, seqlen_q, fwd_ms=1.0, fwd_bwd_ms=3.5, spread=0.02, **fields):
    """A measured record as ``bench`` writes it: 5 repeats of each timing, evenly from
    median·(1 − spread) to median·(1 + spread), so that p20 and p80 are median·(1 ∓ 0.6·spread)."""
    shape = Shape(1, seqlen_q, seqlen_q, 2, 2, 16, False, "bf16")
    record = dict(provider=provider, **dataclasses.asdict(shape), fwd_flops=forward_flops(shape), case=CASE,
                  status="ok", accurate=True, max_error=1e-3, error_bound=1e-2, peak_memory_bytes=None)
    for mode, median in (("fwd", fwd_ms), ("fwd_bwd", fwd_bwd_ms)):
        if median is not None:
            record.update(spread_fields(mode, [median * (1 + spread * x) for x in torch.linspace(-1, 1, 5).tolist()]))
    record.update(backward_fields(record))
    record.update(rate_fields(record, record["fwd_flops"]))
    record.update(fields)
    return record


def _skipped(provider, seqlen_q):
    return dict(provider=provider, seqlen_q=seqlen_q, case=CASE, status="skipped", reason="Unsupported: test")


def _legend_symbols(table: str) -> list[str]:
    lines = table.splitlines()
    return [line.split()[0] for line in lines[lines.index("legend:") + 1:] if line.startswith("  ") and line[2] != " "]


def test_the_legend_explains_every_symbol_the_table_uses():
    records = [
        _record("flashtile", 32, fwd_bwd_ms=0.9),  # bwd = 0.9 − 1 ≤ 0: no rate
        _record("flashtile", 48, spread=0.5),  # repeats that disagree
        _skipped("sdpa_math", 32),
        _record("sdpa_math", 48, fwd_bwd_ms=None),  # --modes fwd
    ]
    table = format_case_table(CASE, records, "GFLOP/s")
    rows = {line.split()[0]: line for line in table.splitlines() if " / " in line}
    # N=32: bwd ≤ 0; N=48: fwd's repeats disagree, and so bwd's, which comes from them
    assert rows["flashtile"].split()[1:] == ["0.131", "±1%", "/", "—", "0.295", "±30%!", "/", "0.295", "±54%!",
                                             "ok"]
    assert rows["sdpa_math"].split()[1:] == ["skip", "0.295", "±1%", "/", "n/t", "ok"]
    assert rows["flashtile/sdpa_math"].split()[1:] == ["1.00", "/", "—"]
    assert _legend_symbols(table) == ["±x%", "!", "—", "n/t", "skip", "flashtile/X", "accuracy"]

    quiet = format_case_table(CASE, [_record("flashtile", 32), _record("flashtile", 48)], "TFLOP/s")
    assert "fwd / bwd TFLOP/s" in quiet
    assert _legend_symbols(quiet) == ["±x%", "accuracy"]


def _write_run(path, records, device="CPU (x86_64)", noise_warning=None, spreads=True):
    """A bench.json of flashtile ``records``; without ``spreads``, as bench wrote it before them."""
    if not spreads:
        records = [{k: v for k, v in r.items() if not k.endswith(("_p20", "_p80", "_min", "_max", "_repeats"))}
                   for r in records]
    run = dict(environment=dict(date="2026-01-01T00:00:00+00:00", device=device), measurements=records,
               settings=dict(rate_unit="GFLOP/s") if spreads else {})
    if spreads:
        run["noise"] = dict(threshold=0.2, load=None, noisy=[], warning=noise_warning)
    path.write_text(json.dumps(run))
    return str(path)


def test_compare_counts_a_slowdown_only_beyond_threshold_and_noise(tmp_path, capsys):
    before = _write_run(tmp_path / "before.json", [_record("flashtile", 32)])
    # fwd 5% slower; p20–p80 of ±1.2%: 0.988–1.012 ms before, 1.037–1.063 ms after
    after = _write_run(tmp_path / "after.json", [_record("flashtile", 32, fwd_ms=1.05)])
    assert main(["bench", "--compare", before, after]) == 1
    out = capsys.readouterr().out
    assert "flashtile GFLOP/s" in out and "(-4.8%)" in out and "(-4.8%) ≈" not in out  # beyond noise
    assert "1 of 3 slower by more than 3% beyond noise" in out
    assert main(["bench", "--compare", before, after, "--threshold", "5"]) == 0
    capsys.readouterr()

    # the same medians, repeats spread ±6% (0.94–1.06 before, 0.987–1.113 after): they overlap
    before = _write_run(tmp_path / "before.json", [_record("flashtile", 32, spread=0.1)])
    after = _write_run(tmp_path / "after.json", [_record("flashtile", 32, fwd_ms=1.05, spread=0.1)])
    assert main(["bench", "--compare", before, after]) == 0
    out = capsys.readouterr().out
    assert "(-4.8%) ≈" in out and "none slower by more than 3% beyond noise (1 more slower by that much but within " \
                                  "noise)" in out
    assert "≈: within noise, the p20–p80 ranges of the repeats' times overlap" in out


def test_compare_reads_files_without_spreads_and_warns_of_noisy_runs(tmp_path, capsys):
    old = _write_run(tmp_path / "old.json", [_record("flashtile", 32, spread=0.1)], spreads=False)
    noisy = _write_run(tmp_path / "noisy.json", [_record("flashtile", 32, fwd_ms=1.05, spread=0.1)],
                       noise_warning="warning: these timings may be noise: the machine was busy")
    assert main(["bench", "--compare", old, noisy]) == 1  # spread unknown: the slowdown counts
    out = capsys.readouterr().out
    assert f"note: the before run ({old}) has no spreads" in out
    assert f"warning: the after run ({noisy}) warned that its timings may be noise: the machine was busy" in out
    assert "(-4.8%)" in out and "≈" not in out


def _saved_figures(monkeypatch, results, tmp_path):
    """The figures that write_plots draws (and does not save)."""
    pytest.importorskip("matplotlib")
    import matplotlib.figure

    figures = []
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda figure, *args, **kwargs: figures.append(figure))
    write_plots(results, tmp_path)
    return figures


def _panel_colours(ax) -> dict:
    return {container.get_label(): container.lines[0].get_color() for container in ax.containers}


def test_plots_have_a_panel_per_direction_and_memory_only_where_measured(monkeypatch, tmp_path):
    records = [_record(p, n) for p in ("flashtile", "sdpa_math") for n in (32, 64)]
    cpu = dict(environment=dict(date="2026-01-01", device="CPU (x86_64)"), settings=dict(rate_unit="GFLOP/s"),
               measurements=records + [_skipped("sdpa_flash", 32)])
    [figure] = _saved_figures(monkeypatch, cpu, tmp_path)
    assert [ax.get_title() for ax in figure.axes] == ["forward", "backward = (fwd+bwd) − fwd", "forward+backward"]
    assert [ax.get_ylabel() for ax in figure.axes] == ["GFLOP/s"] * 3
    colours = [_panel_colours(ax) for ax in figure.axes]
    assert colours[0] == colours[1] == colours[2] and len(set(colours[0].values())) == 2

    on_gpu = [dict(r, peak_memory_bytes=2**20 * r["seqlen_q"]) for r in records]
    gpu = dict(cpu, environment=dict(date="2026-01-01", device="NVIDIA H200"), settings=dict(rate_unit="TFLOP/s"),
               measurements=on_gpu)
    [figure] = _saved_figures(monkeypatch, gpu, tmp_path)
    assert [ax.get_ylabel() for ax in figure.axes] == ["TFLOP/s"] * 3 + ["MiB"]
    assert figure.axes[3].get_title() == "peak memory of one fwd+bwd beyond the inputs"
    assert {line.get_label(): line.get_color() for line in figure.axes[3].lines} == colours[0]
