"""The forward on Hopper (sm_90) in Gluon, with FlashAttention-3's warp-specialised schedule.

Triton's tile language cannot express what closes the forward's gap on the H200: its two
warpgroups take turns at the matmuls and the softmax, so the tensor cores idle while exp2 runs
(benchmarks/NOTES.md, "The profile"). Gluon (``triton.experimental.gluon``, in Triton 3.6) exposes
the pieces, still in Python:

* the work is cut into tiles of 64·c query rows of one head. A CTA takes one tile, or, over at most
  ``PERSISTENT_MAX_KEYS`` keys at head dims up to 128, the grid is **persistent**: one CTA per SM walks a
  strided share of the tiles (under causal masking in pairs of equal total length), so that a short tile's Q
  load and O store, which a CTA of one tile leaves exposed, overlap the previous and next tiles' work
  (``persistent`` says where it measured faster). The CTA is split into partitions of warps that share
  K/V tiles in shared memory:
  - a **producer warp** moves a tile's Q once the consumers have finished the previous tile's QKᵀ
    matmuls, then K_j and V_j into a ring of ``NUM_STAGES`` buffers with the tensor copy engine
    (TMA), each buffer guarded by a "ready" and an "empty" mbarrier. The ring runs on across tiles,
    so that the next tile's Q and first K/V blocks load under this tile's last blocks; a persistent
    CTA's O leaves through a staging buffer of its own, under the next tile's main loop;
  - **c consumer warpgroups** (``consumers``: two on the persistent grid; on a CTA per tile three at
    head dim 64, two at 128, 192 and 256), 64 query rows each, run the online softmax (base 2, log2 e folded
    into the scale) with ``wgmma``, and ``setmaxnreg`` gives them the registers the producer does not need;
* inside a consumer, the matmuls of neighbouring blocks overlap (FA3's intra-warpgroup
  pipelining): ``S_j = Q K_jᵀ`` and ``O += P_{j-1} V_{j-1}`` are issued together, the consumer
  waits for S_j alone and computes softmax(S_j) while the PV matmul still runs, then rescales O;
* the consumers are not synchronised with each other, so one's softmax also runs under another's
  matmuls (an explicit ping-pong turn between them measured no faster: NOTES.md, v0.5);
* a learnable sink (gpt-oss) joins each row's denominator in the epilogue: with the row's running
  max M (scaled, base 2), sum ℓ and unnormalised output acc, and the sink's logit σ in base 2,
  ``μ = max(M, σ)``, ``den = ℓ·2^(M−μ) + 2^(σ−μ)``, ``o = acc·2^(M−μ) / den``,
  ``LSE = (μ + log2 den)·ln 2``: the same mass as starting the online softmax at (σ, 1), and no work in the main loop;
* a head's tiles run side by side (sharing its K/V in L2), causal ones longest first (reversed
  Q-block order); only blocks that cross the diagonal
  or the end of the keys pay for masking. Visibility is the causal case of the one rule of
  ``flashtile.triton.scores`` (key ``j`` visible to query ``i`` iff ``j ≤ i + Nk − Nq``), written
  again here in Gluon's language because a Gluon kernel cannot call Triton functions.

Conventions are those of ``flashtile.triton.attention``: (batch, seqlen, nheads, head_dim) tensors with any
16-byte-aligned strides, GQA by ``h // (nheads_q // nheads_k)``, bottom-right causal alignment, the
log-sum-exp in natural log, float32, and a row that sees no key gets output 0 and LSE −inf.

Limits (``flashtile.triton.launch.attention_forward`` sends everything else to the Triton kernel, which stays the
portable path and the interpreter-tested specification): sm_90 only; bf16/fp16; head dims 64, 128, 192 and 256
(192 in 256-wide tiles, ``tile_head_dim``); full or causal attention (with or without a learnable sink) without
bias, ALiBi, softcap, window, dropout or packed batches; a positive softmax scale (masking sets raw scores to
−inf before the scale multiplies them, and the running max is kept over raw scores: with a scale ≤ 0 masked
entries would give NaN).
Gluon has no interpreter, so this file is tested on the GPU only (tests/test_hopper.py).
"""

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.language.core import _aggregate as aggregate

