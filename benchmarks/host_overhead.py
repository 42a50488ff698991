"""Host time per call: what flashtile's Python layers cost before a kernel runs.

Short sequences and decoding are launch-bound: at seqlen 512 on the H200 a forward's kernel took
136–215 µs and the host 106–171 µs (``results/h200.md``, the small-N probe), and a decoding step's
kernel takes a few µs. This times the host side alone, per call, median of ``--repeats`` rounds.

* On a GPU: tiny shapes whose kernels take a few µs, calls issued back to back, one synchronisation
  per round: the wall time per call is the host's, since the GPU keeps up. SDPA (the backend it
  picks) is timed the same way, as the peer.
* On a CPU: the Triton launches are replaced by no-ops (a CPU cannot launch them), so what is timed
  is everything above the launch: validation, the autograd Function, the operator dispatch and the
  launchers' choice of kernel and config. Triton's own launch path is not in this figure.

    PYTHONPATH=src python3 benchmarks/host_overhead.py [--layers] [--out host.json]

``--layers`` (GPU) also times each layer of the same calls on its own, from the bare Triton launch of
an empty kernel up to the public function, to show which layer the host time is spent in.

``--engine`` times forward + backward and the backward alone, flashtile's and SDPA's, under three settings
of PyTorch's autograd engine: as it is (on a GPU the backward runs on the engine's device thread, which
runs flashtile's Python Function there), with that thread off (``torch.autograd.set_multithreading_enabled
(False)``: the backward on the calling thread, as on a CPU), and with Python's garbage collector off. Which
setting moves flashtile's time and not SDPA's says where the autograd layer's cost is (benchmarks/NOTES.md,
twenty-first session).

``--graphs`` (GPU) times the same tiny calls captured in CUDA graphs (``torch.cuda.graph``), flashtile's and
SDPA's: a replay launches every kernel of the step with no Python, so what is left per call is the graph's
launch and the kernels themselves — what a model run under CUDA graphs (``torch.compile(mode="reduce-overhead")``,
an inference engine's captured decoding steps) pays instead of the host times above.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import os
import pstats
import statistics
import time

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # the Triton path, with its launches made no-ops

import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402

import flashtile  # noqa: E402
import flashtile.ops  # noqa: E402
from flashtile._options import AttentionOptions, AttentionTensors  # noqa: E402
from flashtile.autograd import FlashAttnFunction  # noqa: E402
from flashtile.triton import launch  # noqa: E402
from flashtile.cli.bench import environment  # noqa: E402


class _NoLaunch:
    """Stands in for a Triton kernel: ``kernel[grid](...)`` does nothing; it keeps the kernel's
    parameter names, by which the launcher orders the arguments."""

    def __init__(self, kernel):
        self.fn, self.arg_names = kernel.fn, kernel.arg_names

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def disable_launches():
    for module in (launch,):  # the one module that launches kernels
        for name, obj in list(vars(module).items()):
            if type(obj).__module__.startswith("triton.runtime") and hasattr(obj, "fn"):
                setattr(module, name, _NoLaunch(obj))


def per_call_us(fn, calls: int, repeats: int, sync) -> float:
    for _ in range(calls // 4):  # warm-up: compiles, caches, allocator
        fn()
    sync()
    rounds = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        rounds.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(rounds)


@triton.jit
def _empty_kernel(x):
    pass


class TinyCalls:
    """The tiny shape's causal calls, flashtile's and SDPA's, on one set of inputs (bf16, batch 1, seqlen 128,
    8 heads, head dim 64: kernels of a few µs): q, k, v, dout in flashtile's layout (batch, seqlen, heads,
    dim), ``sdpa`` the same tensors as SDPA's (batch, heads, seqlen, dim) views, and ``leaves``/``sdpa_leaves``
    copies of each that need gradients. autograd.grad, not backward(): accumulating into .grad would add three
    tensor additions to every step."""

    def __init__(self, device: str):
        self.q, self.k, self.v, self.dout = (torch.randn(1, 128, 8, 64, device=device, dtype=torch.bfloat16)
                                             for _ in range(4))
        self.leaves = tuple(t.clone().requires_grad_() for t in (self.q, self.k, self.v))
        self.sdpa = tuple(t.transpose(1, 2) for t in (self.q, self.k, self.v))
        self.sdpa_leaves = tuple(t.clone().requires_grad_() for t in self.sdpa)
        self.sdpa_dout = self.dout.transpose(1, 2)

    def inference(self):
        with torch.no_grad():
            flashtile.flash_attn_func(self.q, self.k, self.v, causal=True)

    def sdpa_inference(self):
        with torch.no_grad():
            F.scaled_dot_product_attention(*self.sdpa, is_causal=True)

    def recording(self):  # what `flashtile bench` times as its forward: the inputs need grad
        return flashtile.flash_attn_func(*self.leaves, causal=True)

    def sdpa_recording(self):
        return F.scaled_dot_product_attention(*self.sdpa_leaves, is_causal=True)

    def training(self):
        return torch.autograd.grad(self.recording(), self.leaves, self.dout)

    def sdpa_training(self):
        return torch.autograd.grad(self.sdpa_recording(), self.sdpa_leaves, self.sdpa_dout)


def _layers(device: str):
    """(name, call) for each layer of the forward and backward on the tiny shape, bottom up."""
    calls = TinyCalls(device)
    q, k, v, dout = calls.q, calls.k, calls.v, calls.dout
    causal, plain = AttentionOptions(0.125, window_right=0), AttentionTensors()
    out, lse = launch.attention_forward(q, k, v, causal, plain)
    dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
    out_g = calls.recording()
    ops = flashtile.ops  # call_fwd/call_bwd: how eager calls reach the operators (ops.direct)
    return [("an empty Triton kernel", lambda: _empty_kernel[(1,)](q)),
            ("forward launcher", lambda: launch.attention_forward(q, k, v, causal, plain)),
            ("forward operator", lambda: ops.call_fwd(q, k, v, plain, causal)),
            ("forward, public function", calls.inference),
            ("backward launcher (3 kernels)",
             lambda: launch.attention_backward(dout, q, k, v, out, lse, causal, plain, dq, dk, dv)),
            ("backward operator", lambda: ops.call_bwd(dout, q, k, v, out, lse, dq, dk, dv, False, plain, causal)),
            ("backward through autograd", lambda: torch.autograd.grad(out_g, calls.leaves, dout, retain_graph=True))]


def _cases(device: str):
    """(name, flashtile call, SDPA call or None) on the tiny shape, and a decoding step."""
    calls = TinyCalls(device)
    k_cache, v_cache = (torch.randn(4, 1024, 8, 64, device=device, dtype=torch.bfloat16) for _ in range(2))
    q_step = torch.randn(4, 1, 8, 64, device=device, dtype=torch.bfloat16)
    cache_seqlens = torch.full((4,), 1000, dtype=torch.int32, device=device)

    # SDPA's decoding step on the padded cache (issue 20's peer): the cache as (batch, heads, slots, dim) views,
    # the slots past each sequence's length masked out by a boolean mask built once, as a model's step gets it
    sdpa_cache = (k_cache.transpose(1, 2), v_cache.transpose(1, 2))
    sdpa_mask = (torch.arange(1024, device=device) < cache_seqlens[:, None]).view(4, 1, 1, 1024)

    def decoding():
        flashtile.flash_attn_with_kvcache(q_step, k_cache, v_cache, cache_seqlens=cache_seqlens, causal=True)

    def sdpa_decoding():
        with torch.no_grad():
            F.scaled_dot_product_attention(q_step.transpose(1, 2), *sdpa_cache, attn_mask=sdpa_mask)

    return [("forward (no grad)", calls.inference, calls.sdpa_inference),
            ("forward, inputs need grad", calls.recording, calls.sdpa_recording),
            ("forward + backward", calls.training, calls.sdpa_training),
            ("decode step (kv cache 4 x 1024)", decoding, sdpa_decoding)]


def _engine_cases(device: str):
    """(name, call): forward + backward and the backward alone (one recorded graph, retained), flashtile's
    and SDPA's, on the tiny shape."""
    calls = TinyCalls(device)
    out, out_sdpa = calls.recording(), calls.sdpa_recording()
    return [
        ("flashtile fwd+bwd", calls.training),
        ("SDPA fwd+bwd", calls.sdpa_training),
        ("flashtile bwd", lambda: torch.autograd.grad(out, calls.leaves, calls.dout, retain_graph=True)),
        ("SDPA bwd", lambda: torch.autograd.grad(out_sdpa, calls.sdpa_leaves, calls.sdpa_dout, retain_graph=True)),
    ]


