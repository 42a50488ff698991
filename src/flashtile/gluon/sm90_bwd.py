"""The backward on Hopper (sm_90) in Gluon: one fused kernel, FlashAttention-3's schedule.

The portable backward (``flashtile.triton.attention``) runs two kernels, dK/dV then dQ, and each
recomputes S = QKᵀ and dP = dO Vᵀ: 7 matmuls where 5 are needed (benchmarks/NOTES.md, "The
profile"). Here one CTA owns a block of ``BLOCK_N`` = 128 keys of one KV head and walks every query
block (``BLOCK_M`` = 64 rows) of every query head of its group, in warp-specialised partitions:

* a **producer warp** moves K and V once, then Qᵢ with LSEᵢ and dOᵢ with Dᵢ into a ring of
  ``NUM_STAGES`` buffers with the tensor copy engine (TMA), guarded by "ready" and "empty" mbarriers;
* **two consumer warpgroups** own 64 keys each and keep their dK and dV accumulators in registers
  for the whole walk. Per query block, transposed so that the keys are wgmma's M dimension:

  - ``Sᵀ = K Qᵢᵀ`` and ``dPᵀ = V dOᵢᵀ`` are issued together; ``Pᵀ = exp2(Sᵀ·scale·log2 e − LSE·log2 e)``
    is computed while dPᵀ still runs;
  - ``dV += Pᵀ dOᵢ`` (Pᵀ from registers), ``dSᵀ = Pᵀ ∘ (dPᵀ − Dᵢ) · scale``, ``dK += dSᵀ Qᵢ``;
  - dQᵢ = dS K needs all 128 keys: each warpgroup stores its dSᵀ rows to shared memory (two
    buffers, alternating), and the warpgroups take turns at computing dQᵢ, so that only the one
    whose turn it is waits for the other's rows;

* **writer warps** add each dQᵢ from shared memory to a float32 accumulator in global memory, off
  the consumers' critical path, in one of two ways chosen per head dim by measurement
  (``DQ_BY_TMA``): at head dim 128 one warp hands the tile to the copy engine's bulk reduce-add
  (``cp.reduce.async.bulk.tensor``, FA3's way), four 128-byte column slabs a step, with no load or
  atomic instruction per element; at 64 two warps add half the rows each with 4-float vector atomics,
  which measured faster there. Either way the staged tile is swizzled against the bank conflicts of
  the consumers' stores from the wgmma accumulator layout (8-way unswizzled; none left): at 64 by a
  32-byte swizzle, at 128 by the copy engine's 128-byte swizzle (its widest) with the rows staged in a
  permuted order, which a 5-D view of the accumulator undoes. The launcher converts the accumulator
  to dQ's dtype.

Above head dim 128 (192 in 256-wide tiles, as the forward's) the accumulators of 64 keys no longer fit a
warpgroup's registers (dK and dV alone would take 256 a thread), and Q, dO, K and V tiles leave no shared memory
for a staged dQ. The **wide schedule** (``_attn_bwd_sm90_wide_kernel``, FA3's at head dim 256) splits the work
the other way: a CTA owns ``WIDE_BLOCK_N`` = 64 keys, every tile is kept in two 128-column halves, and per query
block each consumer warpgroup

* computes ``S = Qᵢ Kᵀ`` and ``dP = dOᵢ Vᵀ`` for its 32 of the keys over the whole head dim, then P and dS;
* stores its Pᵀ and dSᵀ rows to shared memory (two buffers, alternating) and waits for the other's;
* does ``dV += Pᵀ dOᵢ``, ``dK += dSᵀ Qᵢ`` and ``dQᵢ = dS K`` for all 64 keys in its half of the head dim,
  dK and dV held in registers (64 + 64 a thread) across the walk;
* adds its half of dQᵢ to the float32 accumulator straight from registers with 2-float vector atomics (no
  staging tile, no writer warps; FA3 does the same at 256), whose offsets are compile-time immediates because
  the accumulator keeps a head's rows together there (:func:`backward_buffers`).

The softmax scale is folded into dS, so dK and dQ need no scaling afterwards. A preprocess kernel
writes D = rowsum(dO ∘ O) with the tensor cores (see its docstring), LSE·log2 e and the zeroed dQ
accumulator, all padded to whole query blocks so that the main kernel needs no row masks.

The atomic adds make dQ's summation order, and so its last bits, vary run to run: this kernel is
the default, and ``deterministic=True`` takes the two-kernel Triton backward, which has no atomics
(the choice and its cost: README, benchmarks/NOTES.md).

Conventions are those of ``flashtile.triton.attention``: (batch, seqlen, nheads, head_dim) tensors,
GQA by ``h // (nheads_q // nheads_k)``, bottom-right causal alignment (key ``j`` visible to query
``i`` iff ``j ≤ i + Nk − Nq``, the rule of ``flashtile.triton.scores`` written again in Gluon: ``_masked``), the
log-sum-exp in natural log. A query row that saw no key (LSE −inf) and rows past the end get P = 0.

Limits (``flashtile.triton.launch.attention_backward`` sends everything else to the Triton kernels):
sm_90 only; bf16/fp16; head dims 64 and 128, and 192 and 256 in the wide schedule once routed
(``ROUTED_HEAD_DIMS``: not before it has run on a GPU); full or causal attention without bias, ALiBi,
softcap, window, dropout or packed batches; Q, K, V, O and dO whose strides the copy engine accepts.
Gluon has no interpreter, so this file runs on the GPU only (tests/test_hopper.py); its compiled
form is checked on any machine by tests/test_gluon_compile.py.
"""

import torch
from triton._C.libtriton import ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.language.core import _aggregate as aggregate

from ..triton import plans
from .sm90_fwd import descriptor, tile_head_dim

