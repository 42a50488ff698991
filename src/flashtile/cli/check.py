"""``python -m flashtile check``: verify flashtile on every path this machine has, and show its memory.

A path is where flashtile's calls run (``flashtile.backend()``, ``flashtile.ops.BACKENDS``): on a
GPU machine the "cuda" path; on a CPU machine the "cpu" path (the PyTorch path) and, with
``--interpret``, the "interpreter" path (the Triton kernels under Triton's interpreter).

1. Accuracy, on each path: forward and backward of ``flash_attn_func`` against the float64
   standard reference, next to PyTorch's own error in the same dtype (flash-attn's rule: ≤ 2×
   for the output, ≤ 3× for gradients, plus a float32-ulp floor). The path this process's calls
   take runs here; another runs in a subprocess whose ``TRITON_INTERPRET`` selects it (the
   interpreter is chosen when triton is imported, so one process cannot switch to it) and sends
   its rows back as JSON.
2. Memory (not with ``--quick``): peak extra memory of forward+backward, flashtile vs standard
   attention, as the sequence grows (CUDA: the caching allocator's peak; CPU: the peak resident
   set of a fresh process on the "cpu" path, Linux).

``DESCRIPTION`` is the user's view of this, for ``check --help``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap

import torch

from .. import reference
from ..accuracy import error_bound, max_error
from ..interface import flash_attn_func
from ..ops import BACKENDS, backend

ACCURACY_CASES = {
    # (dtype, batch, seqlen_q, seqlen_k, nheads_q, nheads_k, head_dim, causal)
    "full": [
        (torch.float16, 2, 257, 257, 4, 4, 64, False),
        (torch.float16, 2, 257, 257, 4, 4, 64, True),
        (torch.bfloat16, 2, 193, 311, 8, 2, 128, True),
        (torch.bfloat16, 1, 311, 193, 4, 1, 96, False),
        (torch.float32, 1, 129, 129, 4, 4, 40, True),
        (torch.bfloat16, 1, 65, 65, 2, 2, 256, True),
    ],
    # every dtype, causal or not, GQA, seqlen_q ≠ seqlen_k, lengths off the block size; small
    # enough for Triton's interpreter to take about a second
    "quick": [
        (torch.float16, 1, 97, 97, 2, 2, 64, False),
        (torch.bfloat16, 1, 65, 97, 4, 2, 64, True),
        (torch.float32, 1, 33, 33, 2, 1, 40, True),
    ],
}

# TRITON_INTERPRET of a process whose calls on CPU tensors take each CPU path
_PATH_ENVIRONMENT = {"cpu": "0", "interpreter": "1"}

_PATH_LINES = "\n".join(textwrap.fill(text, 96, initial_indent=f"  {name:12} ", subsequent_indent=" " * 15)
                        for name, text in BACKENDS.items())

DESCRIPTION = f"""\
Verify flashtile on this machine, on every path it has, and show its memory.

A path is where flashtile's calls run. The output begins with the one your own calls take here
(flashtile.backend()):
{_PATH_LINES}

What is checked:
  accuracy  forward and backward of flash_attn_func (out, dq, dk, dv) against a float64
            reference, by flash-attn's rule: an error at most 2x (output) or 3x (gradients)
            PyTorch's own error in the same dtype, plus a float32-ulp floor; fp16, bf16, fp32,
            causal and not, GQA, lengths off the block size
  memory    peak extra memory of a causal forward+backward, flashtile vs standard attention,
            seqlen 1024..16384 on a GPU (allocator peak), 512..4096 on the "cpu" path (peak RSS)

Paths checked, and how long it takes (CPU: 2 shared cores; GPU: an H200, whose first run compiles
the kernels, which Triton then caches):
  GPU machine            cuda: accuracy and memory                 ~10 s; the first run ~2 min
    --quick              cuda: 3 small accuracy cases, no memory   ~10 s; the first run ~1 min
  CPU machine            cpu: accuracy and memory                  ~25-45 s
    --interpret          also interpreter: accuracy                ~25 s more
    --quick              cpu: 3 small accuracy cases, no memory    ~3 s
    --quick --interpret  cpu and interpreter, 3 cases each         ~6 s

