"""``python -m flashtile bench`` end to end through the real command line entry, on tiny shapes.

Kept small because flashtile runs under Triton's interpreter on the CPU (~0.15 s per kernel
launch, ~18 launches per measurement): tiny shapes, few of them, and timing budgets of 0 ms
(one warmup call and the fewest timed calls, MIN_CPU_REPEATS); the noise warning and the
``—`` of a backward within noise are forced with a fake timer.
"""

import contextlib
import dataclasses
import io
import json
import types

import pytest
import torch

import flashtile.cli.bench
from flashtile.cli import main
from flashtile.cli.bench import Shape, forward_flops, gpu_state, provider_names
from flashtile.cli.bench.providers import PROVIDERS
from flashtile.cli.bench.report import number_text
from flashtile.cli.bench.spread import assess_noise, spread_fields
from flashtile.cli.bench.timing import MIN_CPU_REPEATS

TINY = ["--batch", "1", "--nheads", "2", "--headdims", "16", "--warmup", "0", "--rep", "0"]


@pytest.fixture(scope="module")
def square_run(tmp_path_factory):
    """Non-causal at seqlens 32 and 48, flashtile and SDPA math; → (output dir, stdout)."""
    out_dir = tmp_path_factory.mktemp("bench")
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        assert main(["bench", "--seqlens", "32,48", "--no-causal", "--providers", "flashtile,sdpa_math", *TINY,
                     "--out-dir", str(out_dir)]) == 0
    return out_dir, stdout.getvalue()


def test_json_has_environment_and_every_measurement(square_run, device):
    out_dir, _ = square_run
    results = json.loads((out_dir / "bench.json").read_text())
    assert {"date", "device", "python", "torch", "triton", "flashtile"} <= results["environment"].keys()
    assert "fwd+bwd" in results["settings"]["bwd_method"]
    records = results["measurements"]
    assert sorted((r["provider"], r["seqlen_q"], r["causal"]) for r in records) == [
        ("flashtile", 32, False), ("flashtile", 48, False), ("sdpa_math", 32, False), ("sdpa_math", 48, False)]
    for r in records:
        assert r["status"] == "ok", r
        assert r["fwd_ms"] > 0 and r["fwd_bwd_ms"] > 0 and r["fwd_tflops"] > 0 and r["fwd_bwd_tflops"] > 0
        assert r["bwd_ms"] == pytest.approx(r["fwd_bwd_ms"] - r["fwd_ms"])
        assert r["accurate"], r
        assert r["fwd_flops"] == 4 * 1 * 2 * 16 * r["seqlen_q"] ** 2
        assert (r["peak_memory_bytes"] > 0) if device == "cuda" else r["peak_memory_bytes"] is None
    assert all(r["max_diff_vs_flashtile"] < r["error_bound"] for r in records if r["provider"] == "sdpa_math")


def test_tables_and_plots_are_written(square_run, device):
    out_dir, stdout = square_run
    unit = "TFLOP/s" if device == "cuda" else "GFLOP/s"
    assert f"bf16 hdim 16 non-causal, batch 1, nheads 2 — fwd / bwd {unit}, median ±spread" in stdout
    for row in ("flashtile", "sdpa_math", "flashtile/sdpa_math"):  # cells "fwd / bwd"
        assert sum(line.split()[:1] == [row] and line.count(" / ") == 2 for line in stdout.splitlines()) == 1
    assert "N=32" in stdout and "N=48" in stdout
    assert (out_dir / "bench.txt").read_text().strip() in stdout
    pytest.importorskip("matplotlib")
    assert [p.name for p in out_dir.glob("*.png")] == ["bf16_hdim_16_non_causal_batch_1_nheads_2.png"]


def test_spread_fields_are_the_quantiles_of_the_repeats():
    assert spread_fields("fwd", [5.0, 1.0, 2.0, 4.0, 3.0]) == pytest.approx(
        dict(fwd_ms=3.0, fwd_ms_min=1.0, fwd_ms_p20=1.8, fwd_ms_p80=4.2, fwd_ms_max=5.0, fwd_repeats=5))


def _table_row(stdout: str, provider: str) -> str:
    return next(line for line in stdout.splitlines() if line.split()[:1] == [provider] and " / " in line)


