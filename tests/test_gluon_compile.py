"""The Gluon kernels for sm_90 compiled on any machine, GPU or not, and their machine code checked.

Gluon has no interpreter, so tests/test_hopper.py runs them on an sm_90 GPU only. But Triton's
wheel carries ptxas, and compiling for sm_90a needs no GPU: here each kernel is compiled as the
launcher would compile it (a stand-in driver names the target), and ptxas's report is read for what
made the fused backward slow while it was written: wgmma instructions serialized for want of
registers (every matmul then waits for the previous one), and shared memory beyond the 227 KiB a
block may have. The spills are printed, not judged (a few at head dim 128 cost little).

Two Triton kernels are compiled the same way for what their speed hangs on: over a paged cache (the forward
kernel's paged prefill, the KV-cache kernel's paged decoding), Triton's software pipeliner made the block
table's loads asynchronous copies in three of their versions, and the loop then waited for every copy in
flight each block (0.34× the contiguous forward on an H100, benchmarks/NOTES.md): their TTGIR must copy no
page id asynchronously.
"""

import json
import os
import subprocess
import sys

import pytest
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas

from flashtile import gluon

pytestmark = pytest.mark.skipif(not gluon.written_for(), reason="the Gluon kernels are written for another Triton")

# (kernel, page size, mask): the paged calls whose page-id loads are checked
PAGED_CASES = (("prefill", 16, "causal"), ("prefill", 64, "causal"), ("prefill", 16, "full"), ("decode", 16, "full"),
               ("decode", 64, "full"))
SM90_MAX_SHARED = 227 * 1024  # bytes of dynamic shared memory a block may use on the H100/H200
CASES = [f"{kernel}-d{head_dim}-{mask}" for kernel in ("bwd", "fwd") for head_dim in (64, 128)
         for mask in ("full", "causal")] + ["fwd_sink-d64-causal", "fwd_sink-d128-causal", "fwd_persistent-d64-full",
                                            "fwd_persistent-d128-full", "fwd_persistent-d64-causal",
                                            "fwd_persistent-d128-causal", "bwd_preprocess-d64-full",
                                            "bwd_preprocess-d128-full", "fwd-d256-full", "fwd-d256-causal",
                                            "fwd_sink-d256-causal", "bwd-d192-full", "bwd-d256-full",
                                            "bwd-d256-causal", "bwd_preprocess-d192-full", "bwd_preprocess-d256-full"]
# the forward at 192 runs the d256 kernel (tile_head_dim); the backward's wide schedule at 192 is the 256 one
# with the real head dim masking dK and dV, compiled here too


class _Sm90Target:
    """The part of Triton's driver interface that compiling (``JITFunction.warmup``) asks for."""

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")

    def is_active(self):
        return True


def _ptxas_report(kernel, path) -> str:
    with open(path, "w") as f:
        f.write(kernel.asm["ptx"])
    result = subprocess.run([get_ptxas(90).path, "-arch=sm_90a", "-v", path, "-o", os.devnull],
                            capture_output=True, text=True, check=True)
    return result.stdout + result.stderr


