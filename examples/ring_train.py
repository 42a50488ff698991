"""One training step of a small transformer whose sequence is sharded across processes.

    torchrun --standalone --nproc-per-node 2 examples/ring_train.py

Each process holds a zigzag shard of every sequence (``flashtile.distributed``); the
attention layers run ``ring_flash_attn_func``, every other layer is per-token and runs
on the shard alone. The parameters are replicated, so their gradients are summed over
the processes (what DistributedDataParallel would do). Rank 0 then recomputes the same
step on the full sequence in one process with ``flashtile.flash_attn_func`` and checks
the loss, the logits and every parameter's gradient; the script fails if they differ.

Backend: NCCL with one GPU per process when there are enough GPUs, else gloo on the
CPU (flashtile's CPU path does the local attention).
"""

from __future__ import annotations

import argparse
import copy
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import flashtile
from flashtile.distributed import gather_sequence, ring_flash_attn_func, shard_sequence

# fp32 everywhere: the ring and the single process sum the same terms in different
# orders, ~1e-6 relative apart; 1e-4 leaves room for either device and catches any
# real error (a wrong block or mask is off by O(1)).
RTOL = 1e-4


class Attention(nn.Module):
    def __init__(self, dim: int, nheads: int, nheads_kv: int):
        super().__init__()
        self.nheads, self.nheads_kv, self.head_dim = nheads, nheads_kv, dim // nheads
        self.to_q = nn.Linear(dim, nheads * self.head_dim, bias=False)
        self.to_kv = nn.Linear(dim, 2 * nheads_kv * self.head_dim, bias=False)
        self.proj = nn.Linear(nheads * self.head_dim, dim, bias=False)

    def forward(self, x, attend):
        q = self.to_q(x).unflatten(-1, (self.nheads, self.head_dim))  # [B, N, H, D]
        k, v = self.to_kv(x).unflatten(-1, (2, self.nheads_kv, self.head_dim)).unbind(2)  # [B, N, Hkv, D]
        return self.proj(attend(q, k, v).flatten(-2))


class Block(nn.Module):
    def __init__(self, dim: int, nheads: int, nheads_kv: int):
        super().__init__()
        self.norm_attn, self.norm_mlp = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = Attention(dim, nheads, nheads_kv)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x, attend):
        x = x + self.attn(self.norm_attn(x), attend)
        return x + self.mlp(self.norm_mlp(x))


class TinyLM(nn.Module):
    """Tokens and their global positions in, next-token logits out."""

    def __init__(self, vocab: int, dim: int, nheads: int, nheads_kv: int, nlayers: int, max_seqlen: int):
        super().__init__()
        self.embed, self.position = nn.Embedding(vocab, dim), nn.Embedding(max_seqlen, dim)
        self.blocks = nn.ModuleList(Block(dim, nheads, nheads_kv) for _ in range(nlayers))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens, positions, attend):
        x = self.embed(tokens) + self.position(positions)  # [B, N, C]
        for block in self.blocks:
            x = block(x, attend)
        return self.head(self.norm(x))  # [B, N, vocab]


def next_token_loss(model, tokens, targets, positions, attend, total_tokens: int):
    """Summed cross-entropy over these tokens / all tokens of the batch: shards add up to the mean."""
    logits = model(tokens, positions, attend)
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum") / total_tokens
    return loss, logits


def relative_error(actual, expected) -> float:
    return ((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-30)).item()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seqlen", type=int, default=96, help="global; a multiple of 2 x processes")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--nheads", type=int, default=4)
    parser.add_argument("--nheads-kv", type=int, default=2)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=97)
    args = parser.parse_args()

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    use_cuda = torch.cuda.is_available() and torch.cuda.device_count() >= world_size
    if use_cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)  # NCCL's point-to-point messages need it
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank = dist.get_rank()

    # the same seed on every process: identical initial weights and data
    torch.manual_seed(0)
    model = TinyLM(args.vocab, args.dim, args.nheads, args.nheads_kv, args.layers, args.seqlen).to(device)
    reference_model = copy.deepcopy(model)
    data = torch.randint(args.vocab, (args.batch, args.seqlen + 1), device=device)
    tokens, targets = data[:, :-1], data[:, 1:]  # [B, N]
    positions = torch.arange(args.seqlen, device=device).expand(args.batch, -1)

    # -- the distributed step: each process its zigzag shard of the sequence
    def ring_attend(q, k, v):
        return ring_flash_attn_func(q, k, v, causal=True, layout="zigzag")

    shard = [shard_sequence(t, rank, world_size, layout="zigzag") for t in (tokens, targets, positions)]
    loss, logits = next_token_loss(model, *shard, ring_attend, tokens.numel())
    loss.backward()
    for p in model.parameters():  # replicated parameters: sum the shards' gradients
        dist.all_reduce(p.grad)
    dist.all_reduce(loss.detach())
    logits = gather_sequence(logits.detach(), layout="zigzag")

    # -- rank 0: the same step on the full sequence, in one process
    failed = torch.zeros((), device=device)
    if rank == 0:
        def attend(q, k, v):
            return flashtile.flash_attn_func(q, k, v, causal=True)

        ref_loss, ref_logits = next_token_loss(reference_model, tokens, targets, positions, attend, tokens.numel())
        ref_loss.backward()
        errors = {"loss": relative_error(loss.detach(), ref_loss.detach()),
                  "logits": relative_error(logits, ref_logits.detach())}
        errors.update((f"grad {name}", relative_error(p.grad, ref_p.grad))
                      for (name, p), ref_p in zip(model.named_parameters(), reference_model.parameters()))
        worst = max(errors, key=errors.get)
        print(f"ring attention on {world_size} process(es), {dist.get_backend()} on {device}: "
              f"batch {args.batch}, seqlen {args.seqlen} ({args.seqlen // world_size} per process)")
        print(f"loss {loss.item():.6f} (one process: {ref_loss.item():.6f})")
        print(f"largest relative error vs one process: {errors[worst]:.2e} ({worst}; bound {RTOL:.0e})")
        failed.fill_(errors[worst] > RTOL)
    dist.broadcast(failed, src=0)  # every process fails or none

    torch.optim.AdamW(model.parameters(), lr=1e-3).step()
    dist.destroy_process_group()
    if failed.item():
        raise SystemExit("ring attention step differs from the single-process step")
    if rank == 0:
        print("OK: one training step, equal to the single-process step")


if __name__ == "__main__":
    main()