def test_rates_are_in_gflops_on_the_cpu(square_run, device):
    out_dir, stdout = square_run
    results = json.loads((out_dir / "bench.json").read_text())
    unit, per_tflops = ("TFLOP/s", 1) if device == "cuda" else ("GFLOP/s", 1e3)
    assert results["settings"]["rate_unit"] == unit
    flashtile_32 = next(r for r in results["measurements"] if r["provider"] == "flashtile" and r["seqlen_q"] == 32)
    row = _table_row(stdout, "flashtile")
    assert row.split()[1] == number_text(flashtile_32["fwd_tflops"] * per_tflops)  # the first cell's fwd rate


def test_every_timing_records_its_spread(square_run, device):
    out_dir, stdout = square_run
    for r in json.loads((out_dir / "bench.json").read_text())["measurements"]:
        for mode in ("fwd", "fwd_bwd"):
            low, p20, median, p80, high = (r[f"{mode}_ms{s}"] for s in ("_min", "_p20", "", "_p80", "_max"))
            assert 0 < low <= p20 <= median <= p80 <= high, r
            if device == "cpu":  # --rep 0: no more than the fewest, which must be several for a spread
                assert r[f"{mode}_repeats"] == MIN_CPU_REPEATS >= 3
        # bwd = (fwd+bwd) − fwd, with the widest range the two allow
        assert r["bwd_ms_p20"] == pytest.approx(r["fwd_bwd_ms_p20"] - r["fwd_ms_p80"])
        assert r["bwd_ms_max"] == pytest.approx(r["fwd_bwd_ms_max"] - r["fwd_ms_min"])
    row = _table_row(stdout, "flashtile")
    assert row.count("±") == 4  # fwd and bwd at N=32 and N=48


def _fake_timer(times_ms):
    """A repeat timer that returns ``times_ms[name of the timed function]`` without running it."""
    return lambda device, warmup_ms, rep_ms: lambda fn: times_ms[fn.__name__]


def _run(argv) -> str:
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        assert main(["bench", *argv]) == 0
    return stdout.getvalue()


QUIET_TIMES = {"forward": [1.0, 1.0, 1.01, 1.02, 1.02], "forward_backward": [3.5, 3.5, 3.51, 3.52, 3.52]}
IDLE = dict(load_1min=0.1, cpus=2, busy=False)


def test_disagreeing_repeats_warn_once_per_run(monkeypatch, tmp_path, device):
    times = dict(QUIET_TIMES, forward=[1.0, 1.0, 1.0, 1.5, 1.5])  # p20 1, median 1, p80 1.5
    monkeypatch.setattr(flashtile.cli.bench, "make_repeat_timer", _fake_timer(times))
    monkeypatch.setattr(flashtile.cli.bench, "cpu_load", lambda: IDLE)
    stdout = _run(["--seqlens", "32", "--providers", "flashtile", *TINY, "--out-dir", str(tmp_path)])
    assert stdout.count("warning: these timings may be noise") == 1  # two cases, one warning
    assert "the repeats of 2 of 4 timings disagree by more than 20% of their median (p80 − p20), worst 50%" in stdout
    # 4·1·2·16·32² flops in 1 ms: 0.131 GFLOP/s on a CPU, 0.000131 TFLOP/s on a GPU
    rate = "0.131" if device == "cpu" else "0.000131"
    assert _table_row(stdout, "flashtile").split()[1:3] == [rate, "±25%!"]
    noise = json.loads((tmp_path / "bench.json").read_text())["noise"]
    assert noise["warning"] in stdout and noise["threshold"] == 0.2 and noise["load"] == IDLE
    assert [(n["mode"], n["spread"]) for n in noise["noisy"]] == [("fwd", 0.5)] * 2
    assert noise["warning"] in (tmp_path / "bench.txt").read_text()


