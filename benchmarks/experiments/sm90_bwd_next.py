"""Experimental fused sm_90 backwards: the next query block's Sᵀ under this block's dK and dQ.

An experiment beside ``flashtile.gluon.sm90_bwd`` (which it imports, and which stays the shipped kernel):
the same CTA (128 keys of one KV head, walking every 64-row query block of its head group), the same
producer warp, preprocess and float32 dQ accumulator, the same launcher contract (plus ``variant``).
What changes is the schedule inside the two consumer warpgroups, where the shipped kernel leaves a
warpgroup's tensor-core queue empty while it waits for dK, for the other warpgroup's dS rows, and
for its own dQ tile.

The schedule of ``pipe``, per consumer warpgroup (64 keys), for query block t:

    (Sᵀ_t = K Q_tᵀ finished during step t−1, or in the prologue)
    dPᵀ_t = V dO_tᵀ issued; Pᵀ = exp2(Sᵀ·scale·log2 e − LSE·log2 e) while it runs
    dV += Pᵀ dO_t issued; wait dPᵀ_t, dV
    dSᵀ = Pᵀ ∘ (dPᵀ − D) · scale → dK += dSᵀ Q_t issued (dSᵀ from registers)
    dSᵀ rows stored to shared memory, published to the other warpgroup
    Sᵀ_{t+1} = K Q_{t+1}ᵀ issued                     ← new: under dK_t, the dS exchange and dQ_t
    wait dK_t (Sᵀ_{t+1} may still run); release Q_t / dO_t
    wait the other warpgroup's dSᵀ rows
    dQ_t[:, half] = dS_t K[:, half] issued            ← new: every step, half of dQ's columns each
    wait Sᵀ_{t+1} and dQ_t → dQ half to shared memory → the writer warp's bulk reduce-add

What changed against ``sm90_bwd.py``, and why it should be faster:

1. **Sᵀ of the next block is issued before this block's dK and dQ are waited for** (FA3's backward
   mainloop also keeps a wgmma in flight across its step boundary). The shipped kernel's queue is
   empty from "dK done" to its dQ, and from the dQ wait to the next step's Sᵀ; here Sᵀ_{t+1} runs
   across the dK wait, the dS exchange and dQ_t. On the last step the "next" block is this one again
   (one wasted Sᵀ per CTA, its result dropped): no branch around an async product. The loop carries
   the finished Sᵀ (a tensor), never an in-flight token: a token across the loop's edge made ptxas
   serialize every wgmma. dK is waited for before dQ is issued, so that dSᵀ's bf16 registers (dK's A
   operand) are free before dQ's accumulator is live; with dK, Sᵀ and dQ in flight together ptxas
   serialized at head dim 128.
2. **dQ split by columns, both warpgroups every step** (FA3's AtomLayoutMdQ = 1 at head dim 128):
   each computes dQ_t[:, which·D/2 : +D/2] over all 128 keys, instead of the whole tile on alternate
   steps. Its accumulator is half the registers (32 a thread at head dim 128), which is what lets
   Sᵀ_{t+1} (32) be in flight beside dK, dV and dQ: 64 + 64 + 32 + 32 = 192 of the 240 that
   setmaxnreg gives. The warpgroups do equal work every step, at the price of waiting for each other's
   dS every step (sm90_bwd's turns let the off-turn one run on).
3. **dQ by the copy engine, per half**: each warpgroup stages its half in its own buffer (per-warpgroup
   full/empty mbarriers) and the writer warp issues one ``cp.reduce.async.bulk.tensor`` per half as it
   arrives (box [1, 1, 64, D/2], unswizzled), so a warpgroup waits only for its own half's last reduce.

Variants (``VARIANTS``: name → {head dim: (DQ_SPLIT, PREFETCH_DP, PREFETCH_S)}):

* ``pipe`` (64, 128): the schedule above.
* ``pipe_dp`` (64 only): dPᵀ_{t+1} issued with Sᵀ_{t+1} too, so that a step starts with both scores
  finished (32 more registers; at head dim 128 it serialized every wgmma and spilled 512 bytes).
* ``pipe_turns`` (64 only): sm90_bwd's turns (whole dQ tile on alternate steps, two atomic writer
  warps, its head-dim-64 choice) with Sᵀ_{t+1} and dPᵀ_{t+1} prefetched as above: isolates (1).
* ``split`` (64, 128; nineteenth session): (2) and (3) without (1): Sᵀ_t issued at step t's start as in
  sm90_bwd, dQ split by columns every step, so that the next block's Sᵀ is not live beside dK, dV and dQ.
  ptxas: no spills at 64; at 128 4 / 4 B (full) and 28 / 44 B (causal), the shipped kernel's 4 / 4 and
  24 / 40, where ``pipe`` spills 72 / 72 and 92 / 100. Isolates the split dQ with sm90_bwd's registers.

ptxas (Triton 3.6's wheel, sm_90a, compiled on a CPU by ``python benchmarks/experiments/sm90_bwd_next.py``
with tests/test_gluon_compile.py's stand-in driver). "168 registers" is every variant's launch figure
(65536 / 384 threads); the consumers run at 240 by setmaxnreg, so spills and "serialized" are the
measure of pressure:

    kernel       d    full: spill st/ld B   causal: spill st/ld B   shared B   wgmma serialized
    current     64        0 / 0                 0 / 0              116256     no
    current    128       56 / 76              112 / 132            198176     no
    pipe        64        0 / 0                 0 / 0              116272     no
    pipe       128       92 / 136             160 / 212            198192     no
    pipe_dp     64        0 / 0                 0 / 0              116272     no
    pipe_turns  64        0 / 0                 0 / 0              116288     no

Since the nineteenth session ``current`` (sm90_bwd) stages dQ without 8-way bank conflicts and these variants
still stage it the old way: compare them with that in mind.

Ported in the eighteenth session to the accumulator in dQ's own layout and to sm90_bwd's register split
(232/24/24 at head dim 128; 16 for the producer and writer fails to compile): ``pipe`` d128 spills 72 / 72 B
(full) and 92 / 100 B (causal), 20 and 32 spill instructions in the SASS, all but 2 in consumer 1 (232
registers), where the shipped kernel, with the same split, has 2 and 16. Not rerun on a GPU since.

Measured (H100 80GB HBM3, torch 2.11, two runs of ``bwd_next_round.py`` on two machines, backward only,
16384 tokens; × cuDNN, current → variant): at head dim 128 ``pipe`` was 1.00–1.07× ``current`` in the
first run (full 0.909/0.938/0.951 against 0.890/0.914/0.889 at N = 2048/8192/16384) and 0.99–1.06×
in the second (full 0.880/0.949/0.905 against 0.876/0.892/0.890; causal 0.840/0.885/0.906 against
0.846/0.894/0.890): a gain at full attention, none at causal N ≤ 8192. At head dim 64 every variant
was slower than ``current``: ``pipe`` 0.89–0.95×, ``pipe_dp`` 0.90–0.96× (both runs), ``pipe_turns``
0.92–0.97× (second run only): at 64 the prefetch itself costs, not only the split dQ and its reduce.
All 60 correctness cases passed (flash-attn's rule against float64), in both runs.

Limits: those of ``flashtile.gluon.sm90_bwd`` (sm_90; bf16/fp16; head dims 64 and 128 — ``pipe`` — or 64;
full or causal; no bias, window, dropout, packed batches; descriptor-compatible strides). GPU only
(Gluon has no interpreter); ``benchmarks/experiments/bwd_next_round.py`` checks and times it against
the shipped kernel and cuDNN.
"""

