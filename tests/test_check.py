"""``python -m flashtile check``, the README's first command: it runs and passes on this machine,
says which path the user's calls take, checks every path asked for, says what it checks and how
long it takes, and exits 1 when a check fails."""

import os
import re
import subprocess
import sys

import pytest
import torch

from flashtile.cli import check, main
from flashtile.ops import BACKENDS

ON_GPU = torch.cuda.is_available()
USERS_PATH = "cuda" if ON_GPU else "cpu"
# a user's environment: without TRITON_INTERPRET, which conftest sets for the kernel tests, so on
# a CPU machine the command's own calls take the "cpu" path, as a user's do
USER_ENV = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}


def run_check_command(*options):
    return subprocess.run([sys.executable, "-m", "flashtile", "check", *options], capture_output=True, text=True,
                          timeout=600, env=USER_ENV)


def verdicts(output):
    """(path, verdict) of each row of the accuracy table."""
    return [(line.split()[0], line.split()[-1]) for line in output.splitlines()
            if line.split() and line.split()[0] in BACKENDS and line.split()[-1] in ("ok", "FAIL")]


def test_check_command_passes():
    result = run_check_command()
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.rstrip().endswith("all checks passed")
    assert {path for path, _ in verdicts(result.stdout)} == {USERS_PATH}
    assert "Memory" in result.stdout and "ratio" in result.stdout


def test_help_says_what_is_checked_on_which_path_and_how_long(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["check", "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for path, description in BACKENDS.items():
        assert path in text and description.split()[0] in text
    assert "accuracy" in text and "memory" in text and "flash-attn's rule" in text
    for option in ("--quick", "--interpret"):  # each with its duration
        assert re.search(rf"{option}\b.*~\d+ (s|min)\b", text), option


def test_quick_passes_and_names_the_users_path():
    result = run_check_command("--quick")
    assert result.returncode == 0, result.stdout + result.stderr
    assert f'take the "{USERS_PATH}" path' in result.stdout.splitlines()[1]
    assert verdicts(result.stdout) == [(USERS_PATH, "ok")] * len(check.ACCURACY_CASES["quick"])
    assert result.stdout.rstrip().endswith("all checks passed")


@pytest.mark.skipif(ON_GPU, reason="the interpreter path is checked on machines without a GPU")
def test_interpret_checks_the_kernels_too():
    result = run_check_command("--quick", "--interpret")
    assert result.returncode == 0, result.stdout + result.stderr
    assert 'take the "cpu" path' in result.stdout
    cases = len(check.ACCURACY_CASES["quick"])
    assert verdicts(result.stdout) == [("cpu", "ok")] * cases + [("interpreter", "ok")] * cases
    assert result.stdout.rstrip().endswith("all checks passed")


def test_a_wrong_result_fails_the_check(monkeypatch, capsys):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # run in-process on the "cpu" path, as a user's calls do
    correct = check.flash_attn_func
    monkeypatch.setattr(check, "flash_attn_func", lambda *args, **kwargs: correct(*args, **kwargs) * 1.1)
    assert main(["check", "--quick"]) == 1
    output = capsys.readouterr().out
    assert verdicts(output) == [(USERS_PATH, "FAIL")] * len(check.ACCURACY_CASES["quick"])
    assert output.rstrip().endswith("SOME CHECKS FAILED")


@pytest.mark.skipif(ON_GPU, reason="the interpreter path is checked on machines without a GPU")
def test_a_crashed_path_fails_the_check(monkeypatch, capsys):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(check, "_ACCURACY_SNIPPET", "raise SystemExit('the kernels crashed')")
    assert main(["check", "--quick", "--interpret"]) == 1
    output = capsys.readouterr().out
    assert "interpreter FAIL" in output and "the kernels crashed" in output
    assert output.rstrip().endswith("SOME CHECKS FAILED")
