"""Ring attention on several GPUs: correctness, scaling and the longest sequence that trains.

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=src \\
        torchrun --standalone --nproc-per-node 8 benchmarks/ring_multigpu.py --out-dir DIR
    python -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/ring_multigpu.py --smoke --out-dir DIR

One process per GPU (``torch.cuda.set_device(LOCAL_RANK)``, NCCL) when CUDA is present, else
gloo on the CPU, where flashtile's CPU path does the local attention (only ``--smoke`` runs
there). NVLink multicast stays off: before torch is imported, the script sets
NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and NVSHMEM_DISABLE_NVLS=1 unless they
are already set, and refuses to run if any of them is set to anything else (on the lent
multi-GPU machines multicast can put the host's shared GPUs out of service).

Three parts (``--parts``), each timed and written as it finishes, so a run cut short keeps
what it measured. W is the launch's world size.

1. **correctness**: ``ring_flash_attn_func`` on W ranks against attention on the gathered
   sequence, rank 0 judging. Cases: zigzag causal and contiguous non-causal; bf16, GQA 32:8,
   head dim 128, 4096 tokens in all (float64 standard attention must fit on one GPU). The
   gathered out, dq, dk, dv are judged against float64 standard attention
   (``flashtile.reference``) by flash-attn's rule (``flashtile.accuracy``: error ≤ 2× for out,
   3× for gradients, PyTorch's own bf16 error, plus a float32-ulp floor); the log-sum-exp
   within 1e-5 of float64's (as tests/test_ring.py); and the largest absolute difference from
   single-GPU ``flashtile.flash_attn_func`` on the full sequence is reported next to them.
   A failed case makes the script exit with status 1 after the other parts have run.

2. **scaling**: forward+backward time of one ring step at a fixed number L of tokens per
   GPU (8k, 32k, 128k), batch 1, bf16, 16 heads MHA, head dim 128 (nheads·headdim = 2048, as
   the standard sweep and benchmarks/ring_overhead.py; MHA sends 4× the K/V bytes of 32:8 GQA
   per FLOP, the harder case for overlapping messages with compute), zigzag causal and
   contiguous non-causal, on sub-rings of w = 1, 2, 4, ... ranks (ranks 0..w−1, ``new_group``)
   up to W, so that one launch gives every world size (``--world-sizes``).

   Timing: a fixed number of calls agreed by all ranks of the ring (a warm-up call that also
   compiles, then ``ceil(1 s / the slowest rank's first timed call)`` calls, 3 to 20); before
   each call the ring's ranks meet (an all-reduce, then a device synchronisation), and CUDA
   events time the call. A rank's time is its median; the ring's time T_ring is the slowest
   rank's median (a step ends when the last rank finishes).

   Efficiency, two ways; both are 1 for a perfect ring and the target (issue 8) is ≥ 90% at
   32k tokens per GPU.

   * **local blocks** (for every row): T_local / T_ring, where T_local is the single-GPU time
     of the attention one rank computes in the ring, each block timed alone with
     ``flash_attn_func`` forward+backward on rank 0 (no ring, no messages, no merges).
     Contiguous non-causal: W blocks of L queries × L keys, T_local = W·T(L×L). Zigzag
     causal: the diagonal block (the rank's two chunks causally on themselves, L×L causal)
     and W−1 blocks of half the pairs, L×L/2 (K/V from a lower rank) or L/2×L (from a
     higher rank); every ring step after the first holds both kinds on some rank and lasts
     as long as the slower, so T_local = T_causal(L×L) + (W−1)·max(T(L×L/2), T(L/2×L)).
     Either way a rank's blocks are 1/W of the full attention's FLOPs, so T_local is what
     the ring would take if the messages, merges and float32 accumulators cost nothing.
   * **full sequence** (when W·L ≤ ``--full-reference-max-tokens``, 256k by default):
     T_single(W·L) / (W·T_ring), T_single being ``flash_attn_func`` on the whole sequence on
     one GPU. This also charges the ring for cutting one large attention into W smaller
     calls (shorter key loops, smaller grids).

   TFLOP/s per GPU = the full attention's FLOPs / W / T_ring, with FLOPs = 3.5·4·H·N²·D
   (×0.5 causal), N = W·L.

3. **longest**: zigzag causal forward+backward (one step, same heads and head dim as part 2)
   on all W ranks at L = 64k, 128k, 256k, ... tokens per GPU (a warm-up call before the
   first), doubling until a rank runs out of memory (each rank catches
   ``torch.cuda.OutOfMemoryError``; the ranks agree through an all-reduce of a flag), until
   the search with the next size would pass ``--longest-budget-s`` (150 s; a step's time grows
   as L², so the next is predicted at 4× the last); past 2³¹ elements in a local tensor the
   kernels take 64-bit offsets (the Triton kernels, not the Gluon ones). Reports
   ``torch.cuda.max_memory_allocated`` of every GPU over the step (inputs and gradients
   included), the bytes per local token, and a linear projection of the L at which the peak
   would reach the GPU's memory. The ranks agree twice per size: after allocating the
   inputs (a rank short of memory there stops all before the ring starts) and after the
   step. Inside the step an out-of-memory error is survived only where every rank raises it
   at the same point (identical shapes and allocations make that the rule); a rank that
   fails alone there leaves the others waiting in the ring until the process group's
   5-minute timeout ends the run (the parts before are already written).

``--smoke`` shrinks everything (64–256 tokens per GPU, 2 heads, head dim 32, float32) to
check the script itself on CPUs with gloo in seconds; its numbers mean nothing.

Outputs in ``--out-dir``: ``ring_multigpu_w{W}.json`` (every measurement and the
environment) and ``ring_multigpu_w{W}.md`` (the tables), rewritten after each part; the
tables also go to stdout, progress to stderr.
"""

