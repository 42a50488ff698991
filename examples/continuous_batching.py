"""Continuous batching over a paged KV cache, the way an inference engine drives attention.

Requests arrive over time with prompts of different lengths; every engine step runs one call of
``flash_attn_with_kvcache`` for a mixed batch, packed (``cu_seqlens_q``): requests still in prefill
send a chunk of their prompt (at most ``--chunk`` tokens), the others one decoded token. Each request
owns pages from one shared pool (allocated as its cache grows, freed when it finishes) and appends
its new keys/values in place; its queries attend to its whole cache, causal per request.

The "model" is one attention layer with fixed random projections; a decoded token's embedding is a
function of the previous step's attention output, so every step depends on the cache being right.
When a request finishes, its outputs at every position are checked against eager attention over its
whole token sequence in float64 (``softmax(q kᵀ / √d) v``, causal); the script raises if any differs.

    python examples/continuous_batching.py                 # CPU, float32, a few seconds
    python examples/continuous_batching.py --device cuda   # bfloat16 on the GPU
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field

import torch

import flashtile


@dataclass
class Request:
    rid: int
    prompt: torch.Tensor  # [prompt_len, dim] token embeddings
    max_new: int
    pages: list[int] = field(default_factory=list)
    done_tokens: int = 0  # tokens whose keys/values are in the cache
    inputs: list[torch.Tensor] = field(default_factory=list)  # every token's embedding, in order
    outputs: list[torch.Tensor] = field(default_factory=list)  # every token's attention output

    @property
    def generated(self) -> int:
        return max(0, len(self.inputs) - len(self.prompt))


class PagePool:
    def __init__(self, num_pages: int):
        self.free = list(range(num_pages))[::-1]

    def grow(self, request: Request, length: int, page_size: int) -> None:
        while len(request.pages) * page_size < length:
            if not self.free:
                raise RuntimeError("out of pages: raise --pages")
            request.pages.append(self.free.pop())

    def release(self, request: Request) -> None:
        self.free.extend(request.pages)
        request.pages.clear()


def eager_attention(q, k, v):
    """Causal softmax(q kᵀ / √d) v of one request, float64: q [N, H, D], k, v [N, Hk, D]."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("ihd,jhd->hij", q.double(), k.double()) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("hij,jhd->ihd", scores.softmax(-1), v.double())


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, help="float32 on the CPU, bfloat16 on a GPU by default")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-batch", type=int, default=4, help="requests running at once")
    parser.add_argument("--chunk", type=int, default=32, help="prompt tokens per request per step")
    parser.add_argument("--heads", type=int, nargs=2, default=(4, 2), metavar=("Q", "KV"))
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--pages", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("float32" if device.type == "cpu" else "bfloat16"))
    g = torch.Generator().manual_seed(args.seed)
    (nheads, nheads_k), head_dim = args.heads, args.head_dim
    dim = nheads * head_dim

    def rand(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=g)).to(device, dtype)

    w_q, w_k, w_v = (rand(dim, h * head_dim, scale=dim ** -0.5) for h in (nheads, nheads_k, nheads_k))
    w_next = rand(dim, dim, scale=dim ** -0.5)  # a decoded token's embedding from the last output
    k_cache = torch.zeros(args.pages, args.page_size, nheads_k, head_dim, device=device, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    pool = PagePool(args.pages)

    # arrivals: request i arrives at step 2·i with a prompt of 1..3·chunk tokens and 1..6 tokens to decode
    waiting = [Request(i, rand(int(torch.randint(1, 3 * args.chunk, (1,), generator=g)), dim),
                       int(torch.randint(1, 7, (1,), generator=g))) for i in range(args.requests)]
    arrival = {r.rid: 2 * r.rid for r in waiting}
    running, finished, step, max_error = [], [], 0, 0.0
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    while waiting or running:
        while waiting and len(running) < args.max_batch and arrival[waiting[0].rid] <= step:
            running.append(waiting.pop(0))
        if not running:
            step += 1
            continue
        # this step's new tokens per request: a prompt chunk, or the token decoded from the last output
        new_tokens = []
        for r in running:
            if r.done_tokens < len(r.prompt):
                tokens = r.prompt[r.done_tokens:r.done_tokens + args.chunk]
            else:
                tokens = torch.tanh(r.outputs[-1].reshape(1, dim) @ w_next)
            new_tokens.append(tokens)
            pool.grow(r, r.done_tokens + len(tokens), args.page_size)
        x = torch.cat(new_tokens)  # [total_new, dim]: the packed batch
        q, k, v = ((x @ w).view(len(x), -1, head_dim) for w in (w_q, w_k, w_v))
        lengths = [len(t) for t in new_tokens]
        cu_seqlens_q = torch.tensor([0] + lengths, device=device).cumsum(0).to(torch.int32)
        cache_seqlens = torch.tensor([r.done_tokens for r in running], device=device, dtype=torch.int32)
        max_pages = max(len(r.pages) for r in running)
        block_table = torch.tensor([r.pages + [r.pages[0]] * (max_pages - len(r.pages)) for r in running],
                                   device=device, dtype=torch.int32)  # unused tail entries: any page
        out = flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens,
                                                block_table=block_table, causal=True, cu_seqlens_q=cu_seqlens_q,
                                                max_seqlen_q=max(lengths))  # [total_new, nheads, head_dim]
        for r, tokens, rows in zip(running, new_tokens, out.split(lengths)):
            r.inputs.extend(tokens)
            r.outputs.extend(rows)
            r.done_tokens += len(tokens)
        # finished requests: checked against eager attention over their whole sequence, pages freed
        for r in [r for r in running if r.done_tokens >= len(r.prompt) and r.generated >= r.max_new]:
            x_all = torch.stack(r.inputs)
            q_all, k_all, v_all = ((x_all @ w).view(len(x_all), -1, head_dim) for w in (w_q, w_k, w_v))
            error = (torch.stack(r.outputs).double() - eager_attention(q_all, k_all, v_all)).abs().max().item()
            max_error = max(max_error, error)
            if error > tolerance:
                raise AssertionError(f"request {r.rid}: attention differs from eager by {error:.3e}")
            pool.release(r)
            running.remove(r)
            finished.append(r)
        step += 1
    print(f"{len(finished)} requests, {step} steps, {sum(len(r.inputs) for r in finished)} tokens; "
          f"largest difference from eager attention {max_error:.2e} (tolerance {tolerance:.0e}); "
          f"{len(pool.free)} of {args.pages} pages free at the end")
    return dict(requests=len(finished), steps=step, max_error=max_error, tolerance=tolerance,
                free_pages=len(pool.free))


if __name__ == "__main__":
    main()