class _BodyTimer:
    """Wraps ``FlashAttnFunction.backward`` (PyTorch looks it up on the class at each backward) to add up the
    wall time spent inside it, on whichever thread the engine runs it: what is left of a backward's time is
    the engine's own, and the Python call into the body."""

    def __init__(self):
        self.seconds, self.calls, self._backward = 0.0, 0, FlashAttnFunction.backward

    def __enter__(self):
        body = self._backward

        def timed(ctx, *grads):
            start = time.perf_counter()
            try:
                return body(ctx, *grads)
            finally:
                self.seconds += time.perf_counter() - start
                self.calls += 1

        FlashAttnFunction.backward = staticmethod(timed)
        return self

    def __exit__(self, *exc):
        FlashAttnFunction.backward = staticmethod(self._backward)

    def per_call_us(self) -> float:
        return self.seconds / max(self.calls, 1) * 1e6


def _engine_table(device: str, calls: int, repeats: int, sync) -> list[dict]:
    """µs per call of :func:`_engine_cases` under each engine setting, printed as a table, with the time inside
    flashtile's backward body (its Function's ``backward``) per backward."""
    settings = (("as it is", True, True), ("no device thread", False, True), ("gc off", True, False))
    cases = _engine_cases(device)
    print("autograd engine settings, µs per call: " + " | ".join(name for name, _ in cases)
          + " | inside flashtile's backward body")
    records = []
    try:
        for setting, threads, collect in settings:
            torch.autograd.set_multithreading_enabled(threads)
            (gc.enable if collect else gc.disable)()
            times = [per_call_us(call, calls, repeats, sync) for _, call in cases]
            with _BodyTimer() as body:  # apart from the timed rounds: the wrapper costs a little itself
                per_call_us(cases[2][1], calls, 1, sync)
            records += [dict(case=f"{name}, {setting}", flashtile_us=t) for (name, _), t in zip(cases, times)]
            records.append(dict(case=f"inside the backward body, {setting}", flashtile_us=body.per_call_us()))
            print(f"  {setting:18s} " + " | ".join(f"{t:7.1f}" for t in (*times, body.per_call_us())))
    finally:
        torch.autograd.set_multithreading_enabled(True)
        gc.enable()
    return records