from __future__ import annotations

import os

# NVLink multicast off, before torch.distributed (or anything it loads) initialises
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
for _name, _value in MULTICAST_OFF.items():
    os.environ.setdefault(_name, _value)

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import datetime  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import triton  # noqa: E402

import flashtile  # noqa: E402
from flashtile import reference  # noqa: E402
from flashtile.accuracy import error_bound, max_error  # noqa: E402
from flashtile.distributed import gather_sequence, ring_flash_attn_func, shard_sequence  # noqa: E402

PARTS = ("correctness", "scaling", "longest")
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
LSE_ATOL = 1e-5  # float32 log-sum-exp against float64, as tests/test_ring.py
TIMING_TARGET_MS = 1000.0  # timed calls per case: about this much time, within the bounds below
MIN_TIMED_CALLS, MAX_TIMED_CALLS = 3, 20
GROUP_TIMEOUT = datetime.timedelta(minutes=5)  # longer than any single wait; a hung ring fails inside the run


@dataclasses.dataclass(frozen=True)
class Config:
    dtype: str
    correctness_tokens: int  # in all, split over the W ranks
    correctness_heads: tuple[int, int]  # (query heads, key/value heads)
    correctness_head_dim: int
    scaling_tokens: tuple[int, ...]  # per GPU
    heads: int  # scaling and longest, MHA
    head_dim: int
    full_reference_max_tokens: int
    longest_start_tokens: int  # per GPU
    longest_max_tokens: int | None  # per GPU; None: until out of memory or time
    longest_budget_s: float


FULL = Config(dtype="bf16", correctness_tokens=4096, correctness_heads=(32, 8), correctness_head_dim=128,
              scaling_tokens=(8192, 32768, 131072), heads=16, head_dim=128, full_reference_max_tokens=262144,
              longest_start_tokens=65536, longest_max_tokens=None, longest_budget_s=150.0)
SMOKE = Config(dtype="fp32", correctness_tokens=128, correctness_heads=(2, 1), correctness_head_dim=32,
               scaling_tokens=(64, 128), heads=2, head_dim=32, full_reference_max_tokens=256,
               longest_start_tokens=64, longest_max_tokens=256, longest_budget_s=30.0)