from ..triton import plans
from ..triton._host import cuda_properties


# Consumer warpgroups per CTA of a tile each, by head dim; each takes 64 query rows (H200 sweeps, NOTES.md
# v0.5: three at head dim 64 beat two by 5-11% from seqlen 2048; at 128 a third would spill, since the
# setmaxnreg budget drops from 240 to 160 registers). The persistent grid runs two (``consumers``). K/V
# blocks of 128 keys in two buffers (three, or blocks of 64, measured no faster). Head dims 192 and 256 run
# in 256-wide tiles (``tile_head_dim``) with blocks of 64 keys: two buffers of 128 such keys beside the two
# consumers' Q would need 320 KiB of shared memory; with 64 the kernel takes 192 KiB (ptxas: no spills).
CONSUMERS = {64: 3, 128: 2, 256: 2}
ROWS, NUM_STAGES = 64, 2
# The longest key range a persistent grid runs (see ``persistent``); in 256-wide tiles the grid is never
# persistent (a persistent CTA's O buffer would take the kernel to 256 KiB of shared memory). H100, kernels in
# CUDA graphs, bf16, full attention at 16384 tokens, the persistent grid against a CTA per tile of the same
# kernel, two runs:
# head dim 128 1.10-1.11x at N = 512, 1.04-1.05x at 1024, 1.00-1.02x at 2048, 0.97-1.01x at 4096,
# 0.97-0.99x at 8192, 0.86-0.98x at 16384; head dim 64 1.08x, 1.03-1.04x, 1.00x, then 0.92-0.99x.
PERSISTENT_MAX_KEYS = 2048


@aggregate
class _Tiling:
    # The compile-time shape of one CTA's work, handed to every partition: an aggregate keeps its
    # fields constexpr through warp_specialize, where a plain tuple turns them into tensors.
    CAUSAL: gl.constexpr
    NUM_CONSUMERS: gl.constexpr
    ROWS: gl.constexpr  # query rows per consumer
    BLOCK_N: gl.constexpr
    HEAD_DIM: gl.constexpr
    NUM_STAGES: gl.constexpr
    HAS_SINK: gl.constexpr
    PERSISTENT: gl.constexpr  # a CTA per SM walking many tiles, else a CTA per tile

    @gluon.constexpr_function
    def __init__(self, CAUSAL, NUM_CONSUMERS, ROWS, BLOCK_N, HEAD_DIM, NUM_STAGES, HAS_SINK, PERSISTENT):
        self.CAUSAL = gl.constexpr(CAUSAL)
        self.NUM_CONSUMERS = gl.constexpr(NUM_CONSUMERS)
        self.ROWS = gl.constexpr(ROWS)
        self.BLOCK_N = gl.constexpr(BLOCK_N)
        self.HEAD_DIM = gl.constexpr(HEAD_DIM)
        self.NUM_STAGES = gl.constexpr(NUM_STAGES)
        self.HAS_SINK = gl.constexpr(HAS_SINK)
        self.PERSISTENT = gl.constexpr(PERSISTENT)


_GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}


@gluon.jit
def _units_per_head(seqlen_q, tiling):
    """A persistent grid's units of work per head, which CTAs take in a static stride, so all as long:
    a tile each at full attention; under causal masking pairs of tiles, the i-th longest with the i-th
    shortest (M + 1 key blocks for M query blocks; the middle tile of an odd M alone)."""
    m_blocks = gl.cdiv(seqlen_q, tiling.NUM_CONSUMERS * tiling.ROWS)
    if tiling.CAUSAL:
        m_blocks = (m_blocks + 1) // 2
    return m_blocks