import os
import subprocess
import sys

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

from flashtile.gluon import sm90_bwd
from flashtile.gluon.sm90_bwd import (_async_reduce_add, _bwd_preprocess_kernel, _dq_writer_atomics, _producer,
                                      _stats_descriptor)
from flashtile.gluon.sm90_fwd import descriptor

BLOCK_N, KEYS, BLOCK_M, NUM_STAGES = sm90_bwd.BLOCK_N, sm90_bwd.KEYS, sm90_bwd.BLOCK_M, sm90_bwd.NUM_STAGES
# name → {head dim: (DQ_SPLIT, PREFETCH_DP, PREFETCH_S)} at the head dims where the variant is worth running (the shipped
# kernel is "current"). DQ_SPLIT: each warpgroup computes half of dQ's columns every step (else the whole
# tile on alternate steps, as sm90_bwd, with its two atomic writer warps); PREFETCH_DP: dPᵀ_{t+1} issued
# with Sᵀ_{t+1}; PREFETCH_S: Sᵀ_{t+1} issued under step t's dK and dQ (else at step t + 1's start, as sm90_bwd).
# At head dim 128 PREFETCH_DP, and whole dQ tiles beside the next Sᵀ, serialized every wgmma
# for want of registers (ptxas), so only "pipe" runs there.
VARIANTS = {"pipe": {64: (True, False, True), 128: (True, False, True)}, "pipe_dp": {64: (True, True, True)},
            "pipe_turns": {64: (False, True, True)}, "split": {64: (True, False, False), 128: (True, False, False)}}


