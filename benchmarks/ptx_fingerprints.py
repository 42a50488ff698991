"""Fingerprints of the Triton kernels' sm_90a PTX, compiled on any machine (no GPU needed).

Each kernel is compiled through its launcher as a call would launch it (flashtile.triton.launch with
a stand-in driver that names an sm_90 target; CPU tensors stand in for the GPU's: compiling reads
only dtypes, shapes, strides and alignment). Printed per kernel and per ``WIDE`` (64-bit offsets):
a hash of the PTX without its line information, its line count, and its count of 64-bit multiplies.
Run it on two trees to show that a change leaves a kernel's machine code as it was:

    PYTHONPATH=/path/to/old/src python benchmarks/ptx_fingerprints.py old
    PYTHONPATH=src python benchmarks/ptx_fingerprints.py new --wide --serving

(A kernel whose parameters changed hashes differently even where its code did not: compare the PTX
with the ``.param`` lines dropped and ``param_N`` numbering normalised.)
"""

import argparse
import hashlib
import json
import os
import re

os.environ["TRITON_INTERPRET"] = "0"  # compile, do not interpret

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402


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


def fingerprint(ptx: str) -> dict:
    lines = [line for line in ptx.splitlines()
             if not re.match(r"\s*(\.loc|\.file|//|\$L__|\.section|\.b8|\.b32|\.b64)", line)]
    code = re.sub(r"\$L__\w+", "L", "\n".join(lines))  # debug-section labels
    return dict(ptx=hashlib.sha1(code.encode()).hexdigest()[:12], lines=len(lines),
                mul_64=ptx.count("mul.wide.s32") + ptx.count("mul.lo.s64"))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("label")
    parser.add_argument("--wide", action="store_true", help="also compile calls past 2^31 elements")
    parser.add_argument("--serving", action="store_true",
                        help="also compile the serving variants: packed queries, cache_leftpad, a float8 cache")
    args = parser.parse_args()
    triton.runtime.driver.set_active(_Sm90Target())
    from flashtile._options import AttentionOptions, AttentionTensors
    from flashtile.triton import launch, plans

    results = {}

    def compile_instead(plan, kernel, grid, **arguments):  # plans.launch, compiling instead of recording
        options = {name: arguments.pop(name) for name in ("num_warps", "num_stages") if name in arguments}
        compiled = kernel.warmup(*[arguments[name] for name in kernel.arg_names], grid=grid, **options)
        variant = ",".join(f"{name}={arguments[name]}" for name in ("WIDE", "IS_VARLEN_Q", "HAS_LEFTPAD", "HAS_DESCALE",
                                                                      "IS_PAGED")
                           if name in arguments)
        results[f"{args.label}:{kernel.fn.__name__}:{variant}"] = fingerprint(compiled.asm["ptx"])

    plans.launch = compile_instead
    launch._converts_float8_by_ptx = lambda device: True  # as on the sm_90 target, not the CPU stand-in tensors

    def attention(q, k, v):
        options = AttentionOptions(0.125, window_right=0)
        out, lse = launch.attention_forward(q, k, v, options, AttentionTensors())
        grads = [torch.empty_like(t) for t in (q, k, v)]
        launch.attention_backward(torch.empty_like(out), q, k, v, out, lse, options, AttentionTensors(), *grads)

    def decode(q, cache):
        seqlens = torch.full((q.shape[0],), 1000, dtype=torch.int32)
        launch.kvcache_attention_forward(q, cache, cache, seqlens, None, None, AttentionOptions(0.1), num_splits=2)

    small = torch.empty(2, 1100, 4, 128, dtype=torch.bfloat16)
    attention(small, small, small)
    decode(torch.empty(2, 1, 8, 128, dtype=torch.bfloat16), small)
    if args.wide:  # views whose rows lie 2^21 elements apart: 1100 rows span more than 2^31
        big = torch.empty(2**31 + 2**28, dtype=torch.bfloat16)  # allocated, never touched
        wide = big.as_strided((1, 1100, 4, 128), (2**31, 2**21, 128, 1))
        attention(wide, small[:1], small[:1])
        decode(torch.empty(1, 1, 8, 128, dtype=torch.bfloat16), wide[:, :, :1])
    if args.serving:
        seqlens = torch.full((2,), 1000, dtype=torch.int32)
        launch.kvcache_attention_forward(torch.empty(7, 8, 128, dtype=torch.bfloat16), small, small, seqlens, None,
                                         None, AttentionOptions(0.1), num_splits=2,
                                         cu_seqlens_q=torch.tensor([0, 3, 7], dtype=torch.int32), max_seqlen_q=4,
                                         cache_leftpad=seqlens)
        cache8 = torch.empty(2, 1100, 4, 128, dtype=torch.float8_e4m3fn)
        scales = torch.ones(2, 4)
        launch.kvcache_attention_forward(torch.empty(2, 1, 8, 128, dtype=torch.bfloat16), cache8, cache8, seqlens,
                                         None, None, AttentionOptions(0.1), num_splits=2, k_descale=scales,
                                         v_descale=scales)
        new = torch.empty(2, 1, 4, 128, dtype=torch.bfloat16)
        launch.kvcache_append(cache8, cache8, new, new, seqlens, k_descale=scales, v_descale=scales)
        # a paged prefill (150 queries per sequence): the forward kernel with IS_PAGED
        pages = torch.empty(40, 64, 4, 128, dtype=torch.bfloat16)
        table = torch.zeros(2, 20, dtype=torch.int32)
        launch.kvcache_attention_forward(torch.empty(300, 8, 128, dtype=torch.bfloat16), pages, pages, seqlens, None,
                                         table, AttentionOptions(0.1, window_right=0),
                                         cu_seqlens_q=torch.tensor([0, 150, 300], dtype=torch.int32),
                                         max_seqlen_q=150)
    for key, value in sorted(results.items()):
        print(key, json.dumps(value))


if __name__ == "__main__":
    main()