# Keys per CTA, split between the two consumer warpgroups, and query rows per step: 64-row steps keep
# dK, dV, Sᵀ and dPᵀ near the registers a thread that setmaxnreg gives (240 at head dim 64; 248 and 232
# at 128), where 128-row steps at head dim 64, FA3's tile, spilled several times more under Triton's
# register allocation.
BLOCK_N, KEYS, BLOCK_M, NUM_STAGES = 128, 64, 64, 2
# How dQᵢ reaches the accumulator, by head dim (H100, one run, backward only, N = 2048–16384;
# benchmarks/results/h100_2026-12-05.md): the copy engine's reduce-add was 1.01–1.10× the atomics at
# 128 and 0.95–0.99× at 64 (one cell 1.04), with the p20–p80 spreads apart in 10 of 12 cells.
DQ_BY_TMA = {64: False, 128: True}
# The head dims the launcher sends here. The wide schedule (192, 256) is compiled for sm_90a on any machine
# (tests/test_gluon_compile.py) but has not run on a GPU yet: it joins these once tests/test_hopper.py passes on one
# and its speed is measured against the Triton backward it would replace (benchmarks/NOTES.md, round 26)
ROUTED_HEAD_DIMS = (64, 128)
# Head dims above 128, the wide schedule (192 in 256-wide tiles, ``sm90_fwd.tile_head_dim``): BLOCK_N keys per CTA,
# KEYS of them per consumer warpgroup for S and dP, and each warpgroup's dK, dV and dQ in one HALF of the head dim
WIDE_BLOCK_N, WIDE_KEYS, WIDE_HALF = 64, 32, 128
DQ_SWIZZLE_BYTES = 128  # the copy engine's widest swizzle, and so the widest box row it allows
DQ_BOX_COLS = gl.constexpr(DQ_SWIZZLE_BYTES // 4)  # float32 columns of one bulk reduce's box


@aggregate
class _Tiling:
    # compile-time shape of one CTA's work, handed to every partition (see sm90_fwd._Tiling)
    CAUSAL: gl.constexpr
    BLOCK_M: gl.constexpr
    BLOCK_N: gl.constexpr
    KEYS: gl.constexpr  # keys per consumer warpgroup
    HEAD_DIM: gl.constexpr
    NUM_STAGES: gl.constexpr
    DQ_BY_TMA: gl.constexpr
    HALVES: gl.constexpr  # column pieces a tile of Q, K, V or dO is moved and kept in: 1, or 2 in the wide schedule
    HALF: gl.constexpr  # columns of one piece

    @gluon.constexpr_function
    def __init__(self, CAUSAL, BLOCK_M, BLOCK_N, KEYS, HEAD_DIM, NUM_STAGES, DQ_BY_TMA, HALVES, HALF):
        self.CAUSAL = gl.constexpr(CAUSAL)
        self.BLOCK_M = gl.constexpr(BLOCK_M)
        self.BLOCK_N = gl.constexpr(BLOCK_N)
        self.KEYS = gl.constexpr(KEYS)
        self.HEAD_DIM = gl.constexpr(HEAD_DIM)
        self.NUM_STAGES = gl.constexpr(NUM_STAGES)
        self.DQ_BY_TMA = gl.constexpr(DQ_BY_TMA)
        self.HALVES = gl.constexpr(HALVES)
        self.HALF = gl.constexpr(HALF)


@gluon.jit
def _walk(start_n, group_size, seqlen_q, seqlen_k, BLOCK_M: gl.constexpr, CAUSAL: gl.constexpr):
    """The query blocks a CTA whose keys start at ``start_n`` visits: (the diagonal's offset Nk − Nq, the first
    query block, query blocks per head, steps over the head group)."""
    diagonal = seqlen_k - seqlen_q  # bottom-right alignment
    if CAUSAL:  # the first query that sees key start_n is start_n − diagonal
        first_m = gl.maximum(start_n - diagonal, 0) // BLOCK_M
    else:
        first_m = 0
    m_blocks = gl.maximum(gl.cdiv(seqlen_q, BLOCK_M) - first_m, 0)
    return diagonal, first_m, m_blocks, group_size * m_blocks


@gluon.jit
def _producer(q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc, k_smem, v_smem, q_smem, do_smem, lse_smem,
              delta_smem, kv_ready, q_ready, do_ready, empty, i_b, i_hk, start_n, first_m, m_blocks, n_steps,
              group_size, tiling):
    """One warp: K and V once, then (Qᵢ, LSEᵢ) and (dOᵢ, Dᵢ) for every step, a buffer refilled once
    both consumers freed it. A tile moves in ``HALVES`` column pieces of ``HALF`` columns, piece h of
    stage s at index s·HALVES + h of its buffer (K and V: at h)."""
    BLOCK_M: gl.constexpr = tiling.BLOCK_M
    NUM_STAGES: gl.constexpr = tiling.NUM_STAGES
    HALVES: gl.constexpr = tiling.HALVES
    HALF: gl.constexpr = tiling.HALF
    mbarrier.expect(kv_ready, HALVES * (k_desc.block_type.nbytes + v_desc.block_type.nbytes))
    for h in gl.static_range(HALVES):
        tma.async_copy_global_to_shared(k_desc, [i_b, start_n, i_hk, h * HALF], kv_ready, k_smem.index(h))
        tma.async_copy_global_to_shared(v_desc, [i_b, start_n, i_hk, h * HALF], kv_ready, v_smem.index(h))
    for t in range(n_steps):
        stage = t % NUM_STAGES
        # a fresh mbarrier counts the phase before its first as complete: the first lap passes
        mbarrier.wait(empty.index(stage), ((t // NUM_STAGES) & 1) ^ 1)
        i_hq = i_hk * group_size + t // m_blocks
        start_m = (first_m + t % m_blocks) * BLOCK_M
        mbarrier.expect(q_ready.index(stage), HALVES * q_desc.block_type.nbytes + lse_desc.block_type.nbytes)
        for h in gl.static_range(HALVES):
            tma.async_copy_global_to_shared(q_desc, [i_b, start_m, i_hq, h * HALF], q_ready.index(stage),
                                            q_smem.index(stage * HALVES + h))
        tma.async_copy_global_to_shared(lse_desc, [i_b, i_hq, start_m], q_ready.index(stage), lse_smem.index(stage))
        mbarrier.expect(do_ready.index(stage), HALVES * do_desc.block_type.nbytes + delta_desc.block_type.nbytes)
        for h in gl.static_range(HALVES):
            tma.async_copy_global_to_shared(do_desc, [i_b, start_m, i_hq, h * HALF], do_ready.index(stage),
                                            do_smem.index(stage * HALVES + h))
        tma.async_copy_global_to_shared(delta_desc, [i_b, i_hq, start_m], do_ready.index(stage),
                                        delta_smem.index(stage))


@builtin
def _async_reduce_add(tensor_desc, coord, src, _semantic=None):
    """The copy engine's bulk reduce-add of ``src`` (shared memory) into the box at ``coord``. Triton 3.6
    builds the operation (``ttng.async_tma_reduce``) but its Gluon exports no function for it: this
    is ``tma.async_copy_shared_to_global`` with the reduction's builder call."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)


@gluon.jit
def _dq_writer_tma(dq_desc, dq_smem, dq_full, dq_empty, i_b, i_hk, first_m, m_blocks, n_steps, group_size, padded_q,
                   tiling):
    """One warp: each step's dQᵢ, once a consumer has stored it to shared memory, added to the float32
    accumulator by the copy engine; the buffer is handed back when the engine has read it. ``padded_q``: the
    accumulator's rows per sequence, which place a block in its 5-D view (:func:`_accumulator_descriptor`)."""
    BLOCK_M: gl.constexpr = tiling.BLOCK_M
    HEAD_DIM: gl.constexpr = tiling.HEAD_DIM
    for t in range(n_steps):
        i_hq = i_hk * group_size + t // m_blocks
        start_m = (first_m + t % m_blocks) * BLOCK_M
        mbarrier.wait(dq_full, t & 1)
        for c in gl.static_range(HEAD_DIM // DQ_BOX_COLS):  # the tile's 128-byte column slabs, one box each
            _async_reduce_add(dq_desc, [(i_b * padded_q + start_m) // 8, 0, 0, i_hq, c * DQ_BOX_COLS],
                              dq_smem.slice(c * DQ_BOX_COLS, DQ_BOX_COLS, dim=4))
        tma.store_wait(0)
        mbarrier.arrive(dq_empty)


@gluon.jit
def _dq_writer_atomics(which, dq_smem, dq_full, dq_empty, DQAccum, stride_ab, stride_as, stride_ah, i_b, i_hk, first_m,
                       m_blocks, n_steps, group_size, tiling):
    """One of two warps that add each step's dQᵢ from shared memory to the float32 accumulator in
    global memory, half the rows each, 4 floats a lane and whole rows per atomic instruction, off
    the consumers' critical path."""
    BLOCK_M: gl.constexpr = tiling.BLOCK_M
    HEAD_DIM: gl.constexpr = tiling.HEAD_DIM
    ROWS: gl.constexpr = BLOCK_M // 2
    CHUNK: gl.constexpr = 512 // HEAD_DIM  # rows per load: 16 floats a lane, within the 32 registers it has
    layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 4], threads_per_warp=[32 * 4 // HEAD_DIM, HEAD_DIM // 4],
                                            warps_per_cta=[1, 1], order=[1, 0])
    # [CHUNK, HEAD_DIM] offsets into the accumulator, [B, padded Nq, Hq, HEAD_DIM]
    chunk = (gl.expand_dims(gl.arange(0, CHUNK, layout=gl.SliceLayout(1, layout)), 1) * stride_as
             + gl.expand_dims(gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, layout)), 0))
    rows = dq_smem.slice(which * ROWS, ROWS, dim=0)  # [ROWS, HEAD_DIM]
    for t in range(n_steps):
        i_hq = i_hk * group_size + t // m_blocks
        start_m = (first_m + t % m_blocks) * BLOCK_M + which * ROWS
        base = DQAccum + i_b * stride_ab + i_hq * stride_ah + start_m * stride_as
        mbarrier.wait(dq_full, t & 1)
        for c in gl.static_range(ROWS // CHUNK):
            # the accumulator's rows are padded to whole blocks: no mask
            values = rows.slice(c * CHUNK, CHUNK, dim=0).load(layout)
            gl.atomic_add(base + c * CHUNK * stride_as + chunk, values, sem="relaxed")
        mbarrier.arrive(dq_empty)


@gluon.jit
def _masked(p, key_ids, query_ids, start_m, start_n, seqlen_k, diagonal, band_end, BLOCK_N: gl.constexpr,
            CAUSAL: gl.constexpr):
    """P of a block with the keys past the end, and under causal masking the keys past each query's diagonal, set
    to 0; ``key_ids`` and ``query_ids`` broadcast against P in either orientation (Sᵀ or S). Only blocks that cross
    the end of the keys or the diagonal pay for the mask: ``band_end`` is the last key of the CTA's block."""
    needs_mask = start_n + BLOCK_N > seqlen_k
    if CAUSAL:
        needs_mask = needs_mask | (start_m + diagonal < band_end)
    if needs_mask:
        visible = key_ids < seqlen_k
        if CAUSAL:
            visible = visible & (key_ids <= query_ids + diagonal)
        p = gl.where(visible, p, 0.0)
    return p


@gluon.jit
def _store_dk_dv(DK, DV, dk, dv, keys, cols, inside, i_b, i_hk, stride_dkb, stride_dks, stride_dkh, stride_dvb,
                 stride_dvs, stride_dvh):
    """A CTA's dK and dV from registers: rows ``keys`` [R] and columns ``cols`` [C] of KV head ``i_hk``, where
    ``inside`` (broadcast against [R, C]) holds."""
    gl.store(DK + i_b * stride_dkb + i_hk * stride_dkh + gl.expand_dims(keys, 1) * stride_dks
             + gl.expand_dims(cols, 0), dk, mask=inside)
    gl.store(DV + i_b * stride_dvb + i_hk * stride_dvh + gl.expand_dims(keys, 1) * stride_dvs
             + gl.expand_dims(cols, 0), dv, mask=inside)


@gluon.jit
def _consumer(which, k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, ds_smem, dq_smem, kv_ready, q_ready,
              do_ready, empty, ds_ready, dq_full, dq_empty, DK, DV, stride_dkb, stride_dks, stride_dkh, stride_dvb, stride_dvs, stride_dvh,
              i_b, i_hk, start_n, first_m, m_blocks, n_steps, seqlen_q, seqlen_k, diagonal, qk_scale, sm_scale,
              tiling):
    """One warpgroup: keys [start_n + which·KEYS, +KEYS) against every query block of the group."""
    CAUSAL: gl.constexpr = tiling.CAUSAL
    BLOCK_M: gl.constexpr = tiling.BLOCK_M
    BLOCK_N: gl.constexpr = tiling.BLOCK_N
    KEYS: gl.constexpr = tiling.KEYS
    HEAD_DIM: gl.constexpr = tiling.HEAD_DIM
    NUM_STAGES: gl.constexpr = tiling.NUM_STAGES
    st_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, BLOCK_M, 16])  # Sᵀ, dPᵀ
    kv_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, HEAD_DIM, 16])  # dK, dV
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, HEAD_DIM, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=kv_layout, k_width=2)
    dtype: gl.constexpr = q_smem.dtype

    my_start = start_n + which * KEYS
    keys = my_start + gl.arange(0, KEYS, layout=gl.SliceLayout(1, st_layout))
    k_all = k_smem.index(0).reshape([BLOCK_N, HEAD_DIM])  # [BLOCK_N, HEAD_DIM]
    k_mine = k_all.slice(which * KEYS, KEYS, dim=0)  # [KEYS, HEAD_DIM]
    v_mine = v_smem.index(0).reshape([BLOCK_N, HEAD_DIM]).slice(which * KEYS, KEYS, dim=0)
    dk = gl.zeros([KEYS, HEAD_DIM], gl.float32, layout=kv_layout)
    dv = gl.zeros([KEYS, HEAD_DIM], gl.float32, layout=kv_layout)
    st_unused = gl.zeros([KEYS, BLOCK_M], gl.float32, layout=st_layout)  # use_acc=False ignores it
    dq_unused = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=dq_layout)
    # the last key that a query block ending before the diagonal's band can see unmasked
    band_end = gl.minimum(start_n + BLOCK_N, seqlen_k) - 1
    mbarrier.wait(kv_ready, 0)

    for t in range(n_steps):
        stage = t % NUM_STAGES
        phase = (t // NUM_STAGES) & 1
        start_m = (first_m + t % m_blocks) * BLOCK_M
        rows = start_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, st_layout))
        q_tile = q_smem.index(stage).reshape([BLOCK_M, HEAD_DIM])  # [BLOCK_M, HEAD_DIM]
        do_tile = do_smem.index(stage).reshape([BLOCK_M, HEAD_DIM])

        # -- Sᵀ = K Qᵀ and dPᵀ = V dOᵀ in flight together
        mbarrier.wait(q_ready.index(stage), phase)
        s_token = warpgroup_mma(k_mine, q_tile.permute((1, 0)), st_unused, use_acc=False, is_async=True)
        mbarrier.wait(do_ready.index(stage), phase)
        dp_token = warpgroup_mma(v_mine, do_tile.permute((1, 0)), st_unused, use_acc=False, is_async=True)
        # LSE·log2 e and D come through shared memory, read where used: holding them (or their addresses)
        # in registers for the whole step made this kernel spill at head dim 128
        lse2 = lse_smem.index(stage).reshape([BLOCK_M]).load(gl.SliceLayout(0, st_layout))  # [BLOCK_M]
        s = warpgroup_mma_wait(1, deps=(s_token, ))  # [KEYS, BLOCK_M]
        p = _masked(gl.exp2(s * qk_scale - gl.expand_dims(lse2, 0)), gl.expand_dims(keys, 1), gl.expand_dims(rows, 0),
                    start_m, start_n, seqlen_k, diagonal, band_end, BLOCK_N, CAUSAL)
        p_low = p.to(dtype)
        dv_token = warpgroup_mma(gl.convert_layout(p_low, a_layout), do_tile, dv, is_async=True)
        delta = delta_smem.index(stage).reshape([BLOCK_M]).load(gl.SliceLayout(0, st_layout))
        dp, dv = warpgroup_mma_wait(0, deps=(dp_token, dv_token))  # dV too: with it in flight here ptxas serialized every wgmma for want of registers (head dim 128)

        # -- dSᵀ = Pᵀ ∘ (dPᵀ − D) · scale; dK += dSᵀ Q
        ds_low = (p * (dp - gl.expand_dims(delta, 0)) * sm_scale).to(dtype)  # [KEYS, BLOCK_M]
        dk_token = warpgroup_mma(gl.convert_layout(ds_low, a_layout), q_tile, dk, is_async=True)

        # -- dQ = dS K over both warpgroups' keys: each publishes its dSᵀ rows, and they take turns at
        # computing dQᵢ (which alternates the buffer too), so that only the one whose turn it is waits
        ds_buffer = ds_smem.index(t % 2)  # [BLOCK_N, BLOCK_M]
        ds_buffer.slice(which * KEYS, KEYS, dim=0).store(ds_low)
        fence_async_shared()
        gl.thread_barrier()  # every thread's rows are stored before the one arrival
        mbarrier.arrive(ds_ready.index(t % 2))
        # dK completes first: with dK's and dQ's accumulators in flight together ptxas serialized every
        # wgmma for want of registers (head dim 128)
        dk = warpgroup_mma_wait(0, deps=(dk_token, ))
        # Qᵢ and dOᵢ are read (dQᵢ needs neither): released before the turn, so that the producer refills the
        # stage one dQ matmul sooner and the turn's wait on dq_empty needs no warpgroup barrier before it
        # (Triton puts one before each single-thread arrive and most waits). The stages no longer keep the
        # other warpgroup from rewriting this dS buffer (at step t + 2) while the turn's dQ matmul reads it:
        # ds_ready does, as it reaches step t + 2 only after waiting at step t + 1 for the rows that the
        # turn-taker stores after its dQ matmul completed
        mbarrier.arrive(empty.index(stage))
        if t % 2 == which:
            mbarrier.wait(ds_ready.index(t % 2), (t // 2) & 1)
            dq_token = warpgroup_mma(ds_buffer.permute((1, 0)), k_all, dq_unused, use_acc=False, is_async=True)
            dq = warpgroup_mma_wait(0, deps=(dq_token, ))
            # -- hand dQᵢ to the writer warps, once they have taken the previous step's
            mbarrier.wait(dq_empty, (t & 1) ^ 1)
            if tiling.DQ_BY_TMA:
                # global row 8q + 4h + l staged at tile row 8q + 2l + h: a half-warp's 4 rows in 4 swizzle phases
                dq_smem.reshape([BLOCK_M // 8, 4, 2, HEAD_DIM]).store(
                    gl.permute(dq.reshape([BLOCK_M // 8, 2, 4, HEAD_DIM]), (0, 2, 1, 3)))
                fence_async_shared()  # the stores, made visible to the copy engine
            else:
                dq_smem.store(dq)
            gl.thread_barrier()
            mbarrier.arrive(dq_full)

    # -- dK and dV rows of this warpgroup's keys, straight from registers
    out_keys = my_start + gl.arange(0, KEYS, layout=gl.SliceLayout(1, kv_layout))
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, kv_layout))
    _store_dk_dv(DK, DV, dk.to(dtype), dv.to(dtype), out_keys, cols, gl.expand_dims(out_keys < seqlen_k, 1), i_b,
                 i_hk, stride_dkb, stride_dks, stride_dkh, stride_dvb, stride_dvs, stride_dvh)


@gluon.jit
def _attn_bwd_sm90_kernel(q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc, dq_desc, DK, DV, DQAccum,
                          stride_dkb, stride_dks, stride_dkh, stride_dvb, stride_dvs, stride_dvh, stride_ab, stride_as,
                          stride_ah, group_size, seqlen_q, seqlen_k, qk_scale, sm_scale,
                          CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, KEYS: gl.constexpr,
                          HEAD_DIM: gl.constexpr, NUM_STAGES: gl.constexpr, DQ_BY_TMA: gl.constexpr):
    i_n = gl.program_id(0)  # under causal masking the first key blocks have the most queries: first
    i_hk = gl.program_id(1)
    i_b = gl.program_id(2)
    start_n = i_n * BLOCK_N
    diagonal, first_m, m_blocks, n_steps = _walk(start_n, group_size, seqlen_q, seqlen_k, BLOCK_M, CAUSAL)

    dtype: gl.constexpr = q_desc.dtype
    # tiles keep the descriptors' [1, rows, 1, HEAD_DIM] boxes; the consumers view them as 2-D
    k_smem = gl.allocate_shared_memory(dtype, [1, 1, BLOCK_N, 1, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [1, 1, BLOCK_N, 1, HEAD_DIM], v_desc.layout)
    q_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, 1, BLOCK_M, 1, HEAD_DIM], q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, 1, BLOCK_M, 1, HEAD_DIM], do_desc.layout)
    lse_smem = gl.allocate_shared_memory(gl.float32, [NUM_STAGES, 1, 1, BLOCK_M], lse_desc.layout)
    delta_smem = gl.allocate_shared_memory(gl.float32, [NUM_STAGES, 1, 1, BLOCK_M], delta_desc.layout)
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], dtype)
    ds_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, BLOCK_M], ds_layout)
    # each step's dQᵢ on its way to the writer(s), stored from the wgmma accumulator's layout, whose store
    # instruction puts 8 rows × 32 bytes in a warp: unswizzled rows of 256 or 512 bytes start on the same bank,
    # an 8-way conflict that made a quarter of the kernel's shared-memory wavefronts (Nsight Compute, NOTES.md)
    if DQ_BY_TMA:  # the accumulator descriptor's layout: 128-byte swizzled column slabs, each one bulk reduce's box
        dq_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_M // 8, 4, 2, 1, HEAD_DIM], dq_desc.layout)
    else:  # rows' 32-byte pieces permuted by row: the 8 rows of a store fall on distinct banks
        dq_layout: gl.constexpr = gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=8, order=[1, 0])
        dq_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_M, HEAD_DIM], dq_layout)
    kv_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    do_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    ds_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    dq_full = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    dq_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_ready, count=1)
    mbarrier.init(dq_full, count=1)
    if DQ_BY_TMA:
        mbarrier.init(dq_empty, count=1)
    else:
        mbarrier.init(dq_empty, count=2)  # both writer warps have read their rows
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(do_ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # both consumers release a buffer
    for i in gl.static_range(2):
        mbarrier.init(ds_ready.index(i), count=2)

    tiling = _Tiling(CAUSAL, BLOCK_M, BLOCK_N, KEYS, HEAD_DIM, NUM_STAGES, DQ_BY_TMA, 1, HEAD_DIM)
    consumer = (k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, ds_smem, dq_smem, kv_ready, q_ready, do_ready,
                empty, ds_ready, dq_full, dq_empty, DK, DV, stride_dkb, stride_dks, stride_dkh, stride_dvb, stride_dvs,
                stride_dvh, i_b, i_hk, start_n, first_m, m_blocks,
                n_steps, seqlen_q, seqlen_k, diagonal, qk_scale, sm_scale, tiling)
    producer = (q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc, k_smem, v_smem, q_smem, do_smem, lse_smem,
                delta_smem, kv_ready, q_ready, do_ready, empty, i_b, i_hk, start_n, first_m, m_blocks, n_steps, group_size, tiling)
    # the kernel's own 4 warps are consumer 0, which setmaxnreg gives what the other partitions leave of the
    # 64 K registers; the producer and the writers share a warpgroup, which setmaxnreg sets as a whole
    if DQ_BY_TMA:
        # head dim 128: the writer and the producer need no more than 24 registers a thread; consumer 1 at 232
        # leaves consumer 0 248. With 240/32/32 consumer 0 ran at 232 and held 30 of the kernel's 33 spill
        # instructions (sm_90a SASS, static count; 46 M executed at N = 16384 on an H100, 22x cuDNN's); then
        # 2 (full) and 16 (causal, from 61), 12 / 30 with the swizzled dQ tile's addresses, and 21 / 18 with its
        # permuted rows (16.3 M executed at N = 8192, where the conflicts they removed cost more). 240/24/24
        # spilled more (8 / 32): ptxas schedules
        # differently at each budget. tests/test_gluon_compile.py prints ptxas's report; NOTES.md has the timings
        writer = (dq_desc, dq_smem, dq_full, dq_empty, i_b, i_hk, first_m, m_blocks, n_steps, group_size,
                  stride_ab // stride_as, tiling)
        gl.warp_specialize([(_consumer, (0, ) + consumer), (_consumer, (1, ) + consumer), (_producer, producer),
                            (_dq_writer_tma, writer)], [4, 1, 1], [232, 24, 24])
    else:
        writer = (dq_smem, dq_full, dq_empty, DQAccum, stride_ab, stride_as, stride_ah, i_b, i_hk, first_m, m_blocks,
                  n_steps, group_size, tiling)
        gl.warp_specialize([(_consumer, (0, ) + consumer), (_consumer, (1, ) + consumer), (_producer, producer),
                            (_dq_writer_atomics, (0, ) + writer), (_dq_writer_atomics, (1, ) + writer)],
                           [4, 1, 1, 1], [240, 32, 32, 32])


@gluon.jit
def _wide_consumer(which, k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, pt_smem, dst_smem, kv_ready, q_ready,
                   do_ready, empty, pds_ready, DK, DV, DQAccum, stride_dkb, stride_dks, stride_dkh, stride_dvb,
                   stride_dvs, stride_dvh, stride_ab, stride_ah, i_b, i_hk, start_n, first_m, m_blocks,
                   n_steps, group_size, seqlen_q, seqlen_k, diagonal, qk_scale, sm_scale, tiling):
    """One warpgroup of the wide schedule: S and dP of keys [start_n + which·KEYS, +KEYS) against each query
    block; then, from both warpgroups' P and dS, dK, dV and dQ in head-dim columns [which·HALF, +HALF)."""
    CAUSAL: gl.constexpr = tiling.CAUSAL
    BLOCK_M: gl.constexpr = tiling.BLOCK_M
    BLOCK_N: gl.constexpr = tiling.BLOCK_N
    KEYS: gl.constexpr = tiling.KEYS
    HALF: gl.constexpr = tiling.HALF
    HEAD_DIM: gl.constexpr = tiling.HEAD_DIM  # the tensors' head dim: 192 leaves the second half's last 64 columns
    NUM_STAGES: gl.constexpr = tiling.NUM_STAGES
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, KEYS, 16])  # S, dP
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, HALF, 16])  # dK, dV, dQ
    dtype: gl.constexpr = pt_smem.dtype

    keys = start_n + which * KEYS + gl.arange(0, KEYS, layout=gl.SliceLayout(0, s_layout))
    # this warpgroup's keys in each half of K and V, as the B operands of S = Q Kᵀ and dP = dO Vᵀ: [HALF, KEYS]
    k_mine_0 = k_smem.index(0).reshape([BLOCK_N, HALF]).slice(which * KEYS, KEYS, dim=0).permute((1, 0))
    k_mine_1 = k_smem.index(1).reshape([BLOCK_N, HALF]).slice(which * KEYS, KEYS, dim=0).permute((1, 0))
    v_mine_0 = v_smem.index(0).reshape([BLOCK_N, HALF]).slice(which * KEYS, KEYS, dim=0).permute((1, 0))
    v_mine_1 = v_smem.index(1).reshape([BLOCK_N, HALF]).slice(which * KEYS, KEYS, dim=0).permute((1, 0))
    k_half = k_smem.index(which).reshape([BLOCK_N, HALF])  # every key, this warpgroup's columns: dQ's B
    dk = gl.zeros([BLOCK_N, HALF], gl.float32, layout=acc_layout)
    dv = gl.zeros([BLOCK_N, HALF], gl.float32, layout=acc_layout)
    s_unused = gl.zeros([BLOCK_M, KEYS], gl.float32, layout=s_layout)  # use_acc=False ignores it
    dq_unused = gl.zeros([BLOCK_M, HALF], gl.float32, layout=acc_layout)
    # a block's rows and HALF columns in the accumulator, whose rows of 2·HALF floats follow each other
    # (:func:`backward_buffers`): offsets known at compile time, which the atomic adds take as immediates (with
    # ``which · HALF`` in here too, ptxas gave consumer 1 an address register pair per atomic, and its spills)
    dq_tile = (gl.expand_dims(gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, acc_layout)), 1) * (2 * HALF)
               + gl.expand_dims(gl.arange(0, HALF, layout=gl.SliceLayout(0, acc_layout)), 0))
    band_end = gl.minimum(start_n + BLOCK_N, seqlen_k) - 1  # as in _consumer
    mbarrier.wait(kv_ready, 0)

    for t in range(n_steps):
        stage = t % NUM_STAGES
        phase = (t // NUM_STAGES) & 1
        i_hq = i_hk * group_size + t // m_blocks
        start_m = (first_m + t % m_blocks) * BLOCK_M
        rows = start_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
        q_0 = q_smem.index(2 * stage).reshape([BLOCK_M, HALF])  # [BLOCK_M, HALF]
        q_1 = q_smem.index(2 * stage + 1).reshape([BLOCK_M, HALF])
        do_0 = do_smem.index(2 * stage).reshape([BLOCK_M, HALF])
        do_1 = do_smem.index(2 * stage + 1).reshape([BLOCK_M, HALF])

        # -- S = Q Kᵀ and dP = dO Vᵀ for this warpgroup's keys, over both halves of the head dim
        mbarrier.wait(q_ready.index(stage), phase)
        s_token = warpgroup_mma(q_0, k_mine_0, s_unused, use_acc=False, is_async=True)
        s_token = warpgroup_mma(q_1, k_mine_1, s_token, is_async=True)
        mbarrier.wait(do_ready.index(stage), phase)
        dp_token = warpgroup_mma(do_0, v_mine_0, s_unused, use_acc=False, is_async=True)
        dp_token = warpgroup_mma(do_1, v_mine_1, dp_token, is_async=True)
        lse2 = lse_smem.index(stage).reshape([BLOCK_M]).load(gl.SliceLayout(1, s_layout))  # [BLOCK_M]
        s = warpgroup_mma_wait(2, deps=(s_token, ))  # [BLOCK_M, KEYS]
        p = _masked(gl.exp2(s * qk_scale - gl.expand_dims(lse2, 1)), gl.expand_dims(keys, 0), gl.expand_dims(rows, 1),
                    start_m, start_n, seqlen_k, diagonal, band_end, BLOCK_N, CAUSAL)
        delta = delta_smem.index(stage).reshape([BLOCK_M]).load(gl.SliceLayout(1, s_layout))
        dp = warpgroup_mma_wait(0, deps=(dp_token, ))
        ds = p * (dp - gl.expand_dims(delta, 1)) * sm_scale  # [BLOCK_M, KEYS]

        # -- Pᵀ and dSᵀ of this warpgroup's keys into the step's buffers, whose other rows the other warpgroup writes
        buffer = t % 2
        pt_smem.index(buffer).slice(which * KEYS, KEYS, dim=0).store(gl.permute(p.to(dtype), (1, 0)))
        dst_smem.index(buffer).slice(which * KEYS, KEYS, dim=0).store(gl.permute(ds.to(dtype), (1, 0)))
        fence_async_shared()
        gl.thread_barrier()  # every thread's rows are stored before the one arrival
        mbarrier.arrive(pds_ready.index(buffer))
        # the other warpgroup rewrites this buffer at step t + 2 only after passing step t + 1's wait, which needs
        # this warpgroup's step t + 1 rows, stored after the matmuls below completed: two buffers need no other guard
        mbarrier.wait(pds_ready.index(buffer), (t // 2) & 1)
        pt = pt_smem.index(buffer)  # [BLOCK_N, BLOCK_M]
        dst = dst_smem.index(buffer)

        # -- dV += Pᵀ dO, dK += dSᵀ Q and dQ = dS K in this warpgroup's columns, issued together (192 accumulator
        # registers a thread, which ptxas schedules without serializing); deferring the atomic adds to the next
        # step, under its S and dP, made ptxas serialize every wgmma and spill 2 KiB (sm_90a, compiled on a CPU)
        dv_token = warpgroup_mma(pt, do_smem.index(2 * stage + which).reshape([BLOCK_M, HALF]), dv, is_async=True)
        dk_token = warpgroup_mma(dst, q_smem.index(2 * stage + which).reshape([BLOCK_M, HALF]), dk, is_async=True)
        dq_token = warpgroup_mma(dst.permute((1, 0)), k_half, dq_unused, use_acc=False, is_async=True)
        dv, dk = warpgroup_mma_wait(1, deps=(dv_token, dk_token))
        mbarrier.arrive(empty.index(stage))  # Qᵢ and dOᵢ are read
        dq = warpgroup_mma_wait(0, deps=(dq_token, ))  # [BLOCK_M, HALF]
        # the accumulator's rows are padded to whole blocks and its columns to 2·HALF: no mask
        gl.atomic_add(DQAccum + i_b * stride_ab + i_hq * stride_ah + start_m * (2 * HALF) + which * HALF + dq_tile, dq,
                      sem="relaxed")

    # -- dK and dV of every key in this warpgroup's columns, straight from registers
    out_keys = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, acc_layout))
    cols = which * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(0, acc_layout))
    inside = gl.expand_dims(out_keys < seqlen_k, 1) & gl.expand_dims(cols < HEAD_DIM, 0)
    _store_dk_dv(DK, DV, dk.to(dtype), dv.to(dtype), out_keys, cols, inside, i_b, i_hk, stride_dkb, stride_dks,
                 stride_dkh, stride_dvb, stride_dvs, stride_dvh)