def _compile(case: str):
    """One case of CASES, compiled for sm_90a as the launchers would launch it."""
    from flashtile.gluon import sm90_bwd, sm90_fwd

    kernel, head_dim, mask = case.rsplit("-", 2)
    head_dim, causal = int(head_dim[1:]), mask == "causal"
    # CPU tensors stand in for the GPU's: compiling reads only dtypes, shapes, strides and alignment
    q = torch.empty(2, 1024, 4, head_dim, dtype=torch.bfloat16)
    stats = torch.empty(2, 4, 1024)
    accum = torch.empty(2, 1024, 4, head_dim)
    descriptor = sm90_fwd.descriptor
    if kernel in ("fwd", "fwd_sink", "fwd_persistent"):
        width, block_n = sm90_fwd.tile_head_dim(head_dim), sm90_fwd.keys_per_block(head_dim)
        return sm90_fwd._attn_fwd_sm90_kernel.warmup(
            q_desc=descriptor(q, sm90_fwd.ROWS, width), k_desc=descriptor(q, block_n, width),
            v_desc=descriptor(q, block_n, width), o_desc=descriptor(q, sm90_fwd.ROWS, width), Lse=stats,
            stride_lb=stats.stride(0), stride_lh=stats.stride(1), Sinks=torch.empty(4), batch=2, nheads_q=4, group_size=1,
            seqlen_q=1000, seqlen_k=1000, qk_scale=0.1, CAUSAL=causal,
            NUM_CONSUMERS=sm90_fwd.consumers(head_dim, kernel == "fwd_persistent"),
            ROWS=sm90_fwd.ROWS, BLOCK_N=block_n, HEAD_DIM=width, NUM_STAGES=sm90_fwd.NUM_STAGES,
            HAS_SINK=kernel == "fwd_sink", PERSISTENT=kernel == "fwd_persistent", num_warps=4, grid=(1, ),
        )
    width = sm90_fwd.tile_head_dim(head_dim)
    if width > 128:  # the wide schedule's accumulator: a head's rows of 256 floats follow each other
        accum = torch.empty(2, 4, 1024, width).transpose(1, 2)
    if kernel == "bwd_preprocess":
        return sm90_bwd._bwd_preprocess_kernel.warmup(
            o_desc=descriptor(q, sm90_bwd.BLOCK_M, width), do_desc=descriptor(q, sm90_bwd.BLOCK_M, width), Lse=stats,
            Lse2=stats, Delta=stats, DQAccum=accum, stride_lb=stats.stride(0), stride_lh=stats.stride(1),
            stride_pb=stats.stride(0), stride_ph=stats.stride(1), stride_ab=accum.stride(0), stride_as=accum.stride(1),
            stride_ah=accum.stride(2),
            seqlen_q=1000, ROWS=sm90_bwd.BLOCK_M, HEAD_DIM=width, num_warps=4, grid=(1, ),
        )
    if width > 128:
        half, block_n = sm90_bwd.WIDE_HALF, sm90_bwd.WIDE_BLOCK_N
        return sm90_bwd._attn_bwd_sm90_wide_kernel.warmup(
            q_desc=descriptor(q, sm90_bwd.BLOCK_M, half), k_desc=descriptor(q, block_n, half),
            v_desc=descriptor(q, block_n, half), do_desc=descriptor(q, sm90_bwd.BLOCK_M, half),
            lse_desc=sm90_bwd._stats_descriptor(stats), delta_desc=sm90_bwd._stats_descriptor(stats), DK=q, DV=q,
            DQAccum=accum, stride_dkb=q.stride(0), stride_dks=q.stride(1), stride_dkh=q.stride(2),
            stride_dvb=q.stride(0), stride_dvs=q.stride(1), stride_dvh=q.stride(2), stride_ab=accum.stride(0),
            stride_ah=accum.stride(2), group_size=1, seqlen_q=1000, seqlen_k=1000, qk_scale=0.1, sm_scale=0.07,
            CAUSAL=causal, BLOCK_M=sm90_bwd.BLOCK_M, BLOCK_N=block_n, KEYS=sm90_bwd.WIDE_KEYS, HALF=half,
            HEAD_DIM=head_dim, NUM_STAGES=sm90_bwd.NUM_STAGES, num_warps=4, grid=(1, ),
        )
    return sm90_bwd._attn_bwd_sm90_kernel.warmup(
        q_desc=descriptor(q, sm90_bwd.BLOCK_M), k_desc=descriptor(q, sm90_bwd.BLOCK_N),
        v_desc=descriptor(q, sm90_bwd.BLOCK_N), do_desc=descriptor(q, sm90_bwd.BLOCK_M),
        lse_desc=sm90_bwd._stats_descriptor(stats), delta_desc=sm90_bwd._stats_descriptor(stats),
        dq_desc=sm90_bwd._accumulator_descriptor(accum), DK=q, DV=q, DQAccum=accum, stride_dkb=q.stride(0),
        stride_dks=q.stride(1), stride_dkh=q.stride(2), stride_dvb=q.stride(0), stride_dvs=q.stride(1),
        stride_dvh=q.stride(2), stride_ab=accum.stride(0), stride_as=accum.stride(1), stride_ah=accum.stride(2),
        group_size=1, seqlen_q=1000, seqlen_k=1000,
        qk_scale=0.1, sm_scale=0.07, CAUSAL=causal, BLOCK_M=sm90_bwd.BLOCK_M, BLOCK_N=sm90_bwd.BLOCK_N,
        KEYS=sm90_bwd.KEYS, HEAD_DIM=head_dim, NUM_STAGES=sm90_bwd.NUM_STAGES, DQ_BY_TMA=sm90_bwd.DQ_BY_TMA[head_dim],
        num_warps=4, grid=(1, ),
    )