def log(message: str) -> None:
    if dist.get_rank() == 0:
        print(message, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------
# Process groups, agreement and timing


def sync_ranks(group, device) -> None:
    """All ranks of ``group`` meet here, with their devices idle."""
    dist.all_reduce(torch.zeros(1, device=device), group=group)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def agree(value: float, group, device, op=dist.ReduceOp.MAX) -> float:
    t = torch.tensor([float(value)], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=op, group=group)
    return t.item()


def gather_floats(value: float, group, device) -> list[float]:
    """``value`` of every rank of ``group``, in rank order."""
    mine = torch.tensor([float(value)], dtype=torch.float64, device=device)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, mine, group=group)
    return [t.item() for t in everyone]


def timed_call_ms(step, device) -> float:
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    start_s = time.perf_counter()
    step()
    return (time.perf_counter() - start_s) * 1e3


def median_ms(step, device, ring_group=None) -> float:
    """Median time of ``step()`` on this process (see the module docstring).

    ``ring_group``: the ranks that run ``step`` together (they meet before every call and
    agree on the number of calls); None for a process timing alone.
    """
    def call():
        if ring_group is not None:
            sync_ranks(ring_group, device)
        return timed_call_ms(step, device)

    call()  # warm-up: compiles the kernels and fills the allocator's cache
    first = call()
    estimate = first if ring_group is None else agree(first, ring_group, device)
    count = min(MAX_TIMED_CALLS, max(MIN_TIMED_CALLS, math.ceil(TIMING_TARGET_MS / max(estimate, 1e-3))))
    return statistics.median([first] + [call() for _ in range(count - 1)])


def random_inputs(seqlen_q: int, seqlen_k: int, heads_q: int, heads_k: int, head_dim: int, dtype, device,
                  seed: int):
    """q, k, v (requiring grad) and dout, batch 1, random normal; generated on the device."""
    g = torch.Generator(device=device).manual_seed(seed)

    def rand(seqlen, heads):
        return torch.randn(1, seqlen, heads, head_dim, generator=g, device=device, dtype=dtype)

    q, k, v = rand(seqlen_q, heads_q).requires_grad_(), rand(seqlen_k, heads_k).requires_grad_(), \
        rand(seqlen_k, heads_k).requires_grad_()
    return q, k, v, rand(seqlen_q, heads_q)


def fwd_bwd(attend, q, k, v, dout):
    """One forward+backward; torch.autograd.grad, so that no gradient accumulates between calls."""
    def step():
        torch.autograd.grad(attend(q, k, v), (q, k, v), dout)

    return step


def single_gpu_ms(seqlen_q: int, seqlen_k: int, causal: bool, cfg: Config, device) -> float:
    """flash_attn_func forward+backward on one GPU, this process alone."""
    q, k, v, dout = random_inputs(seqlen_q, seqlen_k, cfg.heads, cfg.heads, cfg.head_dim, DTYPES[cfg.dtype], device,
                                  seed=seqlen_q + seqlen_k)
    return median_ms(fwd_bwd(lambda q, k, v: flashtile.flash_attn_func(q, k, v, causal=causal), q, k, v, dout),
                     device)


def attention_flops(total_tokens: int, causal: bool, cfg: Config) -> float:
    """Forward+backward FLOPs of the full attention: 3.5 · 4·H·N²·D (×0.5 causal)."""
    return 3.5 * 4 * cfg.heads * total_tokens**2 * cfg.head_dim * (0.5 if causal else 1.0)


# ----------------------------------------------------------------------------------------------
# Part 1: correctness


def references(q, k, v, dout, causal: bool) -> dict:
    """Standard attention in float64 and in the inputs' dtype: {dtype: {name: tensor}}."""
    results = {}
    for dtype in (torch.float64, q.dtype):
        qr, kr, vr = (t.detach().transpose(1, 2).to(dtype).requires_grad_() for t in (q, k, v))
        out, lse, _ = reference.attention_forward(qr, kr, vr, causal=causal)
        grads = torch.autograd.grad(out, (qr, kr, vr), dout.transpose(1, 2).to(dtype))
        results[dtype] = dict(zip(("out", "lse", "dq", "dk", "dv"),
                                  (out.transpose(1, 2), lse, *(g.transpose(1, 2) for g in grads))))
    return results