def test_a_busy_machine_warns_and_quiet_repeats_do_not(monkeypatch, tmp_path):
    monkeypatch.setattr(flashtile.cli.bench, "make_repeat_timer", _fake_timer(QUIET_TIMES))
    monkeypatch.setattr(flashtile.cli.bench, "cpu_load", lambda: IDLE)
    argv = ["--seqlens", "32", "--no-causal", "--providers", "flashtile", *TINY, "--out-dir", str(tmp_path)]
    stdout = _run(argv)
    assert "warning" not in stdout and "!" not in _table_row(stdout, "flashtile")
    assert json.loads((tmp_path / "bench.json").read_text())["noise"]["warning"] is None

    monkeypatch.setattr(flashtile.cli.bench, "cpu_load", lambda: dict(load_1min=5.3, cpus=2, busy=True))
    stdout = _run(argv)
    assert ("warning: these timings may be noise: the machine was busy before the run: 1-minute load average 5.3 "
            "on 2 CPUs") in stdout


def test_a_backward_within_noise_has_no_rate_and_the_legend_says_why(monkeypatch, tmp_path):
    times = dict(QUIET_TIMES, forward_backward=QUIET_TIMES["forward"])  # fwd+bwd as fast as fwd: bwd ≤ 0
    monkeypatch.setattr(flashtile.cli.bench, "make_repeat_timer", _fake_timer(times))
    stdout = _run(["--seqlens", "32", "--no-causal", "--providers", "flashtile", *TINY, "--out-dir", str(tmp_path)])
    row = _table_row(stdout, "flashtile")
    assert row.split()[-2:] == ["—", "ok"]
    assert any(line.split()[:3] == ["—", "no", "rate:"] for line in stdout.splitlines())  # in the legend
    record = json.loads((tmp_path / "bench.json").read_text())["measurements"][0]
    assert record["bwd_ms"] <= 0 and "bwd_tflops" not in record


def test_an_unavailable_provider_is_an_error_before_anything_runs(monkeypatch, tmp_path, capsys):
    missing = dataclasses.replace(PROVIDERS["fa2"], imports=("flashtile_test_no_such_module", "attend"))
    monkeypatch.setitem(PROVIDERS, "fa2", missing)
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--providers", "flashtile,fa2", *TINY, "--out-dir", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "not available on this machine: fa2 (" in err and "No module named 'flashtile_test_no_such_module'" in err
    assert not (tmp_path / "out").exists()


def test_providers_all_takes_every_available_one(device):
    available = [n for n, p in PROVIDERS.items() if p.unavailable(device) is None]
    assert provider_names(["all"], device) == provider_names(None, device) == available  # flashtile first
    assert provider_names(["sdpa_math", "all"], device) == ["flashtile", "sdpa_math",
                                                             *(n for n in available[1:] if n != "sdpa_math")]
    if device == "cpu":
        assert "needs CUDA" in PROVIDERS["sdpa_cudnn"].unavailable(device)
        with pytest.raises(ValueError, match="sdpa_cudnn"):
            provider_names(["all", "sdpa_cudnn"], device)


@pytest.mark.parametrize("seqlen_q, seqlen_k, causal, pairs", [
    (64, 64, False, 64 * 64),
    (64, 64, True, 64 * 64 / 2),  # the usual convention, not the exact 64·65/2
    (4, 6, True, 3 + 4 + 5 + 6),  # query i sees keys 0..i+2
    (6, 4, True, 0 + 0 + 1 + 2 + 3 + 4),  # the first two queries see nothing
])
def test_forward_flops(seqlen_q, seqlen_k, causal, pairs):
    shape = Shape(batch=3, seqlen_q=seqlen_q, seqlen_k=seqlen_k, nheads=4, nheads_k=2, headdim=8, causal=causal,
                  dtype="bf16")
    assert forward_flops(shape) == 4 * 3 * 4 * 8 * pairs


def test_causal_flops_count_visible_pairs_when_seqlens_differ(tmp_path):
    # GQA 2:1, seqlen_q 32 < seqlen_k 40, causal: query i sees keys 0..i+8, 32·9 + 32·31/2 = 784 pairs
    assert main(["bench", "--seqlens", "32", "--seqlen-k", "40", "--causal", "--nheads-k", "1",
                 "--providers", "flashtile,sdpa_math", *TINY, "--out-dir", str(tmp_path)]) == 0
    records = {r["provider"]: r for r in json.loads((tmp_path / "bench.json").read_text())["measurements"]}
    assert records["flashtile"]["fwd_flops"] == 4 * 1 * 2 * 16 * 784
    assert records["flashtile"]["status"] == "ok" and records["flashtile"]["accurate"]
    assert records["sdpa_math"]["status"] == "skipped" and "top-left" in records["sdpa_math"]["reason"]


def test_bad_arguments_are_refused(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--providers", "flashtile,nope"])
    assert "unknown ['nope']" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "--nheads", "6", "--nheads-k", "4"])
    assert "--nheads (6) must be a multiple of --nheads-k (4)" in capsys.readouterr().err



