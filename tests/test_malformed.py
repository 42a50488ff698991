"""Malformed index inputs: a clear error where checking is free, memory safety everywhere.

The public functions refuse a malformed ``cu_seqlens`` (or a ``max_seqlen`` below the longest
sequence) with a ValueError naming it whenever its values are on the host: CPU tensors, or any
tensor with ``FLASHTILE_CHECK_INPUTS=1``. Below the validation, every path makes the bounds
non-decreasing and clamps them into the token axes (``reference.packed_rows`` states the rule), so
no value reaches outside the tensors, sequences never overlap, and tokens outside every sequence get
output 0, log-sum-exp −inf and zero gradients, on the kernels and the CPU path alike. Those kernel-level cases run in a subprocess, so that a crash
(what the interpreter did before: heap corruption) fails the test instead of killing pytest.
"""

import json
import os
import subprocess
import sys

import pytest
import torch
from helpers import DEVICE

import flashtile

TOKENS = 10


def _packed(seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(TOKENS, 1, 16, generator=g).to(DEVICE, torch.float16) for _ in range(3))
    return q, k, v


def _cu(values):
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


@pytest.mark.parametrize(
    "values, max_seqlen, message",
    [
        ([0, 3, 3, 14], 11, r"cu_seqlens_q ends at 14, past the 10 tokens of q"),
        ([-3, 3, 3, 10], 7, r"cu_seqlens_q must start at 0"),
        ([0, 5, 3, 10], 7, r"cu_seqlens_q must be non-decreasing"),
        ([2, 3, 3, 10], 7, r"cu_seqlens_q must start at 0"),
        ([0, 8, 10], 4, r"max_seqlen_q=4 is less than the longest sequence of cu_seqlens_q \(8\)"),
    ],
    ids=["past-the-end", "negative", "decreasing", "first-not-0", "max-seqlen-short"],
)
def test_malformed_cu_seqlens_raise_where_checking_is_free(values, max_seqlen, message, monkeypatch):
    if DEVICE == "cuda":
        monkeypatch.setenv("FLASHTILE_CHECK_INPUTS", "1")  # device tensors: the opt-in check
    q, k, v = _packed()
    with pytest.raises(ValueError, match=message):
        flashtile.flash_attn_varlen_func(q, k, v, _cu(values), _cu(values), max_seqlen, max_seqlen)


def test_device_index_tensors_are_not_read_unless_asked(monkeypatch):
    # on a GPU, reading cu_seqlens would cost a host sync per call: only FLASHTILE_CHECK_INPUTS=1 does
    if DEVICE != "cuda":
        pytest.skip("CPU tensors are always checked")
    q, k, v = _packed()
    flashtile.flash_attn_varlen_func(q, k, v, _cu([0, 3, 3, 14]), _cu([0, 3, 3, 14]), 11, 11)  # no error


def test_tokens_outside_every_sequence_give_zero_and_neg_inf(backend):
    # cu_seqlens ending before the last token: rows 8 and 9 belong to no sequence
    q, k, v = (t.requires_grad_() for t in _packed(1))
    cu = _cu([0, 3, 3, 8])
    out, lse, _ = flashtile.flash_attn_varlen_func(q, k, v, cu, cu, 5, 5, causal=True, return_attn_probs=True)
    assert (out[8:] == 0).all() and torch.isneginf(lse[:, 8:]).all() and torch.isfinite(out).all()
    grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    assert all((g[8:] == 0).all() and torch.isfinite(g).all() for g in grads)


# Each case calls the operator itself, below the validation: (cu_seqlens, max_seqlen, whether the
# kernels' result must be the CPU path's). Bounds are made non-decreasing and clamped on every path
# (reference.packed_rows), so sequences never overlap; only a max_seqlen below the longest sequence
# leaves rows that the kernels' grid does not cover (0, LSE −inf) where the CPU path computes them.
KERNEL_CASES = {
    "past-the-end": ([0, 3, 3, 14], 11, True),
    "negative": ([-3, 3, 3, 10], 7, True),
    "first-not-0": ([2, 3, 3, 10], 7, True),
    "ends-early": ([0, 3, 3, 8], 5, True),
    "no-sequences": ([0], 0, True),
    "huge": ([0, 2**30, -2**30, 2**31 - 1], 8, True),
    "decreasing": ([0, 5, 3, 10], 7, True),  # [0, 5, 5, 10]
    "inside-an-earlier-one": ([0, 8, 3, 4, 10], 8, True),  # [0, 8, 8, 8, 10]
    "max-seqlen-short": ([0, 8, 10], 4, False),  # rows past max_seqlen are not computed by the kernels
}