@gluon.jit
def _attn_bwd_sm90_wide_kernel(q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc, DK, DV, DQAccum, stride_dkb,
                               stride_dks, stride_dkh, stride_dvb, stride_dvs, stride_dvh, stride_ab, stride_ah,
                               group_size, seqlen_q, seqlen_k, qk_scale, sm_scale, CAUSAL: gl.constexpr,
                               BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, KEYS: gl.constexpr, HALF: gl.constexpr,
                               HEAD_DIM: gl.constexpr, NUM_STAGES: gl.constexpr):
    i_n = gl.program_id(0)
    i_hk = gl.program_id(1)
    i_b = gl.program_id(2)
    start_n = i_n * BLOCK_N
    diagonal, first_m, m_blocks, n_steps = _walk(start_n, group_size, seqlen_q, seqlen_k, BLOCK_M, CAUSAL)

    dtype: gl.constexpr = q_desc.dtype
    # each tile in two column halves, one copy-engine box each (see _producer); at head dim 256: K and V 64 KiB,
    # two stages of Qᵢ and dOᵢ 128 KiB, Pᵀ and dSᵀ 32 KiB
    k_smem = gl.allocate_shared_memory(dtype, [2, 1, BLOCK_N, 1, HALF], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [2, 1, BLOCK_N, 1, HALF], v_desc.layout)
    q_smem = gl.allocate_shared_memory(dtype, [2 * NUM_STAGES, 1, BLOCK_M, 1, HALF], q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [2 * NUM_STAGES, 1, BLOCK_M, 1, HALF], do_desc.layout)
    lse_smem = gl.allocate_shared_memory(gl.float32, [NUM_STAGES, 1, 1, BLOCK_M], lse_desc.layout)
    delta_smem = gl.allocate_shared_memory(gl.float32, [NUM_STAGES, 1, 1, BLOCK_M], delta_desc.layout)
    pds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], dtype)
    pt_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, BLOCK_M], pds_layout)
    dst_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, BLOCK_M], pds_layout)
    kv_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    do_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    pds_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_ready, count=1)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(do_ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # both consumers release a buffer
    for i in gl.static_range(2):
        mbarrier.init(pds_ready.index(i), count=2)  # both consumers' rows of Pᵀ and dSᵀ

    tiling = _Tiling(CAUSAL, BLOCK_M, BLOCK_N, KEYS, HEAD_DIM, NUM_STAGES, False, 2, HALF)
    consumer = (k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, pt_smem, dst_smem, kv_ready, q_ready, do_ready,
                empty, pds_ready, DK, DV, DQAccum, stride_dkb, stride_dks, stride_dkh, stride_dvb, stride_dvs,
                stride_dvh, stride_ab, stride_ah, i_b, i_hk, start_n, first_m, m_blocks, n_steps,
                group_size, seqlen_q, seqlen_k, diagonal, qk_scale, sm_scale, tiling)
    producer = (q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc, k_smem, v_smem, q_smem, do_smem, lse_smem,
                delta_smem, kv_ready, q_ready, do_ready, empty, i_b, i_hk, start_n, first_m, m_blocks, n_steps,
                group_size, tiling)
    gl.warp_specialize([(_wide_consumer, (0, ) + consumer), (_wide_consumer, (1, ) + consumer),
                        (_producer, producer)], [4, 1], [240, 24])


@gluon.jit
def _bwd_preprocess_kernel(o_desc, do_desc, Lse, Lse2, Delta, DQAccum, stride_lb, stride_lh, stride_pb, stride_ph,
                           stride_ab, stride_as, stride_ah, seqlen_q, ROWS: gl.constexpr, HEAD_DIM: gl.constexpr):
    """Per block of ``ROWS`` query rows of one head: ``D = rowsum(dO ∘ O)``, ``LSE·log2 e`` (+inf for
    a row that saw no key and for the padding, so that P = 0 there) into buffers padded to whole
    blocks, and zeros into the same rows of the dQ accumulator.

    D is the diagonal of O dOᵀ formed with the tensor cores, the arithmetic in which the main kernel
    forms dPᵀ = V dOᵀ: where a row sees a single key, O is that key's V, D equals dP bit for bit,
    and dS = P ∘ (dP − D) is exactly 0, as it is mathematically (a sum in another order left
    ulp-sized gradients there)."""
    i_m = gl.program_id(0)
    i_h = gl.program_id(1)
    i_b = gl.program_id(2)
    dtype: gl.constexpr = o_desc.dtype
    o_smem = gl.allocate_shared_memory(dtype, [1, ROWS, 1, HEAD_DIM], o_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [1, ROWS, 1, HEAD_DIM], do_desc.layout)
    loaded = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(loaded, count=1)
    mbarrier.expect(loaded, o_desc.block_type.nbytes + do_desc.block_type.nbytes)
    # the copy engine fills rows past seqlen_q with zeros: their D is 0
    tma.async_copy_global_to_shared(o_desc, [i_b, i_m * ROWS, i_h, 0], loaded, o_smem)
    tma.async_copy_global_to_shared(do_desc, [i_b, i_m * ROWS, i_h, 0], loaded, do_smem)

    # LSE·log2 e while the tiles arrive
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, ROWS, 16])
    rows = gl.arange(0, ROWS, layout=gl.SliceLayout(1, mma_layout))
    in_q = i_m * ROWS + rows < seqlen_q
    lse = gl.load(Lse + i_b * stride_lb + i_h * stride_lh + i_m * ROWS + rows, mask=in_q, other=float("-inf"))
    padded = i_b * stride_pb + i_h * stride_ph + i_m * ROWS + rows
    gl.store(Lse2 + padded, gl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634))
    # zeros into the dQ accumulator's rows
    zeros_layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 4], threads_per_warp=[4, 8], warps_per_cta=[4, 1],
                                                  order=[1, 0])
    tile = (gl.expand_dims(gl.arange(0, ROWS, layout=gl.SliceLayout(1, zeros_layout)), 1) * stride_as
            + gl.expand_dims(gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, zeros_layout)), 0))
    gl.store(DQAccum + i_b * stride_ab + i_h * stride_ah + i_m * ROWS * stride_as + tile,
             gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=zeros_layout))

    mbarrier.wait(loaded, 0)
    products = warpgroup_mma(o_smem.reshape([ROWS, HEAD_DIM]), do_smem.reshape([ROWS, HEAD_DIM]).permute((1, 0)),
                             gl.zeros([ROWS, ROWS], gl.float32, layout=mma_layout), use_acc=False)  # O dOᵀ
    cols = gl.arange(0, ROWS, layout=gl.SliceLayout(0, mma_layout))
    delta = gl.sum(gl.where(gl.expand_dims(rows, 1) == gl.expand_dims(cols, 0), products, 0.0), axis=1)
    gl.store(Delta + padded, delta)
    mbarrier.invalidate(loaded)


