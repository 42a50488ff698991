"""Where the host time of a small backward through autograd goes (issue 20; benchmarks/NOTES.md, twenty-second
session): the same backward of host_overhead.py's tiny call (bf16, 1 × 128 × 8 × 64, causal), timed layer by
layer from the launcher up to ``torch.autograd.grad``, and the autograd engine's cost for a Python node against
a C++ one (SDPA's) and against a Python Function that does nothing.

    PYTHONPATH=src python3 benchmarks/experiments/backward_parts.py [--calls 400] [--rounds 3]

Each row: µs per call, the median of ``--rounds`` rounds of ``--calls`` calls, one synchronisation per round;
the rows alternate round by round, so that a host's drift spreads over all of them. On a CPU the Triton
launches are no-ops (as host_overhead.py's).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # host_overhead, beside this folder
import host_overhead  # noqa: E402  (sets TRITON_INTERPRET on a CPU before flashtile is imported)

from flashtile import ops  # noqa: E402
from flashtile._options import AttentionOptions, AttentionTensors  # noqa: E402
from flashtile.triton import launch, plans  # noqa: E402


class _Nothing(torch.autograd.Function):
    """Three inputs, two outputs, a backward that returns its incoming gradient three times: the engine's
    cost for a Python node alone."""

    @staticmethod
    def forward(ctx, q, k, v):
        ctx.set_materialize_grads(False)
        return q.view_as(q), q.new_empty(())

    @staticmethod
    def backward(ctx, dout, _):
        return dout, dout, dout


def _rows(device: str):
    calls = host_overhead.TinyCalls(device)
    q, k, v, dout = calls.q, calls.k, calls.v, calls.dout
    causal, plain = AttentionOptions(0.125, window_right=0), AttentionTensors()
    out, lse = launch.attention_forward(q, k, v, causal, plain)
    dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
    out_g = calls.recording()
    node = out_g.grad_fn  # the Function's backward object: its apply runs the backward body, no engine
    out_sdpa = calls.sdpa_recording()
    out_nothing, _ = _Nothing.apply(*calls.leaves)

    def fresh_buffers():
        grads = [torch.empty_like(t) for t in (q, k, v)]
        ops.call_bwd(dout, q, k, v, out, lse, *grads, False, plain, causal)

    def body():  # as the engine runs it: grad mode off
        with torch.no_grad():
            node.apply(dout, None)

    def grad(output, inputs, gradient):
        return lambda: torch.autograd.grad(output, inputs, gradient, retain_graph=True)

    return [
        ("launcher, fixed buffers",
         lambda: launch.attention_backward(dout, q, k, v, out, lse, causal, plain, dq, dk, dv)),
        ("operator, fixed buffers", lambda: ops.call_bwd(dout, q, k, v, out, lse, dq, dk, dv, False, plain, causal)),
        ("operator, 3 fresh empty_like", fresh_buffers),
        ("3 empty_like alone", lambda: [torch.empty_like(t) for t in (q, k, v)]),
        ("the Function's backward, no engine", body),
        ("autograd.grad, flashtile", grad(out_g, calls.leaves, dout)),
        ("autograd.grad, SDPA", grad(out_sdpa, calls.sdpa_leaves, calls.sdpa_dout)),
        ("autograd.grad, a Function doing nothing", grad(out_nothing, calls.leaves, dout)),
    ]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    if device == "cpu":
        host_overhead.disable_launches()
    for threads in (True, False):
        torch.autograd.set_multithreading_enabled(threads)
        rows = _rows(device)
        times = {name: [] for name, _ in rows}
        for _ in range(args.rounds):
            for name, call in rows:
                times[name].append(host_overhead.per_call_us(call, args.calls, 1, sync))
        print(f"{device}, engine device thread {'on' if threads else 'off'}: µs per call, median (min-max) "
              f"of {args.rounds} rounds of {args.calls}")
        for name, values in times.items():
            print(f"  {name:42s} {statistics.median(values):7.1f} ({min(values):.1f}-{max(values):.1f})")
    torch.autograd.set_multithreading_enabled(True)
    # a replay encodes a copy-engine descriptor once per address of each descriptor argument: many addresses
    # per argument would mean encodings on most calls (the buffers' addresses not recurring)
    kept = [len(maps.maps) for plan in plans._PLANS.values() for step in plan.launches if step.direct is not None
            for _, _, maps in step.direct.fills if maps is not None]
    print(f"encoded descriptors kept per descriptor argument: {sorted(kept)}")


if __name__ == "__main__":
    main()