_SNIPPET = """
import json, os, sys, torch
import flashtile
from flashtile._options import AttentionOptions, AttentionTensors
values, max_seqlen, device = json.loads(sys.argv[1])
g = torch.Generator().manual_seed(0)
q, k, v, do = (torch.randn(10, 1, 16, generator=g).to(device, torch.float16) for _ in range(4))
cu = torch.tensor(values, dtype=torch.int32, device=device)
call = (*AttentionTensors(cu_seqlens_q=cu, cu_seqlens_k=cu), *AttentionOptions(0.25, 7, 0, max_seqlen_q=max_seqlen,
        max_seqlen_k=max_seqlen))
def healthy():  # a kernel fault surfaces at the sync or leaves the context unable to run a new kernel
    if device != "cuda":
        return True
    torch.cuda.synchronize()
    return int(torch.arange(4, device=device).sum()) == 6
results = {}
for path in ("kernels", "cpu"):
    os.environ["TRITON_INTERPRET"] = "1" if path == "kernels" and device == "cpu" else "0"
    tensors = [t.cpu() if path == "cpu" else t for t in (q, k, v, do)]
    cu_path = cu.cpu() if path == "cpu" else cu
    options = call[len(AttentionTensors._fields):]
    call_path = (*AttentionTensors(cu_seqlens_q=cu_path, cu_seqlens_k=cu_path), *options)
    out, lse = torch.ops.flashtile.fwd(*tensors[:3], *call_path)
    grads = [torch.empty_like(t) for t in tensors[:3]]
    torch.ops.flashtile.bwd(tensors[3], *tensors[:3], out, lse, *grads, False, *call_path)
    results[path] = [t.cpu().double() for t in (out, lse, *grads)]
finite = all(torch.isfinite(t).all() for t in results["kernels"][:1] + results["kernels"][2:])
lse_ok = not torch.isnan(results["kernels"][1]).any()
same = all(torch.allclose(a, b, atol=1e-2, equal_nan=True) for a, b in zip(results["kernels"], results["cpu"]))
print(json.dumps(dict(finite=bool(finite and lse_ok), same=bool(same), healthy=healthy())))
"""