_STATS_LAYOUT = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=3)


def _stats_descriptor(t: torch.Tensor) -> TensorDescriptor:
    """A descriptor over a [batch, nheads, padded seqlen] float32 buffer that moves one block's rows."""
    return TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, BLOCK_M], _STATS_LAYOUT)


def _accumulator_descriptor(t: torch.Tensor) -> TensorDescriptor:
    """A descriptor over the [batch, padded seqlen, nheads, head_dim] float32 dQ accumulator whose box
    is one block's rows of one head and 128 bytes of its columns, 128-byte swizzled: the layout of one
    column slab of the kernel's staged dQ tile (a swizzled box may span at most 128 bytes of a row).
    Viewed as [batch · padded seqlen / 8, 4, 2, nheads, head_dim] with row 8q + a + 4b at (q, a, b), so that
    the box, filled row by row in (q, a, b) order, stages global row 8q + 4b + a at tile row 8q + 2a + b:
    the order the consumers store (the 4 rows a half-warp stores then fall in 4 swizzle phases, where 4
    consecutive rows shared 2: a 2-way bank conflict). Padded seqlens are whole blocks, multiples of 8."""
    layout = gl.NVMMASharedLayout(swizzle_byte_width=DQ_SWIZZLE_BYTES, element_bitwidth=32, rank=5)
    batch, padded, heads, dim = t.shape
    row = t.stride(1)
    return TensorDescriptor(t, [batch * padded // 8, 4, 2, heads, dim], [8 * row, row, 4 * row, t.stride(2), 1],
                            [BLOCK_M // 8, 4, 2, 1, DQ_BOX_COLS.value], layout)


def backward_buffers(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward's float32 work buffers for q [B, Nq, Hq, D], each over whole row blocks: the
    log-sum-exp in base 2 and D = rowsum(dO ∘ O), [B, Hq, padded Nq], and the dQ accumulator
    [B, padded Nq, Hq, D]. The accumulator has dQ's own layout, so that its conversion to dQ is a copy without a
    transpose; except in the wide schedule, whose atomic adds take their offsets as immediates from rows of a head
    that follow each other: there it is a [B, Hq, padded Nq, 256] buffer seen through that shape (192 in 256
    columns, which the kernel adds to without masks)."""
    batch, seqlen_q, nheads_q, head_dim = q.shape
    padded_q = -(-seqlen_q // BLOCK_M) * BLOCK_M  # ceil to whole blocks on Python ints
    lse2 = torch.empty((batch, nheads_q, padded_q), dtype=torch.float32, device=q.device)
    delta = torch.empty_like(lse2)
    width = tile_head_dim(head_dim)
    if width > 128:
        dq_accum = torch.empty((batch, nheads_q, padded_q, width), dtype=torch.float32, device=q.device).transpose(1, 2)
    else:
        dq_accum = torch.empty((batch, padded_q, nheads_q, head_dim), dtype=torch.float32, device=q.device)
    return lse2, delta, dq_accum


def record_backward(plan: plans.LaunchPlan, dout, q, k, v, out, lse, dk, dv, lse2, delta, dq_accum,
                    softmax_scale: float, causal: bool) -> None:
    """Writes dk/dv (any strides with a contiguous head dim) and the buffers of :func:`backward_buffers`
    (D in ``delta`` [B, Hq, padded Nq], dQ in ``dq_accum`` [B, padded Nq, Hq, D], above head dim 128 a view of a
    [B, Hq, padded Nq, 256] buffer whose row stride the wide kernel takes as a constant) for q [B, Nq, Hq, D], k/v
    [B, Nk, Hk, D], out and dout like q, lse [B, Hq, Nq] float32, for inputs that
    ``flashtile.triton.launch.gluon_backward_usable`` found within this file's limits, launching
    through ``plan`` (``flashtile.triton.plans``: later calls of the key replay the launches)."""
    batch, seqlen_q, nheads_q, head_dim = q.shape
    seqlen_k, nheads_k = k.shape[1], k.shape[2]
    padded_q, width = lse2.shape[-1], tile_head_dim(head_dim)
    plans.launch(
        plan, _bwd_preprocess_kernel, (padded_q // BLOCK_M, nheads_q, batch),
        o_desc=descriptor(out, BLOCK_M, width), do_desc=descriptor(dout, BLOCK_M, width), Lse=lse, Lse2=lse2,
        Delta=delta, DQAccum=dq_accum, stride_lb=lse.stride(0), stride_lh=lse.stride(1), stride_pb=lse2.stride(0),
        stride_ph=lse2.stride(1), stride_ab=dq_accum.stride(0), stride_as=dq_accum.stride(1),
        stride_ah=dq_accum.stride(2), seqlen_q=seqlen_q, ROWS=BLOCK_M, HEAD_DIM=width, num_warps=4,
    )
    strides = dict(stride_dkb=dk.stride(0), stride_dks=dk.stride(1), stride_dkh=dk.stride(2), stride_dvb=dv.stride(0),
                   stride_dvs=dv.stride(1), stride_dvh=dv.stride(2), stride_ab=dq_accum.stride(0),
                   stride_ah=dq_accum.stride(2))
    if width > 128:
        assert dq_accum.stride(1) == 2 * WIDE_HALF, "the wide kernel's accumulator rows follow each other"
        plans.launch(
            plan, _attn_bwd_sm90_wide_kernel, (-(-seqlen_k // WIDE_BLOCK_N), nheads_k, batch),
            q_desc=descriptor(q, BLOCK_M, WIDE_HALF), k_desc=descriptor(k, WIDE_BLOCK_N, WIDE_HALF),
            v_desc=descriptor(v, WIDE_BLOCK_N, WIDE_HALF), do_desc=descriptor(dout, BLOCK_M, WIDE_HALF),
            lse_desc=_stats_descriptor(lse2), delta_desc=_stats_descriptor(delta), DK=dk, DV=dv, DQAccum=dq_accum,
            **strides, group_size=nheads_q // nheads_k, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
            qk_scale=softmax_scale * 1.4426950408889634, sm_scale=softmax_scale, CAUSAL=causal, BLOCK_M=BLOCK_M,
            BLOCK_N=WIDE_BLOCK_N, KEYS=WIDE_KEYS, HALF=WIDE_HALF, HEAD_DIM=head_dim, NUM_STAGES=NUM_STAGES,
            num_warps=4,
        )
        return
    plans.launch(
        plan, _attn_bwd_sm90_kernel, (-(-seqlen_k // BLOCK_N), nheads_k, batch),
        q_desc=descriptor(q, BLOCK_M), k_desc=descriptor(k, BLOCK_N), v_desc=descriptor(v, BLOCK_N),
        do_desc=descriptor(dout, BLOCK_M), lse_desc=_stats_descriptor(lse2), delta_desc=_stats_descriptor(delta),
        dq_desc=_accumulator_descriptor(dq_accum), DK=dk, DV=dv, DQAccum=dq_accum, **strides,
        stride_as=dq_accum.stride(1),
        group_size=nheads_q // nheads_k,
        seqlen_q=seqlen_q, seqlen_k=seqlen_k,
        qk_scale=softmax_scale * 1.4426950408889634, sm_scale=softmax_scale,
        CAUSAL=causal, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, KEYS=KEYS, HEAD_DIM=head_dim, NUM_STAGES=NUM_STAGES,
        DQ_BY_TMA=DQ_BY_TMA[head_dim], num_warps=4,
    )