@aggregate
class _Tiling:
    # compile-time shape of one CTA's work, handed to every partition (see sm90_fwd._Tiling); the
    # imported sm90_bwd._producer reads BLOCK_M and NUM_STAGES of it
    CAUSAL: gl.constexpr
    BLOCK_M: gl.constexpr
    BLOCK_N: gl.constexpr
    KEYS: gl.constexpr  # keys per consumer warpgroup
    HEAD_DIM: gl.constexpr
    NUM_STAGES: gl.constexpr
    PREFETCH_DP: gl.constexpr
    DQ_SPLIT: gl.constexpr
    PREFETCH_S: gl.constexpr

    @gluon.constexpr_function
    def __init__(self, CAUSAL, BLOCK_M, BLOCK_N, KEYS, HEAD_DIM, NUM_STAGES, PREFETCH_DP, DQ_SPLIT, PREFETCH_S):
        self.CAUSAL = gl.constexpr(CAUSAL)
        self.BLOCK_M = gl.constexpr(BLOCK_M)
        self.BLOCK_N = gl.constexpr(BLOCK_N)
        self.KEYS = gl.constexpr(KEYS)
        self.HEAD_DIM = gl.constexpr(HEAD_DIM)
        self.NUM_STAGES = gl.constexpr(NUM_STAGES)
        self.PREFETCH_DP = gl.constexpr(PREFETCH_DP)
        self.DQ_SPLIT = gl.constexpr(DQ_SPLIT)
        self.PREFETCH_S = gl.constexpr(PREFETCH_S)


@gluon.jit
def _dq_writer(dq_desc, dq_smem, dq_full, dq_empty, i_b, i_hk, first_m, m_blocks, n_steps, group_size, tiling):
    """One warp: each step's two column halves of dQᵢ, each as soon as its warpgroup has staged it,
    added to the float32 accumulator by the copy engine; a half's buffer is handed back once the
    engine has read it (bulk groups complete in order: the first half's is waited for first)."""
    BLOCK_M: gl.constexpr = tiling.BLOCK_M
    HALF: gl.constexpr = tiling.HEAD_DIM // 2
    for t in range(n_steps):
        i_hq = i_hk * group_size + t // m_blocks
        start_m = (first_m + t % m_blocks) * BLOCK_M
        for w in gl.static_range(2):
            mbarrier.wait(dq_full.index(w), t & 1)
            _async_reduce_add(dq_desc, [i_b, start_m, i_hq, w * HALF], dq_smem.index(w))
        tma.store_wait(1)
        mbarrier.arrive(dq_empty.index(0))
        tma.store_wait(0)
        mbarrier.arrive(dq_empty.index(1))