@pytest.fixture
def fake_gpu(monkeypatch, tmp_path):
    """A GPU whose uuid is ``abc`` and an ``nvidia-smi`` on PATH that answers for it with ``tmp_path/answer``
    (and logs its arguments to ``tmp_path/args``) → ``tmp_path``."""
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: types.SimpleNamespace(uuid="abc"))
    smi = tmp_path / "nvidia-smi"
    smi.write_text('#!/bin/sh\necho "$@" > "$(dirname "$0")/args"\ncat "$(dirname "$0")/answer"\n')
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    return tmp_path


def test_gpu_state_reads_clocks_power_and_throttle_reasons(fake_gpu):
    (fake_gpu / "answer").write_text("1755, 512.34, 61, 0x0000000000000004\n")
    assert gpu_state(0) == {"sm_clock_mhz": 1755.0, "power_w": 512.34, "temperature_c": 61.0,
                            "throttle_reasons": "0x0000000000000004"}
    assert "--id=GPU-abc" in (fake_gpu / "args").read_text()
    (fake_gpu / "answer").write_text("1755, [N/A], 61, 0x0\n")
    assert gpu_state(0)["power_w"] is None


def test_gpu_state_is_none_without_an_answer(fake_gpu, monkeypatch):
    (fake_gpu / "answer").write_text("No devices were found\n")
    assert gpu_state(0) is None
    monkeypatch.setenv("PATH", "/nonexistent")
    assert gpu_state(0) is None


def _clocked(provider, seqlen_q, mhz, status="ok"):
    return dict(case="bf16 hdim 128 non-causal", provider=provider, seqlen_q=seqlen_q, status=status,
                gpu_state_after=None if mhz is None else dict(sm_clock_mhz=mhz, throttle_reasons="0x4"))


def test_providers_at_different_gpu_clocks_warn():
    # the nineteenth session's H100 sweep: the same forward kernel after 1680 and 1830 MHz (benchmarks/NOTES.md)
    records = [_clocked("flashtile", 2048, 1680.0), _clocked("flashtile_det", 2048, 1830.0),
               _clocked("sdpa_cudnn", 2048, 1785.0), _clocked("flashtile", 8192, 1575.0),
               _clocked("sdpa_cudnn", 8192, 1620.0), _clocked("flashtile", 16384, 1500.0)]
    noise = assess_noise(records, IDLE)
    assert noise["clocks"] == [dict(case="bf16 hdim 128 non-causal", seqlen_q=2048, lowest="flashtile",
                                    lowest_mhz=1680.0, highest="flashtile_det", highest_mhz=1830.0)]
    # N=16384 has one clocked provider: nothing to compare there
    assert noise["warning"] == (
        "warning: these timings may be noise: the GPU's clock after one shape's providers differed by more than 5% "
        "in 1 of 2 shapes, worst flashtile 1680 MHz against flashtile_det 1830 MHz at N=2048, bf16 hdim 128 "
        "non-causal (a GPU at its power cap sets its clock by the power drawn: gpu_state_after in bench.json); their "
        "ratios can be off by as much. Rerun, or time the providers in runs of their own.")
    # within 5%, skipped providers and records without a clock (the CPU, nvidia-smi missing or [N/A]) do not warn
    no_state = {key: value for key, value in _clocked("fa2", 8192, None).items() if key != "gpu_state_after"}
    quiet = [_clocked("flashtile", 8192, 1575.0), _clocked("sdpa_cudnn", 8192, 1620.0),
             _clocked("fa2", 8192, 1980.0, status="skipped"), _clocked("flex", 8192, None), no_state,
             _clocked("fa4", 8192, 0.0)]
    assert assess_noise(quiet, IDLE) == dict(threshold=0.2, load=IDLE, noisy=[], clocks=[], warning=None)
