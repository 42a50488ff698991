"""One training step (forward + backward) of small Llama-style models, with the attention chosen per run.

    PYTHONPATH=src python benchmarks/training_step.py [--providers flashtile,flashtile_det,sdpa_cudnn,sdpa_flash]
        [--configs llama8b-2l,d1024-4l,d2048-32k] [--rep 200] [--out FILE.json]

Each model is ``layers`` pre-norm blocks (RMSNorm, attention with GQA and rotary-free projections,
RMSNorm, a SwiGLU MLP of width 8/3·dim) in bf16, with random weights and inputs; a step is the
forward, a mean-square loss and ``backward()``, gradients set to None between steps. Every
provider runs the same weights and inputs in the same process, so the ratios hold for the same
machine state; the time is ``triton.testing.do_bench``'s median with the p20–p80 spread. The
configurations are those of issue 19 (flashtile's tracker): two Llama-8B-shaped layers at seqlen
4096, four dim-1024 layers at 2048, one dim-2048 layer at 32768.
"""

from __future__ import annotations

import argparse
import json
import math
import platform

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

import flashtile

CONFIGS = {  # name: (layers, dim, heads, kv heads, head dim, seqlen, batch)
    "llama8b-2l": (2, 4096, 32, 8, 128, 4096, 2),
    "d1024-4l": (4, 1024, 16, 16, 64, 2048, 8),
    "d2048-32k": (1, 2048, 16, 16, 128, 32768, 1),
}


def _attention(provider: str):
    """(q, k, v) in (batch, seqlen, heads, head dim) → causal attention output, same layout."""
    if provider in ("flashtile", "flashtile_det"):
        deterministic = provider == "flashtile_det"
        return lambda q, k, v: flashtile.flash_attn_func(q, k, v, causal=True, deterministic=deterministic)
    backend = {"sdpa_cudnn": SDPBackend.CUDNN_ATTENTION, "sdpa_flash": SDPBackend.FLASH_ATTENTION}[provider]

    def sdpa(q, k, v):
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if k.shape[1] != q.shape[1]:  # the flash backend has no GQA: repeat the KV heads
            k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)

    return sdpa


class Block(torch.nn.Module):
    def __init__(self, dim, heads, kv_heads, head_dim):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.norm1, self.norm2 = torch.nn.RMSNorm(dim), torch.nn.RMSNorm(dim)
        self.qkv = torch.nn.Linear(dim, (heads + 2 * kv_heads) * head_dim, bias=False)
        self.proj = torch.nn.Linear(heads * head_dim, dim, bias=False)
        hidden = 256 * math.ceil(8 * dim / 3 / 256)
        self.up = torch.nn.Linear(dim, 2 * hidden, bias=False)
        self.down = torch.nn.Linear(hidden, dim, bias=False)

    def forward(self, x, attend):
        batch, seqlen, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(
            [self.heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim], dim=-1)
        q = q.view(batch, seqlen, self.heads, self.head_dim)
        k = k.view(batch, seqlen, self.kv_heads, self.head_dim)
        v = v.view(batch, seqlen, self.kv_heads, self.head_dim)
        x = x + self.proj(attend(q, k, v).reshape(batch, seqlen, -1))
        gate, up = self.up(self.norm2(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


def step_ms(config, providers, rep: int) -> dict:
    layers, dim, heads, kv_heads, head_dim, seqlen, batch = config
    torch.manual_seed(0)
    model = torch.nn.ModuleList(Block(dim, heads, kv_heads, head_dim) for _ in range(layers)).cuda().bfloat16()
    x = torch.randn(batch, seqlen, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    results = {}
    for provider in providers:
        attend = _attention(provider)

        def step():
            for p in model.parameters():
                p.grad = None
            h = x
            for block in model:
                h = block(h, attend)
            h.float().square().mean().backward()

        times = do_bench(step, warmup=50, rep=rep, quantiles=[0.5, 0.2, 0.8])
        results[provider] = dict(median_ms=times[0], p20_ms=times[1], p80_ms=times[2])
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--providers", default="flashtile,flashtile_det,sdpa_cudnn,sdpa_flash")
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--rep", type=int, default=200, help="timed milliseconds per measurement")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()
    providers = args.providers.split(",")
    record = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                  python=platform.python_version(), results={})
    print(f"training step (fwd + bwd), bf16, causal, on {record['device']}: torch {record['torch']}, "
          f"triton {record['triton']}; do_bench median ms (p20-p80), ratio to the first provider")
    for name in args.configs.split(","):
        results = step_ms(CONFIGS[name], providers, args.rep)
        record["results"][name] = results
        first = results[providers[0]]["median_ms"]
        print(f"{name:12s} " + "  ".join(
            f"{p} {r['median_ms']:.2f} ({r['p20_ms']:.2f}-{r['p80_ms']:.2f}) {r['median_ms'] / first:.2f}x"
            for p, r in results.items()), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
