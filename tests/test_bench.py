"""``python -m flashtile bench`` end to end through the real command line entry, on tiny shapes.

Kept small because flashtile runs under Triton's interpreter on the CPU (~0.15 s per kernel
launch, ~18 launches per measurement): tiny shapes, few of them, and timing budgets of 0 ms
(one warmup call and one timed call per measurement).
"""

import contextlib
import io
import json
import types

import pytest
import torch

from flashtile.cli import main
from flashtile.cli.bench import Shape, forward_flops, gpu_state

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


def test_tables_and_plots_are_written(square_run):
    out_dir, stdout = square_run
    assert "bf16 hdim 16 non-causal, batch 1, nheads 2 — fwd / bwd TFLOP/s" in stdout
    for row in ("flashtile", "sdpa_math", "flashtile/sdpa_math"):  # cells "fwd / bwd"
        assert sum(line.split()[:1] == [row] and line.count(" / ") == 2 for line in stdout.splitlines()) == 1
    assert "N=32" in stdout and "N=48" in stdout
    assert (out_dir / "bench.txt").read_text().strip() in stdout
    pytest.importorskip("matplotlib")
    assert [p.name for p in out_dir.glob("*.png")] == ["bf16_hdim_16_non_causal_batch_1_nheads_2.png"]


def test_compare_flags_a_slowdown_beyond_the_threshold(square_run, tmp_path, capsys):
    out_dir, _ = square_run
    before = out_dir / "bench.json"
    assert main(["bench", "--compare", str(before), str(before)]) == 0
    assert "+0.0%" in capsys.readouterr().out

    slower = json.loads(before.read_text())
    rates = sum(r.get(f"{mode}_tflops") is not None for r in slower["measurements"] if r["provider"] == "flashtile"
                for mode in ("fwd", "bwd", "fwd_bwd"))
    for r in slower["measurements"]:
        if r["provider"] == "flashtile" and r["seqlen_q"] == 48:
            r["fwd_tflops"] /= 1.05
    after = tmp_path / "after.json"
    after.write_text(json.dumps(slower))
    assert main(["bench", "--compare", str(before), str(after)]) == 1
    out = capsys.readouterr().out
    assert "(-4.8%)" in out and f"1 of {rates} slower by more than 3%" in out
    assert main(["bench", "--compare", str(before), str(after), "--threshold", "5"]) == 0


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