@gluon.jit
def _unit_tiles(unit, nheads_q, seqlen_q, tiling):
    """Unit index → (batch, query head, its first tile's Q block, the second's minus the first's, tiles
    in it: 1 or 2); a head's units side by side, sharing its K/V in L2."""
    m_blocks = gl.cdiv(seqlen_q, tiling.NUM_CONSUMERS * tiling.ROWS)
    per_head = _units_per_head(seqlen_q, tiling)
    u = unit % per_head
    i_bh = unit // per_head
    if tiling.CAUSAL:
        first = m_blocks - 1 - u  # the longest first, then its partner u
        count = gl.minimum(first - u, 1) + 1
        step = u - first
    else:
        first = u
        count = 1
        step = 0
    return i_bh // nheads_q, i_bh % nheads_q, first, step, count


@gluon.jit
def _tile_coords(tile, nheads_q, seqlen_q, tiling):
    """A CTA of one tile: tile index → (batch, query head, first row): a head's blocks side by side,
    sharing its K/V in L2, causal ones longest first (the last query blocks see the most keys). Ordering the causal tiles
    longest first over the whole call instead (heads interleaved) measured 20-30% slower: the K/V reuse
    in L2 is worth more than the balance (benchmarks/NOTES.md, fourteenth session)."""
    BLOCK_M: gl.constexpr = tiling.NUM_CONSUMERS * tiling.ROWS
    m_blocks = gl.cdiv(seqlen_q, BLOCK_M)
    i_m = tile % m_blocks
    if tiling.CAUSAL:
        i_m = m_blocks - 1 - i_m
    i_bh = tile // m_blocks
    return i_bh // nheads_q, i_bh % nheads_q, i_m * BLOCK_M


@gluon.jit
def _key_range(row_start, seqlen_q, seqlen_k, tiling):
    """→ (K/V blocks the tile's rows see, the first key from which a block needs masking)."""
    BLOCK_M: gl.constexpr = tiling.NUM_CONSUMERS * tiling.ROWS
    BLOCK_N: gl.constexpr = tiling.BLOCK_N
    if tiling.CAUSAL:
        diagonal = seqlen_k - seqlen_q  # bottom-right alignment
        last_row = gl.minimum(row_start + BLOCK_M, seqlen_q) - 1
        keys_end = gl.maximum(gl.minimum(seqlen_k, last_row + diagonal + 1), 0)
        unmasked_hi = gl.maximum(gl.minimum(row_start + diagonal + 1, seqlen_k), 0) // BLOCK_N * BLOCK_N
    else:
        keys_end = seqlen_k
        unmasked_hi = seqlen_k // BLOCK_N * BLOCK_N
    return gl.cdiv(keys_end, BLOCK_N), unmasked_hi


@gluon.jit
def _walk_tiles(work: gl.constexpr, args, shape, batch, nheads_q, seqlen_q, tiling):
    """``work(*args, i_b, i_hq, row_start, blocks_done, tile_iter, *shape)`` for each of the CTA's tiles, in the
    same order in every partition: ``blocks_done`` is the K/V ring's position, which ``work`` returns advanced
    past the tile's blocks, and ``tile_iter`` counts the CTA's tiles (the Q buffer's phases)."""
    BLOCK_M: gl.constexpr = tiling.NUM_CONSUMERS * tiling.ROWS
    if tiling.PERSISTENT:
        blocks_done = 0
        tile_iter = 0
        units = _units_per_head(seqlen_q, tiling) * nheads_q * batch
        for unit in range(gl.program_id(0), units, gl.num_programs(0)):
            i_b, i_hq, first, step, count = _unit_tiles(unit, nheads_q, seqlen_q, tiling)
            for k in range(count):
                blocks_done = work(*args, i_b, i_hq, (first + k * step) * BLOCK_M, blocks_done, tile_iter, *shape)
                tile_iter += 1
    else:
        i_b, i_hq, row_start = _tile_coords(gl.program_id(0), nheads_q, seqlen_q, tiling)
        work(*args, i_b, i_hq, row_start, 0, 0, *shape)