def judge(ring: dict, q, k, v, dout, causal: bool) -> list[dict]:
    """Rank 0: the gathered ring results against float64 and against single-GPU flashtile."""
    refs = references(q, k, v, dout, causal)
    ref64, ref_lowp = refs[torch.float64], refs[q.dtype]
    qs, ks, vs = (t.detach().clone().requires_grad_() for t in (q, k, v))
    single_out, single_lse, _ = flashtile.flash_attn_func(qs, ks, vs, causal=causal, return_attn_probs=True)
    single = dict(zip(("out", "lse", "dq", "dk", "dv"),
                      (single_out, single_lse, *torch.autograd.grad(single_out, (qs, ks, vs), dout))))
    rows = []
    for name, factor in (("out", 2), ("lse", None), ("dq", 3), ("dk", 3), ("dv", 3)):
        got = ring[name]
        error = max_error(got, ref64[name])
        bound = LSE_ATOL if factor is None else error_bound(ref64[name], ref_lowp[name], factor)
        rows.append({
            "tensor": name,
            "error": error,
            "bound": bound,
            "torch_error": None if factor is None else max_error(ref_lowp[name], ref64[name]),
            "diff_vs_flashtile": (got.float() - single[name].float()).abs().max().item(),
            "ok": bool(error <= bound and not torch.isnan(got).any()),
        })
    return rows


def correctness(cfg: Config, device) -> list[dict]:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    heads_q, heads_k = cfg.correctness_heads
    dtype = DTYPES[cfg.dtype]
    cases = []
    for layout, causal in (("zigzag", True), ("contiguous", False)):
        log(f"correctness: {layout}, causal={causal}")
        # the same full inputs on every rank (CPU generator, fixed seed)
        g = torch.Generator().manual_seed(cfg.correctness_tokens + int(causal))
        q, k, v, dout = (torch.randn(1, cfg.correctness_tokens, heads, cfg.correctness_head_dim, generator=g)
                         .to(device, dtype) for heads in (heads_q, heads_k, heads_k, heads_q))

        local = [shard_sequence(t, rank, world_size, layout).requires_grad_() for t in (q, k, v)]
        out, lse, _ = ring_flash_attn_func(*local, causal=causal, layout=layout, return_attn_probs=True)
        grads = torch.autograd.grad(out, local, shard_sequence(dout, rank, world_size, layout))
        ring = {name: gather_sequence(t.detach(), layout=layout) for name, t in zip(("out", "dq", "dk", "dv"),
                                                                                        (out, *grads))}
        ring["lse"] = gather_sequence(lse, layout=layout, dim=2)
        case = {"layout": layout, "causal": causal, "dtype": cfg.dtype, "world_size": world_size,
                "shape": f"1x{cfg.correctness_tokens} h{heads_q}:{heads_k} d{cfg.correctness_head_dim}"}
        if rank == 0:
            case["tensors"] = judge(ring, q, k, v, dout, causal)
            case["ok"] = all(row["ok"] for row in case["tensors"])
        cases.append(case)
        del q, k, v, dout, local, out, lse, grads, ring
        sync_ranks(dist.group.WORLD, device)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return cases


# ----------------------------------------------------------------------------------------------
# Part 2: scaling


def ring_ms(tokens: int, causal: bool, cfg: Config, device, group) -> list[float]:
    """Every ring rank's median fwd+bwd step time at ``tokens`` per GPU (ranks of ``group`` only)."""
    layout = "zigzag" if causal else "contiguous"
    q, k, v, dout = random_inputs(tokens, tokens, cfg.heads, cfg.heads, cfg.head_dim, DTYPES[cfg.dtype], device,
                                  seed=1000 * dist.get_rank() + tokens)

    def attend(q, k, v):
        return ring_flash_attn_func(q, k, v, group=group, causal=causal, layout=layout)

    mine = median_ms(fwd_bwd(attend, q, k, v, dout), device, ring_group=group)
    return gather_floats(mine, group, device)