def _paged_ttgir(kernel: str, page_size: int, causal: bool) -> str:
    """The TTGIR of a paged call over pages of ``page_size`` (32:8 heads, head dim 128), compiled through its
    launcher: "prefill", 8 sequences of 1024 queries against 4096 cached keys (the forward kernel), or
    "decode", one query for each of 16 sequences of 8192 cached keys (the KV-cache kernel)."""
    from flashtile._options import AttentionOptions
    from flashtile.triton import launch, plans

    compiled = []

    def compile_instead(plan, kernel, grid, **arguments):  # plans.launch, compiling instead of recording
        options = {name: arguments.pop(name) for name in ("num_warps", "num_stages") if name in arguments}
        compiled.append(kernel.warmup(*[arguments[name] for name in kernel.arg_names], grid=grid, **options))

    plans.launch = compile_instead  # this process compiles only
    options = AttentionOptions(0.1, window_right=0 if causal else -1)
    if kernel == "prefill":
        batch, keys, expected = 8, 4096, "attn_fwd_kernel"
        packed = dict(cu_seqlens_q=torch.arange(0, batch + 1, dtype=torch.int32) * 1024, max_seqlen_q=1024)
        q = torch.empty(batch * 1024, 32, 128, dtype=torch.bfloat16)
    else:
        batch, keys, expected, packed = 16, 8192, "kvcache_attn_fwd_kernel", dict(num_splits=2)
        q = torch.empty(batch, 1, 32, 128, dtype=torch.bfloat16)
    cache = torch.empty(batch * keys // page_size, page_size, 8, 128, dtype=torch.bfloat16)
    table = torch.zeros(batch, keys // page_size, dtype=torch.int32)
    launch.kvcache_attention_forward(q, cache, cache, torch.full((batch,), keys, dtype=torch.int32), None, table,
                                     options, **packed)
    assert compiled and compiled[0].name == expected, f"the paged {kernel} no longer runs {expected}"
    return compiled[0].asm["ttgir"]


def compile_all(workdir: str) -> dict:
    """{case: (ptxas's report, shared bytes)}, and under "paged" {paged case: its asynchronous copies of page
    ids}. Runs in a process of its own: under the interpreter, which the test session uses on
    a CPU, Triton's own functions cannot be compiled."""
    triton.runtime.driver.set_active(_Sm90Target())
    results = {}
    for case in CASES:
        kernel = _compile(case)
        results[case] = (_ptxas_report(kernel, os.path.join(workdir, "kernel.ptx")), kernel.metadata.shared)
    results["paged"] = {f"{kernel}-page{page_size}-{mask}": sum(
        "async_copy_global_to_local" in line and "!tt.ptr<i32>" in line
        for line in _paged_ttgir(kernel, page_size, mask == "causal").splitlines())
        for kernel, page_size, mask in PAGED_CASES}
    return results


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    env = dict(os.environ, TRITON_INTERPRET="0")
    result = subprocess.run([sys.executable, __file__, str(tmp_path_factory.mktemp("sm90"))], env=env,
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.splitlines()[-1])


@pytest.mark.parametrize("case", [f"{kernel}-page{page}-{mask}" for kernel, page, mask in PAGED_CASES])
def test_paged_calls_load_page_ids_synchronously(reports, case):
    # 64-key blocks spanning 4 pages (16) and inside one (64): the two ways a block finds its rows by scalar page
    # ids; the forward's 128-key blocks of full attention over pages of 16, narrowed to 4 pages
    # (configs.paged_fwd_config)
    assert reports["paged"][case] == 0, "page ids copied asynchronously: the pipeline waits on each block"


@pytest.mark.parametrize("case", CASES)
def test_compiles_for_sm90_without_serialized_wgmma(reports, case):
    report, shared = reports[case]
    assert "serialized" not in report, report
    assert shared <= SM90_MAX_SHARED, shared
    print(case, " ".join(line.strip() for line in report.splitlines() if "spill" in line or "Used" in line))


if __name__ == "__main__":
    print(json.dumps(compile_all(sys.argv[1])))