@gluon.jit
def _consumer(which, k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, ds_smem, dq_smem, kv_ready, q_ready,
              do_ready, empty, ds_ready, dq_full, dq_empty, DK, DV, stride_dkb, stride_dks, stride_dkh, stride_dvb,
              stride_dvs, stride_dvh, i_b, i_hk, start_n, first_m, m_blocks, n_steps, group_size, seqlen_q, seqlen_k,
              diagonal, qk_scale, sm_scale, tiling):
    """One warpgroup: keys [start_n + which·KEYS, +KEYS) against every query block of the group, and
    columns [which·HEAD_DIM/2, +HEAD_DIM/2) of every dQᵢ (DQ_SPLIT) or every other whole dQᵢ."""
    CAUSAL: gl.constexpr = tiling.CAUSAL
    BLOCK_M: gl.constexpr = tiling.BLOCK_M
    BLOCK_N: gl.constexpr = tiling.BLOCK_N
    KEYS: gl.constexpr = tiling.KEYS
    HEAD_DIM: gl.constexpr = tiling.HEAD_DIM
    DQ_SPLIT: gl.constexpr = tiling.DQ_SPLIT
    HALF: gl.constexpr = HEAD_DIM // 2 if DQ_SPLIT else HEAD_DIM  # dQ columns per warpgroup and step
    NUM_STAGES: gl.constexpr = tiling.NUM_STAGES
    PREFETCH_DP: gl.constexpr = tiling.PREFETCH_DP
    PREFETCH_S: gl.constexpr = tiling.PREFETCH_S
    IN_FLIGHT: gl.constexpr = (1 if PREFETCH_S else 0) + (1 if PREFETCH_DP else 0)  # next scores beside dK
    st_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, BLOCK_M, 16])  # Sᵀ, dPᵀ
    kv_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, HEAD_DIM, 16])  # dK, dV
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, HALF, 16])  # this warpgroup's dQ part
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=kv_layout, k_width=2)
    dtype: gl.constexpr = q_smem.dtype

    my_start = start_n + which * KEYS
    keys = my_start + gl.arange(0, KEYS, layout=gl.SliceLayout(1, st_layout))
    k_all = k_smem.reshape([BLOCK_N, HEAD_DIM])  # [BLOCK_N, HEAD_DIM]
    k_mine = k_all.slice(which * KEYS, KEYS, dim=0)  # [KEYS, HEAD_DIM]
    v_mine = v_smem.reshape([BLOCK_N, HEAD_DIM]).slice(which * KEYS, KEYS, dim=0)
    if DQ_SPLIT:
        k_cols = k_all.slice(which * HALF, HALF, dim=1)  # [BLOCK_N, HALF]: dQ's B operand
        dq_tile = dq_smem.index(which).reshape([BLOCK_M, HALF])  # [BLOCK_M, HALF] float32
    else:
        k_cols = k_all
        dq_tile = dq_smem  # [BLOCK_M, HEAD_DIM] float32, read by the two atomic writer warps
    dk = gl.zeros([KEYS, HEAD_DIM], gl.float32, layout=kv_layout)
    dv = gl.zeros([KEYS, HEAD_DIM], gl.float32, layout=kv_layout)
    st_unused = gl.zeros([KEYS, BLOCK_M], gl.float32, layout=st_layout)  # use_acc=False ignores it
    dq_unused = gl.zeros([BLOCK_M, HALF], gl.float32, layout=dq_layout)
    # the last key that a query block ending before the diagonal's band can see unmasked
    band_end = gl.minimum(start_n + BLOCK_N, seqlen_k) - 1
    mbarrier.wait(kv_ready, 0)

    if n_steps > 0:
        if PREFETCH_S:
            # -- prologue: step 0's Sᵀ (and dPᵀ), waited for here: the loop carries finished scores, never an
            # async token (ptxas serialized every wgmma when one crossed the loop's edge in flight)
            mbarrier.wait(q_ready.index(0), 0)
            s_token = warpgroup_mma(k_mine, q_smem.index(0).reshape([BLOCK_M, HEAD_DIM]).permute((1, 0)), st_unused,
                                    use_acc=False, is_async=True)
            if PREFETCH_DP:
                mbarrier.wait(do_ready.index(0), 0)
                dp_token = warpgroup_mma(v_mine, do_smem.index(0).reshape([BLOCK_M, HEAD_DIM]).permute((1, 0)),
                                         st_unused, use_acc=False, is_async=True)
                s, dp = warpgroup_mma_wait(0, deps=(s_token, dp_token))
            else:
                s = warpgroup_mma_wait(0, deps=(s_token, ))
        for t in range(n_steps):
            stage = t % NUM_STAGES
            phase = (t // NUM_STAGES) & 1
            start_m = (first_m + t % m_blocks) * BLOCK_M
            rows = start_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, st_layout))
            q_tile = q_smem.index(stage).reshape([BLOCK_M, HEAD_DIM])  # [BLOCK_M, HEAD_DIM]
            do_tile = do_smem.index(stage).reshape([BLOCK_M, HEAD_DIM])

            # -- dPᵀ = V dOᵀ issued (unless step t−1 did), Pᵀ from Sᵀ [KEYS, BLOCK_M], which step t−1 (or
            # the prologue) computed, while it runs; without PREFETCH_S, Sᵀ first, as sm90_bwd
            if not PREFETCH_S:
                mbarrier.wait(q_ready.index(stage), phase)
                s_token = warpgroup_mma(k_mine, q_tile.permute((1, 0)), st_unused, use_acc=False, is_async=True)
            if not PREFETCH_DP:
                mbarrier.wait(do_ready.index(stage), phase)
                dp_token = warpgroup_mma(v_mine, do_tile.permute((1, 0)), st_unused, use_acc=False, is_async=True)
            # LSE·log2 e and D come through shared memory, read where used (sm90_bwd: held in registers
            # they made the kernel spill)
            lse2 = lse_smem.index(stage).reshape([BLOCK_M]).load(gl.SliceLayout(0, st_layout))  # [BLOCK_M]
            if PREFETCH_S:
                scores = s
            else:
                scores = warpgroup_mma_wait(1, deps=(s_token, ))
            p = gl.exp2(scores * qk_scale - gl.expand_dims(lse2, 0))
            # only blocks that cross the end of the keys or the causal diagonal pay for masking
            needs_mask = start_n + BLOCK_N > seqlen_k
            if CAUSAL:
                needs_mask = needs_mask | (start_m + diagonal < band_end)
            if needs_mask:
                visible = gl.expand_dims(keys < seqlen_k, 1)
                if CAUSAL:
                    visible = visible & (gl.expand_dims(keys, 1) <= gl.expand_dims(rows + diagonal, 0))
                p = gl.where(visible, p, 0.0)
            p_low = p.to(dtype)
            dv_token = warpgroup_mma(gl.convert_layout(p_low, a_layout), do_tile, dv, is_async=True)
            delta = delta_smem.index(stage).reshape([BLOCK_M]).load(gl.SliceLayout(0, st_layout))
            if PREFETCH_DP:
                dv = warpgroup_mma_wait(0, deps=(dv_token, ))
            else:
                dp, dv = warpgroup_mma_wait(0, deps=(dp_token, dv_token))

            # -- dSᵀ = Pᵀ ∘ (dPᵀ − D) · scale; dK += dSᵀ Q
            ds_low = (p * (dp - gl.expand_dims(delta, 0)) * sm_scale).to(dtype)  # [KEYS, BLOCK_M]
            dk_token = warpgroup_mma(gl.convert_layout(ds_low, a_layout), q_tile, dk, is_async=True)
            # publish this warpgroup's dSᵀ rows: dQ needs all 128 keys
            ds_buffer = ds_smem.index(t % 2)  # [BLOCK_N, BLOCK_M]
            ds_buffer.slice(which * KEYS, KEYS, dim=0).store(ds_low)
            fence_async_shared()
            gl.thread_barrier()  # every thread's rows are stored before the one arrival
            mbarrier.arrive(ds_ready.index(t % 2))

            # -- the next block's Sᵀ (dPᵀ) under dK_t and the exchange; on the last step the block is
            # this one again, already resident, and the product is waited for after the loop unused
            nxt = gl.minimum(t + 1, n_steps - 1)
            nxt_stage = nxt % NUM_STAGES
            nxt_phase = (nxt // NUM_STAGES) & 1
            if PREFETCH_S:
                mbarrier.wait(q_ready.index(nxt_stage), nxt_phase)
                s_token = warpgroup_mma(k_mine, q_smem.index(nxt_stage).reshape([BLOCK_M, HEAD_DIM]).permute((1, 0)),
                                        st_unused, use_acc=False, is_async=True)
            if PREFETCH_DP:
                mbarrier.wait(do_ready.index(nxt_stage), nxt_phase)
                dp_token = warpgroup_mma(v_mine,
                                         do_smem.index(nxt_stage).reshape([BLOCK_M, HEAD_DIM]).permute((1, 0)),
                                         st_unused, use_acc=False, is_async=True)

            # -- dK_t complete, the next scores may still run: dSᵀ's registers (dK's A operand) are free
            # before dQ's accumulator is needed
            dk = warpgroup_mma_wait(IN_FLIGHT, deps=(dk_token, ))
            mbarrier.arrive(empty.index(stage))  # Q_t and dO_t are read

            if DQ_SPLIT:
                # -- dQ_t[:, half] = dS_t K[:, half] over both warpgroups' keys, the next scores in flight
                mbarrier.wait(ds_ready.index(t % 2), (t // 2) & 1)
                dq_token = warpgroup_mma(ds_buffer.permute((1, 0)), k_cols, dq_unused, use_acc=False, is_async=True)
                if PREFETCH_DP:
                    s, dp, dq = warpgroup_mma_wait(0, deps=(s_token, dp_token, dq_token))
                elif PREFETCH_S:
                    s, dq = warpgroup_mma_wait(0, deps=(s_token, dq_token))  # dq: [BLOCK_M, HALF]
                else:
                    dq = warpgroup_mma_wait(0, deps=(dq_token, ))
                # -- hand the half to the writer warp, once it has taken the previous step's
                mbarrier.wait(dq_empty.index(which), (t & 1) ^ 1)
                dq_tile.store(dq)
                fence_async_shared()  # the stores, made visible to the copy engine
                gl.thread_barrier()
                mbarrier.arrive(dq_full.index(which))
            elif t % 2 == which:
                # -- the whole dQ_t on this warpgroup's turn (sm90_bwd's turns), the next scores in flight
                mbarrier.wait(ds_ready.index(t % 2), (t // 2) & 1)
                dq_token = warpgroup_mma(ds_buffer.permute((1, 0)), k_cols, dq_unused, use_acc=False, is_async=True)
                if PREFETCH_DP:
                    s, dp, dq = warpgroup_mma_wait(0, deps=(s_token, dp_token, dq_token))
                else:
                    s, dq = warpgroup_mma_wait(0, deps=(s_token, dq_token))  # dq: [BLOCK_M, HEAD_DIM]
                mbarrier.wait(dq_empty.index(0), (t & 1) ^ 1)
                dq_tile.store(dq)
                gl.thread_barrier()
                mbarrier.arrive(dq_full.index(0))
            else:
                if PREFETCH_DP:
                    s, dp = warpgroup_mma_wait(0, deps=(s_token, dp_token))
                elif PREFETCH_S:
                    s = warpgroup_mma_wait(0, deps=(s_token, ))
        # the last step's extra Sᵀ (dPᵀ), of its own block again, is dropped: nothing is in flight

    # -- dK and dV rows of this warpgroup's keys, straight from registers
    out_keys = my_start + gl.arange(0, KEYS, layout=gl.SliceLayout(1, kv_layout))
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, kv_layout))
    in_k = gl.expand_dims(out_keys < seqlen_k, 1)
    gl.store(DK + i_b * stride_dkb + i_hk * stride_dkh + gl.expand_dims(out_keys, 1) * stride_dks
             + gl.expand_dims(cols, 0), dk.to(dtype), mask=in_k)
    gl.store(DV + i_b * stride_dvb + i_hk * stride_dvh + gl.expand_dims(out_keys, 1) * stride_dvs
             + gl.expand_dims(cols, 0), dv.to(dtype), mask=in_k)


@gluon.jit
def _attn_bwd_sm90_next_kernel(q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc, dq_desc, DK, DV, DQAccum,
                               stride_dkb, stride_dks, stride_dkh, stride_dvb, stride_dvs, stride_dvh, stride_ab,
                               stride_as, stride_ah, group_size, seqlen_q, seqlen_k, qk_scale, sm_scale,
                               CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, KEYS: gl.constexpr,
                               HEAD_DIM: gl.constexpr, NUM_STAGES: gl.constexpr, PREFETCH_DP: gl.constexpr,
                               DQ_SPLIT: gl.constexpr, PREFETCH_S: gl.constexpr):
    i_n = gl.program_id(0)  # under causal masking the first key blocks have the most queries: first
    i_hk = gl.program_id(1)
    i_b = gl.program_id(2)
    start_n = i_n * BLOCK_N
    diagonal = seqlen_k - seqlen_q  # bottom-right alignment
    if CAUSAL:  # the first query that sees key start_n is start_n − diagonal
        first_m = gl.maximum(start_n - diagonal, 0) // BLOCK_M
    else:
        first_m = 0
    m_blocks = gl.maximum(gl.cdiv(seqlen_q, BLOCK_M) - first_m, 0)
    n_steps = group_size * m_blocks

    dtype: gl.constexpr = q_desc.dtype
    HALF: gl.constexpr = HEAD_DIM // 2
    # tiles keep the descriptors' [1, rows, 1, HEAD_DIM] boxes; the consumers view them as 2-D
    k_smem = gl.allocate_shared_memory(dtype, [1, BLOCK_N, 1, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [1, BLOCK_N, 1, HEAD_DIM], v_desc.layout)
    q_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, 1, BLOCK_M, 1, HEAD_DIM], q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, 1, BLOCK_M, 1, HEAD_DIM], do_desc.layout)
    lse_smem = gl.allocate_shared_memory(gl.float32, [NUM_STAGES, 1, 1, BLOCK_M], lse_desc.layout)
    delta_smem = gl.allocate_shared_memory(gl.float32, [NUM_STAGES, 1, 1, BLOCK_M], delta_desc.layout)
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], dtype)
    ds_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, BLOCK_M], ds_layout)
    if DQ_SPLIT:  # each warpgroup's dQ column half on its way to the writer, in the accumulator descriptor's box
        dq_smem = gl.allocate_shared_memory(gl.float32, [2, 1, BLOCK_M, 1, HALF], dq_desc.layout)
    else:  # sm90_bwd's staging for its atomic writer warps before its bank-conflict fix (nineteenth session)
        dq_layout: gl.constexpr = gl.SwizzledSharedLayout(vec=2, per_phase=1, max_phase=4, order=[1, 0])
        dq_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_M, HEAD_DIM], dq_layout)
    kv_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    do_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    ds_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    dq_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    dq_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_ready, count=1)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(do_ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # both consumers release a buffer
    for i in gl.static_range(2):
        mbarrier.init(ds_ready.index(i), count=2)  # both warpgroups' rows are in
        mbarrier.init(dq_full.index(i), count=1)  # per warpgroup's half (DQ_SPLIT), else [0] only
        mbarrier.init(dq_empty.index(i), count=1 if DQ_SPLIT else 2)  # else both writer warps have read

    tiling = _Tiling(CAUSAL, BLOCK_M, BLOCK_N, KEYS, HEAD_DIM, NUM_STAGES, PREFETCH_DP, DQ_SPLIT, PREFETCH_S)
    consumer = (k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, ds_smem, dq_smem, kv_ready, q_ready, do_ready,
                empty, ds_ready, dq_full, dq_empty, DK, DV, stride_dkb, stride_dks, stride_dkh, stride_dvb, stride_dvs,
                stride_dvh, i_b, i_hk, start_n, first_m, m_blocks, n_steps, group_size, seqlen_q, seqlen_k, diagonal,
                qk_scale, sm_scale, tiling)
    producer = (q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc, k_smem, v_smem, q_smem, do_smem, lse_smem,
                delta_smem, kv_ready, q_ready, do_ready, empty, i_b, i_hk, start_n, first_m, m_blocks, n_steps,
                group_size, tiling)
    # the kernel's own 4 warps are consumer 0, which setmaxnreg gives what the other partitions leave; the
    # producer and the writers share a warpgroup, which setmaxnreg sets as a whole. At head dim 128 sm90_bwd's
    # split (consumer 0 at 248, consumer 1 at 232)
    if DQ_SPLIT:
        writer = (dq_desc, dq_smem, dq_full, dq_empty, i_b, i_hk, first_m, m_blocks, n_steps, group_size, tiling)
        gl.warp_specialize([(_consumer, (0, ) + consumer), (_consumer, (1, ) + consumer), (_producer, producer),
                            (_dq_writer, writer)], [4, 1, 1], [232, 24, 24] if HEAD_DIM == 128 else [240, 32, 32])
    else:
        writer = (dq_smem, dq_full.index(0), dq_empty.index(0), DQAccum, stride_ab, stride_as, stride_ah, i_b, i_hk, first_m,
                  m_blocks, n_steps, group_size, tiling)
        gl.warp_specialize([(_consumer, (0, ) + consumer), (_consumer, (1, ) + consumer), (_producer, producer),
                            (_dq_writer_atomics, (0, ) + writer), (_dq_writer_atomics, (1, ) + writer)],
                           [4, 1, 1, 1], [240, 32, 32, 32])


def _half_accumulator_descriptor(t: torch.Tensor) -> TensorDescriptor:
    """A descriptor over the [batch, padded seqlen, nheads, head_dim] float32 dQ accumulator whose box
    is one block's rows of one head and half its columns, unswizzled (sm90_bwd's box before the nineteenth
    session: stores from the wgmma layout meet 8-way bank conflicts here, which sm90_bwd no longer has)."""
    layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=4)
    return TensorDescriptor(t, list(t.shape), list(t.stride()), [1, BLOCK_M, 1, t.shape[-1] // 2], layout)


def _kernel_arguments(q, k, v, dout, lse2, delta, dq_accum, dk, dv, softmax_scale, causal, variant):
    head_dim = q.shape[-1]
    return dict(
        q_desc=descriptor(q, BLOCK_M), k_desc=descriptor(k, BLOCK_N), v_desc=descriptor(v, BLOCK_N),
        do_desc=descriptor(dout, BLOCK_M), lse_desc=_stats_descriptor(lse2), delta_desc=_stats_descriptor(delta),
        dq_desc=_half_accumulator_descriptor(dq_accum), DK=dk, DV=dv, DQAccum=dq_accum,
        stride_dkb=dk.stride(0), stride_dks=dk.stride(1), stride_dkh=dk.stride(2),
        stride_dvb=dv.stride(0), stride_dvs=dv.stride(1), stride_dvh=dv.stride(2),
        stride_ab=dq_accum.stride(0), stride_as=dq_accum.stride(1), stride_ah=dq_accum.stride(2),
        group_size=q.shape[2] // k.shape[2], seqlen_q=q.shape[1], seqlen_k=k.shape[1],
        qk_scale=softmax_scale * 1.4426950408889634, sm_scale=softmax_scale,
        CAUSAL=causal, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, KEYS=KEYS, HEAD_DIM=head_dim, NUM_STAGES=NUM_STAGES,
        DQ_SPLIT=VARIANTS[variant][head_dim][0], PREFETCH_DP=VARIANTS[variant][head_dim][1],
        PREFETCH_S=VARIANTS[variant][head_dim][2], num_warps=4,
    )


def flash_attn_backward_sm90(dout, q, k, v, out, lse, dq, dk, dv, softmax_scale: float, causal: bool,
                             variant: str = "pipe") -> torch.Tensor:
    """What ``flashtile.triton.launch.attention_backward``'s fused sm_90 path computes (for the same
    inputs), by the variant named (a key of ``VARIANTS``). Writes dq/dk/dv; → D = rowsum(dO ∘ O)
    [B, Hq, Nq] float32."""
    batch, seqlen_q, nheads_q, head_dim = q.shape
    seqlen_k = k.shape[1]
    lse2, delta, dq_accum = sm90_bwd.backward_buffers(q)
    padded_q = lse2.shape[-1]
    _bwd_preprocess_kernel[(padded_q // BLOCK_M, nheads_q, batch)](
        o_desc=descriptor(out, BLOCK_M), do_desc=descriptor(dout, BLOCK_M), Lse=lse, Lse2=lse2, Delta=delta,
        DQAccum=dq_accum, stride_lb=lse.stride(0), stride_lh=lse.stride(1), stride_pb=lse2.stride(0),
        stride_ph=lse2.stride(1), stride_ab=dq_accum.stride(0), stride_as=dq_accum.stride(1),
        stride_ah=dq_accum.stride(2), seqlen_q=seqlen_q,
        ROWS=BLOCK_M, HEAD_DIM=head_dim, num_warps=4,
    )
    _attn_bwd_sm90_next_kernel[(-(-seqlen_k // BLOCK_N), k.shape[2], batch)](
        **_kernel_arguments(q, k, v, dout, lse2, delta, dq_accum, dk, dv, softmax_scale, causal, variant))
    dq.copy_(dq_accum[:, :seqlen_q])
    return delta[:, :, :seqlen_q]


# ----------------------------------------------------------------------------------------------
# Compiled for sm_90a without a GPU (the stand-in driver of tests/test_gluon_compile.py)


def compile_sm90(variant: str, head_dim: int, causal: bool):
    """The variant's main kernel compiled for sm_90a as the launcher would launch it; CPU tensors stand
    in (compiling reads only dtypes, shapes, strides and alignment). The caller sets the driver."""
    q = torch.empty(2, 1024, 4, head_dim, dtype=torch.bfloat16)
    stats = torch.empty(2, 4, 1024)
    accum = torch.empty(2, 1024, 4, head_dim)
    return _attn_bwd_sm90_next_kernel.warmup(
        **_kernel_arguments(q, q, q, q, stats, stats, accum, q, q, 0.07, causal, variant), grid=(1, ))


def ptxas_report(kernel, workdir: str) -> str:
    """ptxas's -v lines (registers, spills, serialized wgmma) for a compiled kernel."""
    from triton.backends.nvidia.compiler import get_ptxas
    path = os.path.join(workdir, "kernel.ptx")
    with open(path, "w") as f:
        f.write(kernel.asm["ptx"])
    result = subprocess.run([get_ptxas(90).path, "-arch=sm_90a", "-v", path, "-o", os.devnull],
                            capture_output=True, text=True, check=True)
    return "\n".join(line.strip() for line in (result.stdout + result.stderr).splitlines()
                     if "spill" in line or "Used" in line or "serialized" in line or "warning" in line)


if __name__ == "__main__":
    # TRITON_INTERPRET=0 PYTHONPATH=src:tests python benchmarks/experiments/sm90_bwd_next.py [workdir]
    import tempfile

    import triton
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))
    from test_gluon_compile import _Sm90Target
    triton.runtime.driver.set_active(_Sm90Target())
    workdir = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp()
    for name, head_dims in VARIANTS.items():
        for head_dim in head_dims:
            for causal in (False, True):
                kernel = compile_sm90(name, head_dim, causal)
                report = ptxas_report(kernel, workdir).replace("\n", " | ")
                print(f"{name:8s} d{head_dim:<3d} {'causal' if causal else 'full  '} shared {kernel.metadata.shared} "
                      f"B | {report}", flush=True)