def local_block_ms(tokens: int, causal: bool, cfg: Config, device) -> dict:
    """Rank 0 alone: single-GPU times of the block shapes a ring rank computes."""
    if not causal:
        return {"LxL": single_gpu_ms(tokens, tokens, False, cfg, device)}
    half = tokens // 2
    return {"LxL causal": single_gpu_ms(tokens, tokens, True, cfg, device),
            "LxL/2": single_gpu_ms(tokens, half, False, cfg, device),
            "L/2xL": single_gpu_ms(half, tokens, False, cfg, device)}


def local_work_ms(blocks: dict, world_size: int, causal: bool) -> float:
    """T_local of the module docstring, from the block times."""
    if not causal:
        return world_size * blocks["LxL"]
    return blocks["LxL causal"] + (world_size - 1) * max(blocks["LxL/2"], blocks["L/2xL"])


def default_world_sizes(world_size: int) -> list[int]:
    sizes = [w for w in (2**i for i in range(world_size.bit_length())) if w < world_size]
    return sizes + [world_size]


def scaling(cfg: Config, device, world_sizes: list[int], record) -> list[dict]:
    rank = dist.get_rank()
    world = dist.group.WORLD
    # every rank creates every group, in the same order (new_group is collective)
    groups = {w: world if w == dist.get_world_size() else dist.new_group(list(range(w))) for w in world_sizes}
    rows = []
    full_sequence_ms = {}  # (total tokens, causal) → ms: a total recurs across tokens/GPU and W
    for tokens in cfg.scaling_tokens:
        for causal in (True, False):
            blocks = None
            if rank == 0:
                log(f"scaling: {tokens} tokens/GPU, causal={causal}: single-GPU blocks")
                blocks = local_block_ms(tokens, causal, cfg, device)
                # the diagonal block is the whole sequence of a ring of one
                full_sequence_ms.setdefault((tokens, causal), blocks["LxL causal" if causal else "LxL"])
            sync_ranks(world, device)
            for w in world_sizes:
                ring_times = None
                if rank < w:
                    log(f"scaling: {tokens} tokens/GPU, causal={causal}, ring of {w}")
                    ring_times = ring_ms(tokens, causal, cfg, device, groups[w])
                sync_ranks(world, device)
                full_key = (w * tokens, causal)
                if rank == 0 and w * tokens <= cfg.full_reference_max_tokens and full_key not in full_sequence_ms:
                    log(f"scaling: full sequence of {w * tokens} tokens on one GPU, causal={causal}")
                    full_sequence_ms[full_key] = single_gpu_ms(w * tokens, w * tokens, causal, cfg, device)
                sync_ranks(world, device)
                if rank == 0:
                    ring = max(ring_times)
                    local = local_work_ms(blocks, w, causal)
                    full_ms = full_sequence_ms.get(full_key)
                    rows.append({
                        "world_size": w, "tokens_per_gpu": tokens, "total_tokens": w * tokens, "causal": causal,
                        "layout": "zigzag" if causal else "contiguous",
                        "ring_ms": ring, "ring_ms_per_rank": ring_times,
                        "local_blocks_ms": blocks, "local_work_ms": local, "efficiency_local": local / ring,
                        "full_sequence_ms": full_ms,
                        "efficiency_full": None if full_ms is None else full_ms / (w * ring),
                        "tflops_per_gpu": attention_flops(w * tokens, causal, cfg) / w / ring * 1e-9,
                    })
                    record(rows)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


# ----------------------------------------------------------------------------------------------
# Part 3: the longest sequence that trains


def together(device, fn, *args, **kwargs):
    """Run ``fn(*args, **kwargs)`` on every rank → (its value or None, the ranks out of memory).

    Every rank learns whether any rank ran out of memory, so that all skip the ring together.
    """
    value, out_of_memory = None, False
    try:
        value = fn(*args, **kwargs)
    except torch.cuda.OutOfMemoryError:
        out_of_memory = True
    if device.type == "cuda":
        torch.cuda.empty_cache()
    flags = gather_floats(out_of_memory, dist.group.WORLD, device)
    return value, [rank for rank, flag in enumerate(flags) if flag]


