"""Every ```python block of README.md runs as written, so the README cannot rot.

Blocks run one by one in a fresh namespace, on CUDA when there is one and otherwise on the CPU
(the Triton interpreter). The ring-attention block calls ``init_process_group`` as under
torchrun; here it runs as a single gloo process through the environment torchrun would set.
"""

import re
import socket
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"^```python\n(.*?)^```", README.read_text(), flags=re.S | re.M)


def _title(block: str) -> str:
    heading = None
    for line in README.read_text()[: README.read_text().index(block)].splitlines():
        if line.startswith("## "):
            heading = line[3:]
    return re.sub(r"\W+", "-", heading or "top").strip("-").lower()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_readme_has_snippets():
    assert len(BLOCKS) >= 7


@pytest.mark.parametrize("block", BLOCKS, ids=[f"{i}-{_title(b)}" for i, b in enumerate(BLOCKS)])
def test_readme_snippet_runs(block, monkeypatch):
    if "init_process_group" in block:
        for name, value in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                                MASTER_PORT=str(_free_port())).items():
            monkeypatch.setenv(name, value)
    exec(compile(block, str(README), "exec"), {"__name__": "readme_snippet"})