Exit status 0 and last line "all checks passed" when every check passes, else 1.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true",
                        help="3 small accuracy cases per path and no memory table: seconds, not tens of seconds")
    parser.add_argument("--interpret", action="store_true",
                        help="on a machine without a GPU, also check the Triton kernels under Triton's interpreter")


def accuracy_row(device, dtype, batch, seqlen_q, seqlen_k, nheads_q, nheads_k, head_dim, causal, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seqlen_q, nheads_q, head_dim, generator=g)
    k = torch.randn(batch, seqlen_k, nheads_k, head_dim, generator=g)
    v = torch.randn(batch, seqlen_k, nheads_k, head_dim, generator=g)
    do = torch.randn(batch, seqlen_q, nheads_q, head_dim, generator=g)
    ours = [t.to(device, dtype).requires_grad_() for t in (q, k, v)]
    out = flash_attn_func(*ours, causal=causal)
    got = [out, *torch.autograd.grad(out, ours, do.to(device, dtype))]
    refs = {}
    for ref_dtype in (torch.float64, dtype):
        ts = [t.to(device, ref_dtype).transpose(1, 2).requires_grad_() for t in (q, k, v)]
        ref_out, _, _ = reference.attention_forward(*ts, causal=causal)
        grads = torch.autograd.grad(ref_out, ts, do.to(device, ref_dtype).transpose(1, 2))
        refs[ref_dtype] = [t.transpose(1, 2) for t in (ref_out, *grads)]
    row = {"path": backend(device), "dtype": str(dtype).replace("torch.", ""),
           "shape": f"{batch}x{seqlen_q}x{seqlen_k} h{nheads_q}:{nheads_k} d{head_dim}", "causal": causal, "ok": True}
    for name, ours_t, r64, rlow, factor in zip(("out", "dq", "dk", "dv"), got, refs[torch.float64], refs[dtype],
                                               (2, 3, 3, 3)):
        row[name] = max_error(ours_t, r64)
        row[f"torch_{name}"] = max_error(rlow, r64)
        row["ok"] &= row[name] <= error_bound(r64, rlow, factor)
    return row