def longest_step(q, k, v, dout, device, warm_up: bool) -> tuple[float, float | None]:
    """One zigzag causal ring fwd+bwd on all ranks → (seconds, this GPU's peak bytes or None)."""
    step = fwd_bwd(lambda q, k, v: ring_flash_attn_func(q, k, v, causal=True, layout="zigzag"), q, k, v, dout)
    if warm_up:  # compiles the kernels when no other part has
        step()
    sync_ranks(dist.group.WORLD, device)
    seconds = timed_call_ms(step, device) / 1e3
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return seconds, peak


def longest(cfg: Config, device, record) -> dict:
    world, world_size = dist.group.WORLD, dist.get_world_size()
    gpu_bytes = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    result = {"causal": True, "layout": "zigzag", "heads": cfg.heads, "head_dim": cfg.head_dim, "dtype": cfg.dtype,
              "gpu_bytes": gpu_bytes, "budget_s": cfg.longest_budget_s, "attempts": []}
    tokens, spent_s, last_s = cfg.longest_start_tokens, 0.0, None
    while True:
        if cfg.longest_max_tokens is not None and tokens > cfg.longest_max_tokens:
            result["stopped"] = f"reached the largest size asked for ({cfg.longest_max_tokens} tokens/GPU)"
            break
        if last_s is not None and spent_s + 4 * last_s > cfg.longest_budget_s:
            result["stopped"] = (f"{tokens} tokens/GPU would take ~{4 * last_s:.3g} s (4x the last step), beyond "
                                 f"the budget of {cfg.longest_budget_s:.3g} s ({spent_s:.3g} s spent)")
            break
        log(f"longest: {tokens} tokens/GPU, {world_size * tokens} in all")
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        # the inputs first: a rank short of memory for them stops every rank before the ring starts
        inputs, out_of_memory_ranks = together(device, random_inputs, tokens, tokens, cfg.heads, cfg.heads,
                                               cfg.head_dim, DTYPES[cfg.dtype], device,
                                               seed=1000 * dist.get_rank() + tokens)
        if not out_of_memory_ranks:
            measured, out_of_memory_ranks = together(device, longest_step, *inputs, device,
                                                     warm_up=not result["attempts"])
        inputs = None
        attempt = {"tokens_per_gpu": tokens, "total_tokens": world_size * tokens, "ok": not out_of_memory_ranks}
        if out_of_memory_ranks:
            attempt["out_of_memory_ranks"] = out_of_memory_ranks
        else:
            seconds, peak = measured
            seconds = agree(seconds, world, device)
            attempt["step_s"] = seconds
            if peak is not None:
                attempt["peak_bytes_per_rank"] = [int(b) for b in gather_floats(peak, world, device)]
                attempt["bytes_per_token"] = max(attempt["peak_bytes_per_rank"]) / tokens
                attempt["projected_max_tokens_per_gpu"] = int(gpu_bytes / attempt["bytes_per_token"])
        result["attempts"].append(attempt)
        record(result)
        if out_of_memory_ranks:
            result["stopped"] = f"out of memory at {tokens} tokens/GPU"
            break
        spent_s += seconds
        last_s = seconds
        tokens *= 2
    fits = [a for a in result["attempts"] if a["ok"]]
    result["longest_tokens_per_gpu"] = fits[-1]["tokens_per_gpu"] if fits else None
    result["longest_total_tokens"] = fits[-1]["total_tokens"] if fits else None
    record(result)
    return result


# ----------------------------------------------------------------------------------------------
# Report


def _gib(b) -> str:
    return f"{b / 2**30:.1f}"


def correctness_table(cases) -> list[str]:
    lines = [("| case | tensor | error vs float64 | bound | torch's own error | max abs diff vs single-GPU flashtile "
              "| ok |"), "| --- | --- | --- | --- | --- | --- | --- |"]
    for case in cases:
        label = f"{case['layout']} {'causal' if case['causal'] else 'non-causal'}, {case['dtype']}, {case['shape']}"
        for row in case["tensors"]:
            torch_error = "–" if row["torch_error"] is None else f"{row['torch_error']:.2e}"
            lines.append(f"| {label} | {row['tensor']} | {row['error']:.2e} | {row['bound']:.2e} | {torch_error} "
                         f"| {row['diff_vs_flashtile']:.2e} | {'yes' if row['ok'] else 'NO'} |")
    return lines