@pytest.mark.parametrize("case", KERNEL_CASES)
def test_kernels_stay_inside_their_tensors(case):
    values, max_seqlen, agree = KERNEL_CASES[case]
    env = dict(os.environ, TRITON_INTERPRET="1" if DEVICE == "cpu" else "0")
    result = subprocess.run([sys.executable, "-c", _SNIPPET, json.dumps([values, max_seqlen, DEVICE])],
                            capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, f"the process died ({result.returncode}): {result.stderr[-2000:]}"
    verdict = json.loads(result.stdout.strip().splitlines()[-1])
    assert verdict["healthy"], "the CUDA context cannot run a kernel after the call"
    assert verdict["finite"], "NaN or uninitialised values in the kernels' result"
    if agree:
        assert verdict["same"], "the kernels and the CPU path disagree"


# ----------------------------------------------------------------------------------------------
# KV cache: cache_seqlens, cache_batch_idx, block_table


def _cache(paged: bool, seed=2):
    """q (2, 1, 2, 16), new k/v (2, 2, 1, 16), caches of capacity 16: 2 rows, or 4 pages of 8."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(DEVICE, torch.float16)

    shape = (4, 8, 1, 16) if paged else (2, 16, 1, 16)
    return rand(2, 1, 2, 16), rand(2, 2, 1, 16), rand(2, 2, 1, 16), rand(*shape), rand(*shape)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(cache_seqlens=[-2, 3]), r"cache_seqlens\[0\]=-2 \(\+ 2 new\) does not fit a cache of 16 positions"),
        (dict(cache_seqlens=[3, 15]), r"cache_seqlens\[1\]=15 \(\+ 2 new\) does not fit"),
        (dict(cache_batch_idx=[0, 2]), r"cache_batch_idx\[1\]=2 is not a row of the cache \(0..1\)"),
        (dict(block_table=[[0, 1], [2, -1]], cache_seqlens=[3, 9]), r"block_table\[1, 1\]=-1 is not a page"),
        (dict(block_table=[[0, 10**6], [2, 3]], cache_seqlens=[9, 3]), r"block_table\[0, 1\]=1000000 is not a page"),
        (dict(cache_leftpad=[0, -1]), r"cache_leftpad\[1\]=-1 must be in 0..5 \(cache_seqlens\[1\]\)"),
        (dict(cache_leftpad=[4, 0]), r"cache_leftpad\[0\]=4 must be in 0..3 \(cache_seqlens\[0\]\)"),
    ],
    ids=["seqlens-negative", "seqlens-past-capacity", "batch-idx", "page-negative", "page-huge", "leftpad-negative",
         "leftpad-past-seqlens"],
)
def test_malformed_cache_indices_raise_where_checking_is_free(change, message, monkeypatch):
    if DEVICE == "cuda":
        monkeypatch.setenv("FLASHTILE_CHECK_INPUTS", "1")
    q, k, v, k_cache, v_cache = _cache(paged="block_table" in change)
    indices = {name: _cu(value) for name, value in change.items()}
    indices.setdefault("cache_seqlens", _cu([3, 5]))
    with pytest.raises(ValueError, match=message):
        flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, **indices)


def test_unused_block_table_entries_are_not_checked():
    # serving engines pad block tables: entries past a sequence's pages may hold anything
    q, k, v, k_cache, v_cache = _cache(paged=True)
    table = _cu([[0, -1], [2, 10**6]])
    flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=_cu([3, 5]), block_table=table)


def test_pages_without_a_slot_are_refused():
    # the kernels find a key's page by dividing by the page size: a (num_pages, 0, ...) cache must not reach them
    q, k, v, _, _ = _cache(paged=True)
    no_slots = torch.empty(4, 0, 1, 16, dtype=q.dtype, device=DEVICE)
    with pytest.raises(ValueError, match=r"pages of at least one slot, got k_cache \(4, 0, 1, 16\)"):
        flashtile.flash_attn_with_kvcache(q, no_slots, no_slots, block_table=_cu([[0], [1]]), cache_seqlens=_cu([0, 0]))
    cu = _cu([0, 1, 2])
    with pytest.raises(ValueError, match="pages of at least one slot"):
        flashtile.flash_attn_varlen_func(q[:, 0], no_slots, no_slots, cu, None, 1, 0, block_table=_cu([[0], [1]]),
                                         seqused_k=_cu([0, 0]))


# (cache_seqlens, cache_batch_idx, block_table): index values the kernels meet unchecked
CACHE_CASES = {
    "seqlens-negative": ([-2, 3], None, None),
    "seqlens-past-capacity": ([15, 40], None, None),
    "batch-idx-outside": ([3, 5], [1, 7], None),
    "batch-idx-negative": ([3, 5], [-1, 0], None),
    "page-negative": ([3, 9], None, [[0, 1], [2, -1]]),
    "page-huge": ([9, 3], None, [[0, 10**6], [2, 3]]),
}

_CACHE_SNIPPET = """
import json, os, sys, torch
from flashtile import ops
from flashtile._options import AttentionOptions
seqlens, batch_idx, table, device = json.loads(sys.argv[1])
g = torch.Generator().manual_seed(0)
paged = table is not None
shape = (4, 8, 1, 16) if paged else (2, 16, 1, 16)
q, k, v = (torch.randn(*s, generator=g).to(device, torch.float16) for s in ((2, 1, 2, 16), (2, 2, 1, 16), (2, 2, 1, 16)))
cache = torch.randn(*shape, generator=g).to(device, torch.float16)
as_int = lambda x: None if x is None else torch.tensor(x, dtype=torch.int32, device=device)
def healthy():  # a kernel fault surfaces at the sync or leaves the context unable to run a new kernel
    if device != "cuda":
        return True
    torch.cuda.synchronize()
    return int(torch.arange(4, device=device).sum()) == 6
results = {}
for path in ("kernels", "cpu"):
    os.environ["TRITON_INTERPRET"] = "1" if path == "kernels" and device == "cpu" else "0"
    on = (lambda t: t.cpu()) if path == "cpu" else (lambda t: t)
    k_cache, v_cache = on(cache).clone(), on(cache).clone() * 2
    cache_seqlens, idx, block_table = (None if t is None else on(t) for t in map(as_int, (seqlens, batch_idx, table)))
    ops.kvcache_append(k_cache, v_cache, on(k), on(v), cache_seqlens, idx, block_table)
    out, lse = ops.kvcache_attention(on(q), k_cache, v_cache, cache_seqlens + 2, idx, block_table,
                                     AttentionOptions(0.25, window_right=0), None, 2)
    results[path] = [t.cpu().double() for t in (out, lse, k_cache, v_cache)]
finite = bool(torch.isfinite(results["kernels"][0]).all() and not torch.isnan(results["kernels"][1]).any())
same = all(torch.allclose(a, b, atol=1e-2, equal_nan=True) for a, b in zip(results["kernels"], results["cpu"]))
print(json.dumps(dict(finite=finite, same=bool(same), healthy=healthy())))
"""


@pytest.mark.parametrize("case", CACHE_CASES)
def test_cache_kernels_stay_inside_their_tensors(case):
    # the append drops writes outside the cache, the attention reads no key outside it, and both
    # paths follow the same rule: the caches after the append and the outputs agree
    seqlens, batch_idx, table = CACHE_CASES[case]
    env = dict(os.environ, TRITON_INTERPRET="1" if DEVICE == "cpu" else "0")
    result = subprocess.run([sys.executable, "-c", _CACHE_SNIPPET, json.dumps([seqlens, batch_idx, table, DEVICE])],
                            capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, f"the process died ({result.returncode}): {result.stderr[-2000:]}"
    verdict = json.loads(result.stdout.strip().splitlines()[-1])
    assert verdict["healthy"], "the CUDA context cannot run a kernel after the call"
    assert verdict["finite"], "NaN or uninitialised values in the kernels' result"
    assert verdict["same"], "the kernels and the CPU path disagree"
