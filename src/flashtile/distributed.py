"""Ring attention over ``torch.distributed``: exact attention on a sequence split across ranks.

Each of the W ranks of a process group holds one shard of the sequence (queries and
keys/values alike). The K/V shards travel around the ring rank → rank + 1 with
point-to-point messages (``batch_isend_irecv``); at step ``s`` rank ``r`` holds the
K/V of rank ``r − s`` and attends its own queries to it with flashtile's kernel. The
exchange for step ``s + 1`` is started before step ``s`` is computed, so communication
overlaps the attention of the block in hand. The partial results are merged exactly
through their log-sum-exps (``flashtile.merge``), in float32.

Backward (the gradients of the global attention): every block's backward is run
against the GLOBAL output and log-sum-exp — ``P = exp(S − L)`` and
``D = rowsum(dO ∘ O)`` are then the global probabilities and correction restricted to
the block — so the per-block gradients simply add up. dQ accumulates locally in
float32; the float32 dK/dV of a K/V shard travel around the ring with it, each rank
adding its contribution, and after W steps a last message hands them to their owner.

Layouts (the ``layout`` argument, and ``shard_sequence`` / ``gather_sequence``): the
sequence is cut into chunks of equal length.

* ``"contiguous"``: W chunks, rank r holds chunk r.
* ``"zigzag"``: 2W chunks, rank r holds chunks r and 2W − 1 − r (in that order), so
  that every rank does the same work under a causal mask. With ``causal=True`` every
  ring step is one of three equal-cost calls: the diagonal (rank r's own K/V: causal
  attention of its two chunks on themselves), "all my queries vs the first half of the
  incoming K/V" (from a rank s < r: non-causal) or "the second half of my queries vs
  all of the incoming K/V" (from a rank s > r: non-causal). Chunks are equal, so every
  diagonal block is square and flashtile's bottom-right causal alignment coincides with
  the top-left one.

Without a causal mask the layout does not change the result (queries are independent
and keys are a set); it only has to match how the caller sharded the sequence for
``gather_sequence``.

Transport: any backend with point-to-point messages — NCCL on GPUs (one GPU per rank;
call ``torch.cuda.set_device`` first), gloo on CPUs, where flashtile's CPU path does the
local attention. Every rank must pass shards of the same shape.
"""

from __future__ import annotations


import torch
import torch.distributed as dist

from . import _validate
from ._options import default_softmax_scale
from .merge import merge_attention_states
from .ops import attention_backward, attention_forward

__all__ = ["ring_flash_attn_func", "shard_sequence", "gather_sequence", "LAYOUTS"]

LAYOUTS = ("zigzag", "contiguous")


def _check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def _chunks_of_rank(rank: int, world_size: int, layout: str) -> tuple[int, ...]:
    """Indices of the sequence chunks that ``rank`` holds, in local order."""
    if layout == "zigzag":
        return (rank, 2 * world_size - 1 - rank)
    return (rank,)


def _num_chunks(world_size: int, layout: str) -> int:
    return 2 * world_size if layout == "zigzag" else world_size


def shard_sequence(x: torch.Tensor, rank: int, world_size: int, layout: str = "zigzag", dim: int = 1):
    """The shard of the full sequence ``x`` (along ``dim``) that ``rank`` holds in ``layout``.

    The length along ``dim`` must be a multiple of 2·world_size (zigzag) or world_size
    (contiguous). E.g. 8 positions on 2 ranks, zigzag: rank 0 holds [0 1 | 6 7], rank 1
    holds [2 3 | 4 5]. Returns a new contiguous tensor; differentiable.
    """
    _check_layout(layout)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in 0..{world_size - 1}, got {rank}")
    num_chunks = _num_chunks(world_size, layout)
    if x.shape[dim] % num_chunks != 0:
        raise ValueError(
            f"the sequence length {x.shape[dim]} (dim {dim} of shape {tuple(x.shape)}) must be a "
            f"multiple of {num_chunks} for the {layout} layout on {world_size} ranks"
        )
    chunks = x.chunk(num_chunks, dim)
    return torch.cat([chunks[c] for c in _chunks_of_rank(rank, world_size, layout)], dim)