def local_accuracy_rows(cases: str) -> list[dict]:
    """The rows of ``ACCURACY_CASES[cases]`` on the path this process's calls take."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return [accuracy_row(device, *case) for case in ACCURACY_CASES[cases]]


_ACCURACY_SNIPPET = """
import json, sys
from flashtile.cli.check import local_accuracy_rows
print(json.dumps(local_accuracy_rows(sys.argv[1])))
"""


def accuracy_rows(path: str, cases: str) -> list[dict]:
    """The rows of ``ACCURACY_CASES[cases]`` on ``path``: here if this process's calls take it,
    else in a subprocess set up for it (subprocess.CalledProcessError if that fails)."""
    if path == backend():
        return local_accuracy_rows(cases)
    env = dict(os.environ, TRITON_INTERPRET=_PATH_ENVIRONMENT[path])
    result = subprocess.run([sys.executable, "-c", _ACCURACY_SNIPPET, cases], env=env, capture_output=True, text=True,
                            check=True)
    return json.loads(result.stdout.splitlines()[-1])  # the last line: anything printed before it is not ours


def paths_to_check(interpret: bool) -> list[str]:
    """The path the user's calls take first, then the machine's other paths that were asked for."""
    if torch.cuda.is_available():
        return ["cuda"]
    return list(dict.fromkeys([backend(), "cpu", *(["interpreter"] if interpret else [])]))


_MEMORY_SNIPPET = """
import json, sys, torch
from flashtile import flash_attn_func, reference
def status_bytes(field):  # VmRSS (now) or VmHWM (peak since the last reset), Linux
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field))
impl, n, heads, d = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
def step(n):
    q, k, v, do = (torch.randn(1, n, heads, d) for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_()
    before = status_bytes("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak to the current resident set
    if impl == "flashtile":
        out = flash_attn_func(q, k, v, causal=True)
    else:
        out = reference.attention_forward(*(t.transpose(1, 2) for t in (q, k, v)), causal=True)[0].transpose(1, 2)
    out.backward(do)
    return before
step(64)  # load the math libraries and start autograd first: their memory is not ours
before = step(n)
print(json.dumps(status_bytes("VmHWM") - before))
"""


def peak_memory_bytes(device, impl, seqlen, nheads, head_dim):
    """Peak extra bytes of one causal forward+backward (inputs excluded); on the CPU, of the "cpu"
    path (the interpreter's memory says nothing about the GPU's, and it is far too slow here)."""
    if device == "cpu":
        cmd = [sys.executable, "-c", _MEMORY_SNIPPET, impl, str(seqlen), str(nheads), str(head_dim)]
        env = dict(os.environ, TRITON_INTERPRET=_PATH_ENVIRONMENT["cpu"])
        return json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout)
    dtype = torch.bfloat16
    q, k, v, do = (torch.randn(1, seqlen, nheads, head_dim, device=device, dtype=dtype) for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    if impl == "flashtile":
        out = flash_attn_func(q, k, v, causal=True)
    else:
        out = reference.attention_forward(*(t.transpose(1, 2) for t in (q, k, v)), causal=True)[0].transpose(1, 2)
    out.backward(do)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    del out, q, k, v, do
    torch.cuda.empty_cache()
    return peak


def print_path_header(interpret: bool) -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    users_path = backend()
    print(f"flashtile check on {name}; torch {torch.__version__}")
    print(textwrap.fill(f'Your calls on this machine take the "{users_path}" path (flashtile.backend()): '
                        f"{BACKENDS[users_path]}", 100, subsequent_indent="  "))
    if users_path == "cpu" and not interpret:
        print("The Triton kernels are not checked: add --interpret to check them too, under Triton's interpreter.")
    if device == "cuda" and interpret:
        print("--interpret is for machines without a GPU: the kernels are checked on the GPU here.")


def run_check(quick: bool = False, interpret: bool = False) -> bool:
    """Print the checks of every path this machine has (see ``DESCRIPTION``); True if all pass."""
    print_path_header(interpret)
    cases = "quick" if quick else "full"
    print("\nAccuracy: max |error| vs float64 reference; in brackets PyTorch's own error in that dtype")
    errors = " ".join(f"{name:>21}" for name in ("out", "dq", "dk", "dv"))
    print(f"{'path':11} {'dtype':9} {'shape':28} {'causal':6} {errors}  verdict")
    all_ok = True
    for path in paths_to_check(interpret):
        try:
            rows = accuracy_rows(path, cases)
        except subprocess.CalledProcessError as error:
            print(f"{path:11} FAIL: the process checking it failed ({error.returncode}):\n{error.stderr.strip()}")
            all_ok = False
            continue
        for row in rows:
            all_ok &= row["ok"]
            cells = " ".join(f"{row[n]:9.2e} [{row['torch_' + n]:9.2e}]" for n in ("out", "dq", "dk", "dv"))
            print(f"{row['path']:11} {row['dtype']:9} {row['shape']:28} {str(row['causal']):6} {cells}  "
                  f"{'ok' if row['ok'] else 'FAIL'}")

    if quick:
        print("\nMemory: not measured with --quick")
    else:
        print_memory_table()
    print("\nall checks passed" if all_ok else "\nSOME CHECKS FAILED")
    return all_ok


def print_memory_table() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    seqlens = [1024, 2048, 4096, 8192, 16384] if device == "cuda" else [512, 1024, 2048, 4096]
    nheads, head_dim = (16, 128) if device == "cuda" else (4, 64)
    print(f'\nMemory ("{device}" path): peak extra bytes of causal forward+backward, batch 1, {nheads} heads, '
          f"head dim {head_dim}{' (bf16)' if device == 'cuda' else ' (fp32)'}")
    print(f"{'seqlen':>7} {'flashtile':>12} {'standard':>12} {'ratio':>7}")
    for n in seqlens:
        ours = peak_memory_bytes(device, "flashtile", n, nheads, head_dim)
        standard = peak_memory_bytes(device, "standard", n, nheads, head_dim)
        print(f"{n:>7} {ours / 2**20:10.1f}MB {standard / 2**20:10.1f}MB {standard / max(ours, 1):6.1f}x")
