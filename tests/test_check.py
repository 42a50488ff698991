"""``python -m flashtile check``, the README's first command, runs and passes on this device."""

import os
import subprocess
import sys


def test_check_command_passes():
    # a fresh process run as a user would: without TRITON_INTERPRET (which conftest sets for the
    # kernel tests), so on a CPU machine it checks the tiled PyTorch path that users get there
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-m", "flashtile", "check"], capture_output=True, text=True,
                            timeout=600, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "all checks passed" in result.stdout