def gather_sequence(local: torch.Tensor, group=None, layout: str = "zigzag", dim: int = 1):
    """The full sequence from every rank's shard in ``layout``: the inverse of ``shard_sequence``.

    A collective (all ranks of ``group`` call it; every rank gets the full tensor); not
    differentiable.
    """
    _check_layout(layout)
    world_size = dist.get_world_size(group)
    shards = [torch.empty_like(local) for _ in range(world_size)]
    dist.all_gather(shards, local.contiguous(), group=group)
    chunks = [None] * _num_chunks(world_size, layout)
    for rank, shard in enumerate(shards):
        ranks_chunks = _chunks_of_rank(rank, world_size, layout)
        for c, piece in zip(ranks_chunks, shard.chunk(len(ranks_chunks), dim)):
            chunks[c] = piece
    return torch.cat(chunks, dim)


# Message tags: in the backward a K/V shard and a dK/dV accumulator travel between the same two
# ranks at once, with different sizes; distinct tags keep each receive matched to its kind of message
# whatever order the transport delivers them in (NCCL ignores tags and keeps its own order).
KV_TAG, DKV_TAG = 0, 1


class _Ring:
    """The ring of a process group: rank r sends to r + 1 and receives from r − 1."""

    def __init__(self, group):
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        # P2POp takes global ranks
        process_group = dist.group.WORLD if group is None else group
        self.next_rank = dist.get_global_rank(process_group, (self.rank + 1) % self.world_size)
        self.prev_rank = dist.get_global_rank(process_group, (self.rank - 1) % self.world_size)

    def source(self, step: int) -> int:
        """The rank whose K/V shard this rank holds at ``step``."""
        return (self.rank - step) % self.world_size

    def start_pass(self, tensor: torch.Tensor, tag: int) -> _Pass:
        """Send ``tensor`` to the next rank and receive the previous rank's, without waiting."""
        if self.world_size == 1:
            return _Pass([], tensor)
        received = torch.empty_like(tensor)
        requests = dist.batch_isend_irecv([
            dist.P2POp(dist.isend, tensor, self.next_rank, self.group, tag),
            dist.P2POp(dist.irecv, received, self.prev_rank, self.group, tag),
        ])
        return _Pass(requests, received)


class _Pass:
    """A message in flight around the ring; ``wait()`` returns the received tensor."""

    def __init__(self, requests, received: torch.Tensor):
        self.requests = requests
        self.received = received

    def wait(self) -> torch.Tensor:
        for request in self.requests:
            request.wait()
        return self.received