def _captured(step):
    """``step`` warmed up on a side stream, then recorded in a CUDA graph → the graph's ``replay``."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def _graph_table(calls: int, repeats: int) -> list[dict]:
    """µs per replay of :func:`_cases`' forward without grad and forward + backward, captured, flashtile's and
    SDPA's, printed as a table."""
    tiny = TinyCalls("cuda")
    cases = [("forward (no grad)", tiny.inference, tiny.sdpa_inference),
             ("forward + backward", tiny.training, tiny.sdpa_training)]
    print("captured in CUDA graphs, µs per replay")
    records = []
    for name, ours, peer in cases:
        record = dict(case=f"{name}, CUDA graph", flashtile_us=per_call_us(_captured(ours), calls, repeats,
                                                                            torch.cuda.synchronize),
                      sdpa_us=per_call_us(_captured(peer), calls, repeats, torch.cuda.synchronize))
        records.append(record)
        print(f"  {name:34s} flashtile {record['flashtile_us']:7.1f}   SDPA {record['sdpa_us']:7.1f}")
    return records


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--layers", action="store_true", help="also time each layer on its own (GPU)")
    parser.add_argument("--engine", action="store_true",
                        help="also time forward+backward under autograd engine settings (device thread, gc)")
    parser.add_argument("--graphs", action="store_true", help="also time the calls captured in CUDA graphs (GPU)")
    parser.add_argument("--out", help="write the measurements as JSON here")
    parser.add_argument("--profile", action="store_true",
                        help="also print the 25 costliest functions (own time, cProfile) of each flashtile case")
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    if device == "cpu":
        disable_launches()
    records = []
    print(f"host time per call, µs (median of {args.repeats} rounds of {args.calls} calls), {device}"
          + ("" if device == "cuda" else ": Triton launches are no-ops"))
    for name, ours, peer in _cases(device):
        record = dict(case=name, flashtile_us=per_call_us(ours, args.calls, args.repeats, sync))
        if device == "cuda" and peer is not None:
            record["sdpa_us"] = per_call_us(peer, args.calls, args.repeats, sync)
        records.append(record)
        peer_text = f"   SDPA {record['sdpa_us']:7.1f}" if "sdpa_us" in record else ""
        print(f"  {name:34s} flashtile {record['flashtile_us']:7.1f}{peer_text}")
    if args.profile:
        for name, ours, _ in _cases(device):
            profile = cProfile.Profile()
            profile.runcall(lambda: [ours() for _ in range(args.calls)])
            sync()
            print(f"-- {name}: µs per call under cProfile, own time (total with callees)")
            costliest = sorted(pstats.Stats(profile).stats.items(), key=lambda item: -item[1][2])[:25]
            for (file, line, function), (_, _, own, total, _) in costliest:
                where = f"{os.path.basename(file)}:{line}" if line else ""
                print(f"  {own / args.calls * 1e6:7.2f} ({total / args.calls * 1e6:7.2f})  {function} {where}")
    if args.layers and device == "cuda":
        print("each layer on its own")
        for name, call in _layers(device):
            records.append(dict(case=name, flashtile_us=per_call_us(call, args.calls, args.repeats, sync)))
            print(f"  {name:34s} flashtile {records[-1]['flashtile_us']:7.1f}")
    if args.engine:
        records += _engine_table(device, args.calls, args.repeats, sync)
    if args.graphs and device == "cuda":
        records += _graph_table(args.calls, args.repeats)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(environment=environment(device), records=records), f, indent=1)


if __name__ == "__main__":
    main()