def scaling_table(rows) -> list[str]:
    lines = [("| W | tokens/GPU | total tokens | causal | ring ms | local-blocks ref ms | efficiency (local blocks) "
              "| full-sequence ref ms | efficiency (full sequence) | TFLOP/s per GPU |"),
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        full_ms = "–" if r["full_sequence_ms"] is None else f"{r['full_sequence_ms']:.2f}"
        full_eff = "–" if r["efficiency_full"] is None else f"{r['efficiency_full']:.1%}"
        lines.append(f"| {r['world_size']} | {r['tokens_per_gpu']} | {r['total_tokens']} "
                     f"| {'zigzag' if r['causal'] else 'no'} | {r['ring_ms']:.2f} | {r['local_work_ms']:.2f} "
                     f"| {r['efficiency_local']:.1%} | {full_ms} | {full_eff} | {r['tflops_per_gpu']:.3g} |")
    return lines


def longest_table(result) -> list[str]:
    lines = [("| tokens/GPU | total tokens | trains | step s | peak GiB per GPU (max; all ranks) | bytes/token "
              "| projected max tokens/GPU |"), "| --- | --- | --- | --- | --- | --- | --- |"]
    for a in result["attempts"]:
        if not a["ok"]:
            lines.append(f"| {a['tokens_per_gpu']} | {a['total_tokens']} | out of memory "
                         f"(ranks {a['out_of_memory_ranks']}) | – | – | – | – |")
            continue
        peaks = a.get("peak_bytes_per_rank")
        peak_cell = "–" if peaks is None else f"{_gib(max(peaks))}; {', '.join(_gib(b) for b in peaks)}"
        per_token = "–" if peaks is None else f"{a['bytes_per_token']:.0f}"
        projected = "–" if peaks is None else str(a["projected_max_tokens_per_gpu"])
        lines.append(f"| {a['tokens_per_gpu']} | {a['total_tokens']} | yes | {a['step_s']:.2f} | {peak_cell} "
                     f"| {per_token} | {projected} |")
    lines += ["", (f"Stopped: {result.get('stopped', 'not finished')}. Longest that trained: "
                   f"{result.get('longest_tokens_per_gpu')} tokens/GPU, {result.get('longest_total_tokens')} in all.")]
    return lines


def markdown(results: dict, cfg: Config) -> str:
    env = results["environment"]
    lines = [f"# Ring attention on {env['world_size']} {env['device_name']} ({env['backend']})", "",
             (f"{env['date']} · torch {env['torch']} · triton {env['triton']} · NCCL {env['nccl']} · "
              f"multicast off: {env['multicast_env']}{' · SMOKE (numbers mean nothing)' if env['smoke'] else ''}")]
    if "correctness" in results:
        lines += ["", ("## Correctness: gathered ring results vs float64 standard attention (flash-attn's rule) "
                   "and vs single-GPU flashtile"), "", *correctness_table(results["correctness"])]
    if "scaling" in results:
        lines += ["", (f"## Scaling: forward+backward per step, batch 1, {cfg.heads} heads MHA, head dim "
                   f"{cfg.head_dim}, {cfg.dtype}"), "",
                  ("Efficiency (local blocks) = single-GPU time of one rank's attention blocks / ring time; "
                   "(full sequence) = single-GPU time of the whole sequence / (W × ring time); "
                   "definitions in benchmarks/ring_multigpu.py. Target: ≥ 90% at 32k tokens/GPU."), "",
                  *scaling_table(results["scaling"])]
    if "longest" in results:
        lines += ["", (f"## Longest sequence: zigzag causal forward+backward, {cfg.heads} heads, head dim "
                   f"{cfg.head_dim}, {cfg.dtype}"), "", *longest_table(results["longest"])]
    return "\n".join(lines) + "\n"


def environment(device, smoke: bool) -> dict:
    nccl = torch.cuda.nccl.version() if device.type == "cuda" else None
    return {
        "date": datetime.date.today().isoformat(),
        "world_size": dist.get_world_size(),
        "backend": dist.get_backend(),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU",
        "torch": torch.__version__, "triton": triton.__version__,
        "nccl": ".".join(map(str, nccl)) if isinstance(nccl, tuple) else nccl,
        "multicast_env": " ".join(f"{name}={os.environ[name]}" for name in MULTICAST_OFF),
        "smoke": smoke,
    }


# ----------------------------------------------------------------------------------------------


def parse_list(text: str, cast=str) -> list:
    return [cast(item) for item in text.split(",") if item]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", required=True, type=Path)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes in float32: checks the script, on CPUs too")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    parser.add_argument("--world-sizes", help="scaling's ring sizes, comma-separated (default: 1, 2, 4, ... and W)")
    parser.add_argument("--scaling-tokens", help="scaling's tokens per GPU, comma-separated")
    parser.add_argument("--full-reference-max-tokens", type=int,
                        help="time the whole sequence on one GPU up to this many tokens")
    parser.add_argument("--longest-budget-s", type=float, help="time for the longest-sequence search")
    args = parser.parse_args()

    wrong = {name: os.environ[name] for name, value in MULTICAST_OFF.items() if os.environ[name] != value}
    if wrong:
        raise SystemExit(f"NVLink multicast must stay off; unset or fix {wrong}")
    parts = parse_list(args.parts)
    if unknown := set(parts) - set(PARTS):
        raise SystemExit(f"--parts: unknown {sorted(unknown)}; choose from {PARTS}")
    cfg = SMOKE if args.smoke else FULL
    overrides = {
        "scaling_tokens": tuple(parse_list(args.scaling_tokens, int)) if args.scaling_tokens else None,
        "full_reference_max_tokens": args.full_reference_max_tokens,
        "longest_budget_s": args.longest_budget_s,
    }
    cfg = dataclasses.replace(cfg, **{name: value for name, value in overrides.items() if value is not None})

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if torch.cuda.is_available():
        if torch.cuda.device_count() < local_world_size:
            raise SystemExit(f"{local_world_size} processes per node but {torch.cuda.device_count()} GPUs: "
                             "one GPU per process")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)  # NCCL's point-to-point messages need it
    elif not args.smoke:
        raise SystemExit("without CUDA only --smoke runs (gloo on the CPU)")
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=GROUP_TIMEOUT)
    world_size = dist.get_world_size()
    world_sizes = parse_list(args.world_sizes, int) if args.world_sizes else default_world_sizes(world_size)
    if any(not 1 <= w <= world_size for w in world_sizes):
        raise SystemExit(f"--world-sizes must lie in 1..{world_size}, got {world_sizes}")

    rank = dist.get_rank()
    results = {"environment": environment(device, args.smoke), "config": dataclasses.asdict(cfg)}
    stem = args.out_dir / f"ring_multigpu_w{world_size}"

    def store(part: str, value) -> None:
        """Rank 0: record a part's results (also partial ones) and rewrite both files."""
        if rank != 0:
            return
        results[part] = value
        args.out_dir.mkdir(parents=True, exist_ok=True)
        stem.with_suffix(".json").write_text(json.dumps(results, indent=1))
        stem.with_suffix(".md").write_text(markdown(results, cfg))

    try:
        if "correctness" in parts:
            store("correctness", correctness(cfg, device))
        if "scaling" in parts:
            scaling(cfg, device, world_sizes, functools.partial(store, "scaling"))
        if "longest" in parts:
            longest(cfg, device, functools.partial(store, "longest"))
    finally:
        dist.destroy_process_group()
    if rank != 0:
        return
    print(markdown(results, cfg))
    print(f"results in {stem}.json and {stem}.md", file=sys.stderr)
    failed = [f"{c['layout']} causal={c['causal']}" for c in results.get("correctness", []) if not c["ok"]]
    if failed:
        raise SystemExit(f"ring attention differs from attention on the gathered sequence: {failed}")


if __name__ == "__main__":
    main()