def block_plan(step_source: int, rank: int, causal: bool, layout: str, seqlen_q: int, seqlen_k: int):
    """What rank ``rank`` computes against the K/V of rank ``step_source``.

    → ``None`` (nothing visible) or ``(query slice, key slice, causal)`` into the local
    queries and the incoming K/V; see the module docstring.
    """
    everything = slice(0, None)
    if not causal:
        return everything, everything, False
    if step_source == rank:
        return everything, everything, True
    if layout == "contiguous":
        return (everything, everything, False) if step_source < rank else None
    if step_source < rank:
        return everything, slice(0, seqlen_k // 2), False
    return slice(seqlen_q // 2, None), everything, False


def _ring_forward(q, k, v, softmax_scale, causal, learnable_sink, layout, ring: _Ring):
    seqlen_q, seqlen_k = q.shape[1], k.shape[1]
    head_dim = k.shape[-1]
    kv = torch.cat((k, v), dim=-1)  # [B, Nk, Hk, D + Dv]: one message per step (v's head dim may differ)
    out = lse = None  # float32 running merge: out [B, Nq, H, D], lse [B, H, Nq]
    for step in range(ring.world_size):
        incoming = ring.start_pass(kv, KV_TAG) if step + 1 < ring.world_size else None
        plan = block_plan(ring.source(step), ring.rank, causal, layout, seqlen_q, seqlen_k)
        if plan is not None:
            rows, cols, block_causal = plan
            block_out, block_lse = attention_forward(
                q[:, rows], kv[:, cols, :, :head_dim], kv[:, cols, :, head_dim:], softmax_scale, block_causal,
                learnable_sink=learnable_sink if step == 0 else None,  # the sink's mass counts once
            )
            if out is None:  # step 0, the rank's own K/V: always covers every query
                out, lse = block_out.float(), block_lse
            else:
                out[:, rows], lse[:, :, rows] = merge_attention_states(
                    out[:, rows], lse[:, :, rows], block_out.float(), block_lse
                )
        if incoming is not None:
            kv = incoming.wait()
    return out.to(q.dtype), lse


def _ring_backward(dout, q, k, v, out, lse, softmax_scale, causal, deterministic, layout, ring: _Ring,
                   learnable_sink=None):
    """→ (dq, dk, dv, d sink or None): with ``learnable_sink``, this rank's rows' share of its gradient,
    from the first step's block (the rank's own K/V: every local row), as the forward counts it."""
    seqlen_q, seqlen_k = q.shape[1], k.shape[1]
    head_dim = k.shape[-1]
    kv = torch.cat((k, v), dim=-1)  # [B, Nk, Hk, D + Dv]
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dkv_pass = None  # the float32 dK/dV of the K/V in hand, accumulated by the ranks before
    dsink = None
    for step in range(ring.world_size):
        incoming = ring.start_pass(kv, KV_TAG) if step + 1 < ring.world_size else None
        plan = block_plan(ring.source(step), ring.rank, causal, layout, seqlen_q, seqlen_k)
        if plan is not None:
            rows, cols, block_causal = plan
            block_dq, block_dk, block_dv, *block_dsink = attention_backward(
                dout[:, rows], q[:, rows], kv[:, cols, :, :head_dim], kv[:, cols, :, head_dim:],
                out[:, rows], lse[:, :, rows], softmax_scale, block_causal, deterministic=deterministic,
                learnable_sink=learnable_sink if step == 0 else None,
            )
            dsink = block_dsink[0] if block_dsink else dsink
            dq[:, rows] += block_dq
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device) if step == 0 else dkv_pass.wait()
        if plan is not None:
            dkv[:, cols, :, :head_dim] += block_dk
            dkv[:, cols, :, head_dim:] += block_dv
        # after the last step this pass delivers each shard's dK/dV to its owner
        dkv_pass = ring.start_pass(dkv, DKV_TAG)
        if incoming is not None:
            kv = incoming.wait()
    dkv = dkv_pass.wait()
    return dq.to(q.dtype), dkv[..., :head_dim].to(k.dtype), dkv[..., head_dim:].to(v.dtype), dsink


class RingFlashAttnFunction(torch.autograd.Function):
    """Ring attention; saves only the local q, k, v, out and log-sum-exp for the backward."""

    @staticmethod
    def forward(ctx, q, k, v, learnable_sink, softmax_scale: float, causal: bool, deterministic: bool, layout: str,
                group):
        ring = _Ring(group)
        out, lse = _ring_forward(q, k, v, softmax_scale, causal, learnable_sink, layout, ring)
        ctx.save_for_backward(q, k, v, out, lse, learnable_sink)
        ctx.softmax_scale = softmax_scale
        ctx.causal = causal
        ctx.deterministic = deterministic
        ctx.layout = layout
        ctx.ring = ring
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, learnable_sink = ctx.saved_tensors
        wants_sink = learnable_sink is not None and ctx.needs_input_grad[3]  # this rank's rows' share
        dq, dk, dv, dsink = _ring_backward(dout, q, k, v, out, lse, ctx.softmax_scale, ctx.causal, ctx.deterministic,
                                           ctx.layout, ctx.ring, learnable_sink if wants_sink else None)
        return dq, dk, dv, dsink, None, None, None, None, None


def ring_flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group=None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    deterministic: bool = False,
    return_attn_probs: bool = False,
    layout: str = "zigzag",
    learnable_sink: torch.Tensor | None = None,
):
    """Exact attention over a sequence sharded across the ranks of ``group``.

    Every rank calls it with its own shard; the result on each rank is its shard of
    ``flash_attn_func`` applied to the gathered sequence, forward and backward.

    Arguments:
        q: this rank's queries (batch, local_seqlen_q, nheads, headdim), float16 /
            bfloat16 / float32, on this rank's device.
        k, v: this rank's keys/values (batch, local_seqlen_k, nheads_k, headdim or headdim_v); nheads
            a multiple of nheads_k (GQA/MQA as in ``flash_attn_func``). Every rank's
            shards have the same shapes.
        group: the process group (default: the world); its ranks form the ring in order.
        softmax_scale: defaults to 1 / sqrt(headdim).
        causal: causal mask over the global sequence, which requires local_seqlen_q =
            local_seqlen_k: queries and keys are the same positions.
        window_size: only (-1, -1); a sliding window raises NotImplementedError. (Each
            block would need the window shifted by the global offset between its query
            and key chunks, and blocks entirely outside the window skipped.)
        deterministic: bitwise identical gradients run to run, as in ``flash_attn_func``
            (the ring itself always merges in a fixed order; this keeps each block's backward
            off the fused sm_90 kernel, which sums dQ with atomic adds).
        return_attn_probs: also return this rank's log-sum-exp (and None in place of the
            probabilities, which are never formed).
        learnable_sink: None or float32 (nheads,), as in ``flash_attn_func``, the same on every
            rank: counted once per row (with the rank's own K/V). Its gradient on each rank is that
            rank's rows' share: sum it over the ring's ranks, as for any parameter they replicate.
        layout: how the sequence was sharded (``shard_sequence``): ``"zigzag"`` (rank r
            holds chunks r and 2W − 1 − r of 2W; local_seqlen must be even under causal)
            or ``"contiguous"`` (rank r holds chunk r of W). Both are exact with or
            without ``causal``; under causal, zigzag gives every rank the same work,
            while contiguous is correct but unbalanced: rank r computes r + 1 of the W
            blocks (the last rank's time bounds every step) and rank 0 waits.

    Not supported: a variable-length form (packed sequences, cu_seqlens over the global
    sequence). Every block pair (a query chunk, a key chunk) would need its own
    cu_seqlens — each packed sequence cut to its part in either chunk, with empty parts
    where a sequence misses one — derived on every rank for every K/V shard in transit,
    and a zigzag rank's two query chunks would need separate local varlen calls against
    the same key chunk (a key segment cannot serve two query segments in one cu_seqlens).
    The local varlen attention is not exposed by ``flashtile.ops`` yet. Until then, run
    packed batches through ``flash_attn_varlen_func`` on one device, or ring-attend one
    sequence at a time.

    Returns:
        out (batch, local_seqlen_q, nheads, headdim_v) in q's dtype; with
        return_attn_probs, ``(out, softmax_lse, None)`` where softmax_lse is
        (batch, nheads, local_seqlen_q), float32, natural log, over the global keys.
    """
    _validate.check_qkv(q, k, v, heads_axis=2)
    causal = _validate.flag("causal", causal)
    if tuple(window_size) != (-1, -1):
        raise NotImplementedError(
            f"window_size={tuple(window_size)!r} is not supported by ring attention (only (-1, -1))"
        )
    _check_layout(layout)
    if causal and q.shape[1] != k.shape[1]:
        raise ValueError(
            f"causal ring attention needs local seqlen_q = seqlen_k, got q {tuple(q.shape)}, k {tuple(k.shape)}"
        )
    if causal and layout == "zigzag" and q.shape[1] % 2 != 0:
        raise ValueError(
            f"the zigzag layout holds two equal chunks per rank: local seqlen must be even, got q {tuple(q.shape)}"
        )
    if not dist.is_initialized():
        raise RuntimeError("ring_flash_attn_func needs torch.distributed to be initialized (init_process_group)")
    scale = default_softmax_scale(q.shape[-1], softmax_scale)
    learnable_sink = _validate.check_learnable_sink(learnable_sink, q.shape[2], q.device)
    out, lse = RingFlashAttnFunction.apply(q, k, v, learnable_sink, scale, causal,
                                           _validate.deterministic(deterministic), layout, group)
    return (out, lse, None) if return_attn_probs else out