@gluon.jit
def _produce_tile(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty,
                  i_b, i_hq, row_start, blocks_done, tile_iter, group_size, seqlen_q, seqlen_k, tiling):
    """One tile's loads: every consumer's Q rows once the consumers are done with the previous tile's,
    then its K/V blocks into the ring from position ``blocks_done``. → the ring's position after them."""
    BLOCK_N: gl.constexpr = tiling.BLOCK_N
    NUM_STAGES: gl.constexpr = tiling.NUM_STAGES
    n_blocks, _ = _key_range(row_start, seqlen_q, seqlen_k, tiling)
    i_hk = i_hq // group_size
    # a fresh mbarrier counts the phase before its first as complete: the first lap passes
    mbarrier.wait(q_empty, (tile_iter & 1) ^ 1)
    mbarrier.expect(q_ready, tiling.NUM_CONSUMERS * q_desc.block_type.nbytes)
    for c in gl.static_range(tiling.NUM_CONSUMERS):
        tma.async_copy_global_to_shared(q_desc, [i_b, row_start + c * tiling.ROWS, i_hq, 0], q_ready, q_smem.index(c))
    for j in range(n_blocks):
        stage = (blocks_done + j) % NUM_STAGES
        free_phase = (((blocks_done + j) // NUM_STAGES) & 1) ^ 1
        mbarrier.wait(k_empty.index(stage), free_phase)
        mbarrier.expect(k_ready.index(stage), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [i_b, j * BLOCK_N, i_hk, 0], k_ready.index(stage), k_smem.index(stage))
        mbarrier.wait(v_empty.index(stage), free_phase)
        mbarrier.expect(v_ready.index(stage), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [i_b, j * BLOCK_N, i_hk, 0], v_ready.index(stage), v_smem.index(stage))
    return blocks_done + n_blocks


@gluon.jit
def _producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty,
              batch, nheads_q, group_size, seqlen_q, seqlen_k, tiling):
    """One warp: the loads of the CTA's tiles. The ring runs on across tiles, so that a persistent CTA's
    next tile's Q and first blocks load under this one's last."""
    loads = (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty)
    _walk_tiles(_produce_tile, loads, (group_size, seqlen_q, seqlen_k, tiling), batch, nheads_q, seqlen_q,
                tiling)


@gluon.jit
def _online_softmax(s, m_i, l_i, rows, start_n, seqlen_k, diagonal, qk_scale, unmasked_hi,
                    CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr, s_layout: gl.constexpr):
    """One block of the online softmax on raw scores ``s`` [ROWS, BLOCK_N] → (p, alpha, m, l).
    ``m`` stays unscaled so that ``s · scale − m · scale`` is one FMA before the exp2."""
    if start_n >= unmasked_hi:  # the block crosses the diagonal or the end of the keys
        cols = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        visible = gl.expand_dims(cols < seqlen_k, 0)
        if CAUSAL:
            visible = visible & (gl.expand_dims(cols, 0) <= gl.expand_dims(rows + diagonal, 1))
        s = gl.where(visible, s, float("-inf"))
    # -- update m_i and l_i; a row with no visible key yet keeps m = -inf and exponentiates against 0
    m_new = gl.maximum(m_i, gl.max(s, axis=1))
    m_scaled = gl.where(m_new == float("-inf"), 0.0, m_new * qk_scale)
    p = gl.exp2(s * qk_scale - gl.expand_dims(m_scaled, 1))  # [ROWS, BLOCK_N]
    alpha = gl.exp2(gl.where(m_i == float("-inf"), float("-inf"), m_i * qk_scale) - m_scaled)
    l_i = l_i * alpha + gl.sum(p, axis=1)
    return p, alpha, m_new, l_i


@gluon.jit
def _consume_tile(which, q_smem, k_smem, v_smem, o_smem, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, o_desc,
                  Lse, stride_lb, stride_lh, Sinks, i_b, i_hq, row_start, blocks_done, tile_iter, seqlen_q, seqlen_k,
                  qk_scale, tiling):
    """One tile: query rows [row_start + which·ROWS, +ROWS) against every K/V block they see, from ring
    position ``blocks_done``; O staged in shared memory and stored by the copy engine, which the caller
    waits for. → the ring's position after the tile."""
    CAUSAL: gl.constexpr = tiling.CAUSAL
    ROWS: gl.constexpr = tiling.ROWS
    BLOCK_N: gl.constexpr = tiling.BLOCK_N
    HEAD_DIM: gl.constexpr = tiling.HEAD_DIM
    NUM_STAGES: gl.constexpr = tiling.NUM_STAGES
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    dtype: gl.constexpr = q_smem.dtype
    diagonal = seqlen_k - seqlen_q  # bottom-right alignment
    q = q_smem.index(which).reshape([ROWS, HEAD_DIM])  # [ROWS, HEAD_DIM]
    o_tile = o_smem.index(which)
    s_unused = gl.zeros([ROWS, BLOCK_N], gl.float32, layout=s_layout)  # use_acc=False ignores it

    n_blocks, unmasked_hi = _key_range(row_start, seqlen_q, seqlen_k, tiling)
    my_start = row_start + which * ROWS
    rows = my_start + gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))
    m_i = gl.full([ROWS], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([ROWS], gl.float32, layout=gl.SliceLayout(1, s_layout))
    acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=o_layout)
    mbarrier.wait(q_ready, tile_iter & 1)

    if n_blocks > 0:
        # -- block 0: S_0 alone
        first = blocks_done % NUM_STAGES
        mbarrier.wait(k_ready.index(first), (blocks_done // NUM_STAGES) & 1)
        k_t = k_smem.index(first).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0))  # [HEAD_DIM, BLOCK_N]
        s_token = warpgroup_mma(q, k_t, s_unused, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(0, deps=(s_token, ))  # [ROWS, BLOCK_N]
        mbarrier.arrive(k_empty.index(first))
        p, alpha, m_i, l_i = _online_softmax(s, m_i, l_i, rows, 0, seqlen_k, diagonal, qk_scale, unmasked_hi,
                                             CAUSAL, BLOCK_N, s_layout)
        p_op = gl.convert_layout(p.to(dtype), p_layout)  # [ROWS, BLOCK_N], registers: wgmma's A
        for j in range(1, n_blocks):
            stage = (blocks_done + j) % NUM_STAGES
            prev = (blocks_done + j - 1) % NUM_STAGES
            mbarrier.wait(k_ready.index(stage), ((blocks_done + j) // NUM_STAGES) & 1)
            mbarrier.wait(v_ready.index(prev), ((blocks_done + j - 1) // NUM_STAGES) & 1)
            k_t = k_smem.index(stage).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0))
            v = v_smem.index(prev).reshape([BLOCK_N, HEAD_DIM])  # [BLOCK_N, HEAD_DIM]
            # -- S_j = Q K_jᵀ and O += P_{j-1} V_{j-1} in flight together; S_j completes first
            s_token = warpgroup_mma(q, k_t, s_unused, use_acc=False, is_async=True)
            o_token = warpgroup_mma(p_op, v, acc, is_async=True)
            s = warpgroup_mma_wait(1, deps=(s_token, ))
            mbarrier.arrive(k_empty.index(stage))
            # -- softmax of block j while the tensor cores run P_{j-1} V_{j-1}
            p, alpha, m_i, l_i = _online_softmax(s, m_i, l_i, rows, j * BLOCK_N, seqlen_k, diagonal, qk_scale,
                                                 unmasked_hi, CAUSAL, BLOCK_N, s_layout)
            acc, p_op = warpgroup_mma_wait(0, deps=(o_token, p_op))
            mbarrier.arrive(v_empty.index(prev))
            # -- rescale the unnormalised output to the new row maxima
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
            p_op = gl.convert_layout(p.to(dtype), p_layout)
        # every S matmul of the tile has completed: the producer may load the next tile's Q
        mbarrier.arrive(q_empty)
        # -- the last block's PV
        last = (blocks_done + n_blocks - 1) % NUM_STAGES
        mbarrier.wait(v_ready.index(last), ((blocks_done + n_blocks - 1) // NUM_STAGES) & 1)
        o_token = warpgroup_mma(p_op, v_smem.index(last).reshape([BLOCK_N, HEAD_DIM]), acc, is_async=True)
        acc, p_op = warpgroup_mma_wait(0, deps=(o_token, p_op))
        mbarrier.arrive(v_empty.index(last))
    else:
        mbarrier.arrive(q_empty)

    if tiling.HAS_SINK:  # the sink's mass joins the denominator (module docstring); a row with no key: o = 0, LSE = σ
        sink2 = gl.load(Sinks + i_hq) * 1.4426950408889634  # [], base 2
        m2 = m_i * qk_scale  # [ROWS], −inf where no key was seen
        mu = gl.maximum(m2, sink2)
        kept = gl.exp2(m2 - mu)
        denominator = l_i * kept + gl.exp2(sink2 - mu)
        out = acc * gl.expand_dims(gl.convert_layout(kept / denominator, gl.SliceLayout(1, o_layout)), 1)
        lse = (mu + gl.log2(denominator)) * 0.6931471805599453  # * ln 2
    else:
        seen = l_i > 0.0
        out = acc / gl.expand_dims(gl.convert_layout(gl.where(seen, l_i, 1.0), gl.SliceLayout(1, o_layout)), 1)
        lse = gl.where(seen, (m_i * qk_scale + gl.log2(l_i)) * 0.6931471805599453, float("-inf"))  # * ln 2
    gl.store(Lse + i_b * stride_lb + i_hq * stride_lh + rows, lse, mask=rows < seqlen_q)
    # O is staged for the copy engine, which clips the rows past seqlen_q: in a persistent CTA through
    # its own buffer, so that the store runs under the next tile's main loop, the buffer rewritten once
    # the previous store has read it; in a CTA of one tile through Q's, free after the last QKᵀ
    tma.store_wait(0)
    o_tile.reshape([ROWS, HEAD_DIM]).store(out.to(dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, [i_b, my_start, i_hq, 0], o_tile)
    return blocks_done + n_blocks


@gluon.jit
def _consumer(which, q_smem, k_smem, v_smem, o_smem, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty,
              o_desc, Lse, stride_lb, stride_lh, Sinks, batch, nheads_q, seqlen_q, seqlen_k, qk_scale, tiling):
    """One warpgroup: the CTA's tiles, in the producer's order."""
    buffers = (which, q_smem, k_smem, v_smem, o_smem, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, o_desc,
               Lse, stride_lb, stride_lh, Sinks)
    _walk_tiles(_consume_tile, buffers, (seqlen_q, seqlen_k, qk_scale, tiling), batch, nheads_q, seqlen_q,
                tiling)
    tma.store_wait(0)


@gluon.jit
def _attn_fwd_sm90_kernel(q_desc, k_desc, v_desc, o_desc, Lse, stride_lb, stride_lh, Sinks,
                          batch, nheads_q, group_size, seqlen_q, seqlen_k, qk_scale,
                          CAUSAL: gl.constexpr, NUM_CONSUMERS: gl.constexpr, ROWS: gl.constexpr,
                          BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, NUM_STAGES: gl.constexpr,
                          HAS_SINK: gl.constexpr, PERSISTENT: gl.constexpr):
    # each CTA takes the tiles program_id, program_id + num_programs, ... (_tile_coords): one tile, unless PERSISTENT
    dtype: gl.constexpr = q_desc.dtype
    # tiles keep the descriptors' [1, rows, 1, HEAD_DIM] boxes; the consumers view them as 2-D
    q_smem = gl.allocate_shared_memory(dtype, [NUM_CONSUMERS, 1, ROWS, 1, HEAD_DIM], q_desc.layout)
    if PERSISTENT:  # O leaves through its own buffer, under the next tile's main loop
        o_smem = gl.allocate_shared_memory(dtype, [NUM_CONSUMERS, 1, ROWS, 1, HEAD_DIM], o_desc.layout)
    else:  # the CTA's one tile is done with Q when O is staged: its buffer serves (24-32 KiB less shared memory)
        o_smem = q_smem
    k_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, 1, BLOCK_N, 1, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, 1, BLOCK_N, 1, HEAD_DIM], v_desc.layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_ready, count=1)
    mbarrier.init(q_empty, count=NUM_CONSUMERS)  # every consumer is done with the tile's Q
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=NUM_CONSUMERS)  # every consumer releases a buffer
        mbarrier.init(v_empty.index(i), count=NUM_CONSUMERS)

    tiling = _Tiling(CAUSAL, NUM_CONSUMERS, ROWS, BLOCK_N, HEAD_DIM, NUM_STAGES, HAS_SINK, PERSISTENT)
    consumer = (q_smem, k_smem, v_smem, o_smem, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, o_desc, Lse,
                stride_lb, stride_lh, Sinks, batch, nheads_q, seqlen_q, seqlen_k, qk_scale, tiling)
    producer = (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty,
                batch, nheads_q, group_size, seqlen_q, seqlen_k, tiling)
    # the kernel's own 4 warps are consumer 0; setmaxnreg shares the 64K registers (the producer
    # keeps 24 a thread, the consumers split the rest)
    if NUM_CONSUMERS == 3:
        gl.warp_specialize([(_consumer, (0, ) + consumer), (_consumer, (1, ) + consumer),
                            (_consumer, (2, ) + consumer), (_producer, producer)], [4, 4, 1], [160, 160, 24])
    else:
        gl.warp_specialize([(_consumer, (0, ) + consumer), (_consumer, (1, ) + consumer),
                            (_producer, producer)], [4, 1], [240, 24])


@functools.cache
def _box_layout(box: tuple[int, ...], dtype: torch.dtype) -> gl.NVMMASharedLayout:
    # the same few boxes on every call, and working the layout out costs ~6 µs of Python each time
    return gl.NVMMASharedLayout.get_default_for(list(box), _GL_DTYPES[dtype])


def descriptor(t: torch.Tensor, rows: int, width: int | None = None) -> TensorDescriptor:
    """A descriptor over [batch, seqlen, nheads, head_dim] that moves [1, rows, 1, width] boxes (``width``: the
    head dim by default; wider, the copy engine fills the columns past the head dim with zeros on loads and
    clips them on stores)."""
    box = (1, rows, 1, t.shape[-1] if width is None else width)
    return TensorDescriptor(t, list(t.shape), list(t.stride()), list(box), _box_layout(box, t.dtype))


def record_forward(plan: plans.LaunchPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, learnable_sink: torch.Tensor | None, qk_scale: float, causal: bool) -> None:
    """Writes out (like q) and lse [B, Hq, Nq] float32 of q [B, Nq, Hq, D], k/v [B, Nk, Hk, D], for inputs
    that ``flashtile.triton.launch.gluon_usable`` found within this file's limits, launching through
    ``plan`` (``flashtile.triton.plans``: later calls of the key replay the launch on their tensors);
    ``qk_scale = softmax_scale · log2 e``; ``learnable_sink`` float32 [Hq] or None."""
    batch, seqlen_q, nheads_q, head_dim = q.shape
    seqlen_k, nheads_k = k.shape[1], k.shape[2]
    walks = persistent(seqlen_k, head_dim)
    num_consumers = consumers(head_dim, walks)
    width, block_n = tile_head_dim(head_dim), keys_per_block(head_dim)
    m_blocks = -(-seqlen_q // (num_consumers * ROWS))  # ceil division on Python ints
    if walks:  # units of one tile, or of two under causal masking (_units_per_head)
        grid = programs((m_blocks + 1) // 2 * nheads_q * batch if causal else m_blocks * nheads_q * batch, q.device)
    else:
        grid = m_blocks * nheads_q * batch
    plans.launch(
        plan, _attn_fwd_sm90_kernel, (grid, ),
        q_desc=descriptor(q, ROWS, width), k_desc=descriptor(k, block_n, width), v_desc=descriptor(v, block_n, width),
        o_desc=descriptor(out, ROWS, width), Lse=lse, stride_lb=lse.stride(0), stride_lh=lse.stride(1),
        Sinks=lse if learnable_sink is None else learnable_sink, batch=batch, nheads_q=nheads_q,
        group_size=nheads_q // nheads_k, seqlen_q=seqlen_q, seqlen_k=seqlen_k, qk_scale=qk_scale,
        CAUSAL=causal, NUM_CONSUMERS=num_consumers, ROWS=ROWS, BLOCK_N=block_n, HEAD_DIM=width,
        NUM_STAGES=NUM_STAGES, HAS_SINK=learnable_sink is not None, PERSISTENT=walks, num_warps=4,
    )


def tile_head_dim(head_dim: int) -> int:
    """The head dim of the kernel's tiles: the head dim itself (64, 128, 256), or 256 for 192, whose tiles Gluon
    cannot shape (a shared-memory tile's dims are powers of two): the copy engine fills the 64 columns past the
    head dim with zeros, which leave S unchanged and give O columns that the store clips."""
    return 256 if head_dim > 128 else head_dim


def keys_per_block(head_dim: int) -> int:
    """BLOCK_N: 128 keys, or 64 in 256-wide tiles (shared memory; see ``CONSUMERS``)."""
    return 64 if tile_head_dim(head_dim) == 256 else 128


def persistent(seqlen_k: int, head_dim: int) -> bool:
    """Whether the grid is persistent: in tiles up to 128 wide (see ``PERSISTENT_MAX_KEYS``) over at most
    ``PERSISTENT_MAX_KEYS`` keys, where a tile's few key blocks left its Q load and O store exposed; longer
    tiles gained nothing (benchmarks/NOTES.md, fourteenth session). Causal tiles go in pairs of equal total
    length (``_units_per_head``): a static stride over single tiles left some CTAs twice the work of others;
    pairs gained 3-10% at head dim 128 (fifteenth session) and, with two consumers, 7-19% over the Triton
    forward at 64 (sixteenth)."""
    return tile_head_dim(head_dim) <= 128 and seqlen_k <= PERSISTENT_MAX_KEYS


def consumers(head_dim: int, persistent_grid: bool) -> int:
    """Consumer warpgroups per CTA: ``CONSUMERS`` on a CTA per tile, two on the persistent grid. At head
    dim 64 that grid's sequences are short: 128-row tiles divide N = 512 and 1024, where 192-row ones
    computed 11% padding rows, and the tile loop keeps its registers (168, no spills; with three, 128 and
    368 bytes spilled in the causal pairs). H200, 16384 tokens, d64 forward against cuDNN at N = 512 /
    1024 / 2048 (benchmarks/NOTES.md, sixteenth session): 0.97 / 0.99 / 1.02 with two on the persistent
    grid against 0.79 / 0.87 / 1.02 with three per tile; causal 0.82 / 0.93 / 0.97 against the Triton
    forward's 0.77 / 0.80 / 0.82."""
    return 2 if persistent_grid else CONSUMERS[tile_head_dim(head_dim)]


def programs(tiles: int, device: torch.device) -> int:
    """The persistent grid: one CTA per SM (the shared memory of one fills an SM), fewer for fewer tiles."""
    return min(tiles, cuda_properties(device).multi_processor_count)
