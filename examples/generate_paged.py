"""Streaming generation with a paged KV cache through ``flashtile.decode.flash_attn_with_kvcache``.

A tiny randomly initialised decoder (token and position embeddings; pre-norm blocks of GQA
attention and an MLP) generates greedily for a batch of prompts of different lengths:

* prefill: each prompt alone, its keys/values written into the pages of its sequence
  (causal attention of the prompt over itself, through the same kvcache call);
* decode: one token per sequence per step for the whole batch, the new keys/values
  appended in place, each sequence attending over its own (ragged) length.

The pages of all sequences come from one shuffled pool, as after allocator churn in a
server. At every step the new logits are checked against recomputing each whole
sequence with ``flashtile.attention`` (causal, no cache); tokens/s counts the decode
steps only.

    python examples/generate_paged.py                   # CPU, float32, a few seconds
    python examples/generate_paged.py --device cuda     # float16 on the GPU
"""

from __future__ import annotations

import argparse
import math
import time

import torch
from torch import nn

import flashtile
from flashtile.decode import flash_attn_with_kvcache

# max |logits error| allowed, relative to max(1, max |logit|): attention rounding, nothing more
TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2}


class PagedKVCache:
    """Per layer, K and V page pools (num_pages, page_size, nheads_k, head_dim); per sequence, a block table."""

    def __init__(self, num_layers, batch, max_len, page_size, nheads_k, head_dim, dtype, device, generator):
        pages_per_seq = math.ceil(max_len / page_size)
        num_pages = batch * pages_per_seq
        shape = (num_pages, page_size, nheads_k, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        order = torch.randperm(num_pages, generator=generator)
        self.block_table = order.view(batch, pages_per_seq).to(device, torch.int32)
        self.seqlens = torch.zeros(batch, dtype=torch.int32, device=device)  # valid tokens per sequence


class Block(nn.Module):
    def __init__(self, dim, nheads, nheads_k):
        super().__init__()
        self.nheads, self.nheads_k, self.head_dim = nheads, nheads_k, dim // nheads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wkv = nn.Linear(dim, 2 * nheads_k * self.head_dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x, layer_cache=None):
        """x [B, T, dim]. Without a cache: causal attention over x itself. With one,
        ``(k_pages, v_pages, cache_seqlens, block_table)``: x holds the next T tokens."""
        batch, seqlen, _ = x.shape
        h = self.norm1(x)
        q = self.wq(h).view(batch, seqlen, self.nheads, self.head_dim)  # [B, T, H, D]
        k, v = self.wkv(h).view(batch, seqlen, 2, self.nheads_k, self.head_dim).unbind(2)  # [B, T, Hk, D]
        if layer_cache is None:
            a = flashtile.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                    is_causal=True, enable_gqa=True).transpose(1, 2)
        else:
            k_pages, v_pages, cache_seqlens, block_table = layer_cache
            a = flash_attn_with_kvcache(q, k_pages, v_pages, k, v, cache_seqlens=cache_seqlens,
                                        block_table=block_table, causal=True)
        x = x + self.wo(a.reshape(batch, seqlen, -1))
        return x + self.mlp(self.norm2(x))


class TinyDecoder(nn.Module):
    def __init__(self, vocab=256, dim=128, num_layers=2, nheads=8, nheads_k=2, max_len=1024):
        super().__init__()
        self.tok_emb, self.pos_emb = nn.Embedding(vocab, dim), nn.Embedding(max_len, dim)
        self.blocks = nn.ModuleList(Block(dim, nheads, nheads_k) for _ in range(num_layers))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens, cache: PagedKVCache | None = None, seqs=slice(None)):
        """tokens [B, T] → logits [B, T, vocab]. With a cache, the tokens continue sequences
        ``seqs`` of the cache, whose keys/values are appended and whose lengths advance by T."""
        seqlen = tokens.shape[1]
        if cache is None:
            positions = torch.arange(seqlen, device=tokens.device)[None]
        else:
            cache_seqlens, block_table = cache.seqlens[seqs], cache.block_table[seqs]
            positions = cache_seqlens[:, None].long() + torch.arange(seqlen, device=tokens.device)  # [B, T]
        x = self.tok_emb(tokens) + self.pos_emb(positions)
        for i, block in enumerate(self.blocks):
            layer_cache = None if cache is None else (cache.k[i], cache.v[i], cache_seqlens, block_table)
            x = block(x, layer_cache)
        if cache is not None:
            cache.seqlens[seqs] += seqlen
        return self.head(self.norm(x))


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default=None,
                        help="default: float32 on CPU, float16 on CUDA")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--prompt-lens", type=int, nargs="+", default=[7, 30, 16, 1],
                        help="prompt length of each sequence (cycled over the batch)")
    parser.add_argument("--steps", type=int, default=24, help="tokens generated per sequence")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, nargs=2, default=[8, 2], metavar=("NHEADS", "NHEADS_K"))
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("float16" if device.type == "cuda" else "float32"))
    torch.manual_seed(args.seed)
    prompt_lens = [args.prompt_lens[b % len(args.prompt_lens)] for b in range(args.batch)]
    max_len = max(prompt_lens) + args.steps
    model = TinyDecoder(args.vocab, args.dim, args.layers, *args.heads, max_len=max_len).to(device, dtype).eval()
    g = torch.Generator().manual_seed(args.seed)
    cache = PagedKVCache(args.layers, args.batch, max_len, args.page_size, args.heads[1], args.dim // args.heads[0],
                         dtype, device, g)
    sequences = [torch.randint(args.vocab, (n,), generator=g).to(device) for n in prompt_lens]

    with torch.no_grad():
        # prefill: each prompt alone into its own pages; its last logits give the first token
        next_tokens = torch.stack([model(seq[None], cache, seqs=slice(b, b + 1))[0, -1].argmax()
                                   for b, seq in enumerate(sequences)])
        max_error, decode_s = 0.0, 0.0
        for _ in range(args.steps):
            sequences = [torch.cat((seq, tok[None])) for seq, tok in zip(sequences, next_tokens)]
            _sync(device)
            start = time.perf_counter()
            logits = model(next_tokens[:, None], cache)[:, 0]  # [B, vocab]: one decode step of the batch
            _sync(device)
            decode_s += time.perf_counter() - start
            # check: the same logits from the whole sequence, recomputed without a cache
            for b, seq in enumerate(sequences):
                full = model(seq[None])[0, -1]
                error = (logits[b].double() - full.double()).abs().max().item()
                max_error = max(max_error, error / max(1.0, full.abs().max().item()))
            next_tokens = logits.argmax(-1)

    tolerance = TOLERANCE[dtype]
    tokens_per_s = args.batch * args.steps / decode_s
    print(f"{args.batch} sequences, prompts {prompt_lens}, {args.steps} new tokens each, paged KV "
          f"(page size {args.page_size}), {args.layers} layers, heads {args.heads[0]}:{args.heads[1]}, "
          f"{dtype} on {device}")
    print(f"decode: {tokens_per_s:,.0f} tokens/s; max |logits − full recompute| / scale = {max_error:.2e} "
          f"(tolerance {tolerance:.0e})")
    if max_error > tolerance:
        raise SystemExit(f"logits differ from the full recomputation: {max_error:.2e} > {tolerance:.0e}")
    return dict(sequences=sequences, max_error=max_error, tolerance=tolerance, tokens_per_s=tokens_per_s)


if __name__ == "__main__":
    main()
