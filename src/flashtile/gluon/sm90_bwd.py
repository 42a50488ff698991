"""The backward on Hopper (sm_90) in Gluon: one fused kernel, FlashAttention-3's schedule.

The portable backward (``flashtile.triton.attention``) runs two kernels, dK/dV then dQ, and each
recomputes S = QKᵀ and dP = dO Vᵀ: 7 matmuls where 5 are needed (benchmarks/NOTES.md, "The
profile"). Here one CTA owns a block of ``BLOCK_N`` = 128 keys of one KV head and walks every query
block of every query head of its group:

* a **producer warp** moves K and V once, then Q_i and dO_i into a ring of ``NUM_STAGES`` buffers
  with the tensor copy engine (TMA), each guarded by "ready" mbarriers and one "empty" mbarrier;
* **two consumer warpgroups** own 64 keys each and keep their dK and dV accumulators in registers
  for the whole walk. Per query block of ``BLOCK_M`` rows, transposed so that the keys are wgmma's
  M dimension:

  - ``Sᵀ = K Qᵢᵀ`` and ``dPᵀ = V dOᵢᵀ`` are issued together; ``Pᵀ = exp2(Sᵀ·scale·log2 e − LSE·log2 e)``
    is computed while dPᵀ still runs;
  - ``dV += Pᵀ dOᵢ`` (Pᵀ from registers), ``dSᵀ = Pᵀ ∘ (dPᵀ − Dᵢ) · scale``, ``dK += dSᵀ Qᵢ``;
  - dQᵢ needs all 128 keys, so each warpgroup stores its dSᵀ rows to shared memory (two buffers,
    alternating), both meet at an mbarrier, and each computes half of ``dQᵢ = dS K`` (half the
    columns at head dim 128, half the rows at 64, where BLOCK_M = 128) and adds it to a float32
    accumulator in global memory with atomic adds. The launcher converts that to dQ's dtype.

  The softmax scale is folded into dS, so dK and dQ need no scaling afterwards.

The atomic adds make dQ's summation order, and so its last bits, vary run to run: this kernel is
the default, and ``deterministic=True`` takes the two-kernel Triton backward, which has no atomics
(the choice and its cost: README, benchmarks/NOTES.md).

Conventions are those of ``flashtile.triton.attention``: (batch, seqlen, nheads, head_dim) tensors,
GQA by ``h // (nheads_q // nheads_k)``, bottom-right causal alignment (key ``j`` visible to query
``i`` iff ``j ≤ i + Nk − Nq``, the rule of ``flashtile.triton.scores`` written again in Gluon), the
log-sum-exp in natural log. A query row that saw no key (LSE −inf) and rows past the end get P = 0.

Limits (``flashtile.triton.launch.attention_backward`` sends everything else to the Triton kernels):
sm_90 only; bf16/fp16; head dims 64 and 128; full or causal attention without bias, ALiBi,
softcap, window, dropout or packed batches; Q, K, V and dO whose strides the copy engine accepts.
Gluon has no interpreter, so this file is tested on the GPU only (tests/test_hopper.py).
"""

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

from .sm90_fwd import descriptor

# Keys per CTA, split between the two consumer warpgroups, and query rows per step: 64-row steps keep
# dK, dV, Sᵀ and dPᵀ near the 240 registers a thread that setmaxnreg gives (128-row steps at head dim
# 64, FA3's tile, spilled several times more under Triton's register allocation).
BLOCK_N, KEYS, BLOCK_M, NUM_STAGES = 128, 64, 64, 2


@aggregate
class _Tiling:
    # compile-time shape of one CTA's work, handed to every partition (see sm90_fwd._Tiling)
    CAUSAL: gl.constexpr
    BLOCK_M: gl.constexpr
    BLOCK_N: gl.constexpr
    KEYS: gl.constexpr  # keys per consumer warpgroup
    HEAD_DIM: gl.constexpr
    NUM_STAGES: gl.constexpr

    @gluon.constexpr_function
    def __init__(self, CAUSAL, BLOCK_M, BLOCK_N, KEYS, HEAD_DIM, NUM_STAGES):
        self.CAUSAL = gl.constexpr(CAUSAL)
        self.BLOCK_M = gl.constexpr(BLOCK_M)
        self.BLOCK_N = gl.constexpr(BLOCK_N)
        self.KEYS = gl.constexpr(KEYS)
        self.HEAD_DIM = gl.constexpr(HEAD_DIM)
        self.NUM_STAGES = gl.constexpr(NUM_STAGES)


@gluon.jit
def _producer(q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc, k_smem, v_smem, q_smem, do_smem, lse_smem,
              delta_smem, kv_ready, q_ready, do_ready, empty, i_b, i_hk, start_n, first_m, m_blocks, n_steps,
              group_size, tiling):
    """One warp: K and V once, then (Qᵢ, LSEᵢ) and (dOᵢ, Dᵢ) for every step, a buffer refilled once
    both consumers freed it."""
    BLOCK_M: gl.constexpr = tiling.BLOCK_M
    NUM_STAGES: gl.constexpr = tiling.NUM_STAGES
    mbarrier.expect(kv_ready, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [i_b, start_n, i_hk, 0], kv_ready, k_smem)
    tma.async_copy_global_to_shared(v_desc, [i_b, start_n, i_hk, 0], kv_ready, v_smem)
    for t in range(n_steps):
        stage = t % NUM_STAGES
        # a fresh mbarrier counts the phase before its first as complete: the first lap passes
        mbarrier.wait(empty.index(stage), ((t // NUM_STAGES) & 1) ^ 1)
        i_hq = i_hk * group_size + t // m_blocks
        start_m = (first_m + t % m_blocks) * BLOCK_M
        mbarrier.expect(q_ready.index(stage), q_desc.block_type.nbytes + lse_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [i_b, start_m, i_hq, 0], q_ready.index(stage), q_smem.index(stage))
        tma.async_copy_global_to_shared(lse_desc, [i_b, i_hq, start_m], q_ready.index(stage), lse_smem.index(stage))
        mbarrier.expect(do_ready.index(stage), do_desc.block_type.nbytes + delta_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(do_desc, [i_b, start_m, i_hq, 0], do_ready.index(stage),
                                        do_smem.index(stage))
        tma.async_copy_global_to_shared(delta_desc, [i_b, i_hq, start_m], do_ready.index(stage),
                                        delta_smem.index(stage))


@gluon.jit
def _consumer(which, k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, ds_smem, kv_ready, q_ready, do_ready,
              empty, ds_ready, DK, DV, DQAccum, stride_dkb, stride_dks, stride_dkh, stride_dvb, stride_dvs, stride_dvh,
              stride_ab, stride_ah, i_b, i_hk, start_n, first_m, m_blocks,
              n_steps, group_size, seqlen_q, seqlen_k, diagonal, qk_scale, sm_scale, tiling):
    """One warpgroup: keys [start_n + which·KEYS, +KEYS) against every query block of the group."""
    CAUSAL: gl.constexpr = tiling.CAUSAL
    BLOCK_M: gl.constexpr = tiling.BLOCK_M
    BLOCK_N: gl.constexpr = tiling.BLOCK_N
    KEYS: gl.constexpr = tiling.KEYS
    HEAD_DIM: gl.constexpr = tiling.HEAD_DIM
    NUM_STAGES: gl.constexpr = tiling.NUM_STAGES
    # dQᵢ [BLOCK_M, HEAD_DIM] is shared out by columns (64 each) at head dim 128; at 64 the warpgroups
    # take turns, one computing the whole of it per step
    DQ_BY_TURNS: gl.constexpr = HEAD_DIM == 64
    DQ_COLS: gl.constexpr = HEAD_DIM if DQ_BY_TURNS else HEAD_DIM // 2
    st_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, BLOCK_M, 16])  # Sᵀ, dPᵀ
    kv_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, HEAD_DIM, 16])  # dK, dV
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, DQ_COLS, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=kv_layout, k_width=2)
    dtype: gl.constexpr = q_smem.dtype

    my_start = start_n + which * KEYS
    keys = my_start + gl.arange(0, KEYS, layout=gl.SliceLayout(1, st_layout))
    k_all = k_smem.reshape([BLOCK_N, HEAD_DIM])  # [BLOCK_N, HEAD_DIM]
    k_mine = k_all.slice(which * KEYS, KEYS, dim=0)  # [KEYS, HEAD_DIM]
    v_mine = v_smem.reshape([BLOCK_N, HEAD_DIM]).slice(which * KEYS, KEYS, dim=0)
    if DQ_BY_TURNS:
        dq_b = k_all  # [BLOCK_N, HEAD_DIM]
        dq_offset = 0
    else:
        dq_b = k_all.slice(which * DQ_COLS, DQ_COLS, dim=1)  # [BLOCK_N, DQ_COLS]
        dq_offset = which * DQ_COLS
    dk = gl.zeros([KEYS, HEAD_DIM], gl.float32, layout=kv_layout)
    dv = gl.zeros([KEYS, HEAD_DIM], gl.float32, layout=kv_layout)
    st_unused = gl.zeros([KEYS, BLOCK_M], gl.float32, layout=st_layout)  # use_acc=False ignores it
    dq_unused = gl.zeros([BLOCK_M, DQ_COLS], gl.float32, layout=dq_layout)
    # [BLOCK_M, DQ_COLS] offsets into the accumulator, [B, Hq, padded Nq, HEAD_DIM]: compile-time constants
    dq_tile = (gl.expand_dims(gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, dq_layout)), 1) * HEAD_DIM
               + gl.expand_dims(gl.arange(0, DQ_COLS, layout=gl.SliceLayout(0, dq_layout)), 0))
    # the last key that a query block ending before the diagonal's band can see unmasked
    band_end = gl.minimum(start_n + BLOCK_N, seqlen_k) - 1
    mbarrier.wait(kv_ready, 0)

    for t in range(n_steps):
        stage = t % NUM_STAGES
        phase = (t // NUM_STAGES) & 1
        i_hq = i_hk * group_size + t // m_blocks
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
        p = gl.exp2(s * qk_scale - gl.expand_dims(lse2, 0))
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
        dp = warpgroup_mma_wait(1, deps=(dp_token, ))  # dV may still run

        # -- dSᵀ = Pᵀ ∘ (dPᵀ − D) · scale; dK += dSᵀ Q
        ds_low = (p * (dp - gl.expand_dims(delta, 0)) * sm_scale).to(dtype)  # [KEYS, BLOCK_M]
        dk_token = warpgroup_mma(gl.convert_layout(ds_low, a_layout), q_tile, dk, is_async=True)

        # -- dQ = dS K over both warpgroups' keys: publish this one's dSᵀ rows, wait for the other's
        ds_buffer = ds_smem.index(t % 2)  # [BLOCK_N, BLOCK_M]
        ds_buffer.slice(which * KEYS, KEYS, dim=0).store(ds_low)
        fence_async_shared()
        gl.thread_barrier()  # every thread's rows are stored before the one arrival
        mbarrier.arrive(ds_ready.index(t % 2))
        mbarrier.wait(ds_ready.index(t % 2), (t // 2) & 1)
        ds_all = ds_buffer.permute((1, 0))  # [BLOCK_M, BLOCK_N]
        if (not DQ_BY_TURNS) or t % 2 == which:
            dq_token = warpgroup_mma(ds_all, dq_b, dq_unused, use_acc=False, is_async=True)
            dv, dk, dq = warpgroup_mma_wait(0, deps=(dv_token, dk_token, dq_token))
            mbarrier.arrive(empty.index(stage))  # Qᵢ and dOᵢ are read
            # the accumulator's rows are padded to whole blocks: no mask, and only the base varies
            dq_base = DQAccum + i_b * stride_ab + i_hq * stride_ah + start_m * HEAD_DIM + dq_offset
            gl.atomic_add(dq_base + dq_tile, dq, sem="relaxed")
        else:
            dv, dk = warpgroup_mma_wait(0, deps=(dv_token, dk_token))
            mbarrier.arrive(empty.index(stage))

    # -- dK and dV rows of this warpgroup's keys, straight from registers
    out_keys = my_start + gl.arange(0, KEYS, layout=gl.SliceLayout(1, kv_layout))
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, kv_layout))
    in_k = gl.expand_dims(out_keys < seqlen_k, 1)
    gl.store(DK + i_b * stride_dkb + i_hk * stride_dkh + gl.expand_dims(out_keys, 1) * stride_dks
             + gl.expand_dims(cols, 0), dk.to(dtype), mask=in_k)
    gl.store(DV + i_b * stride_dvb + i_hk * stride_dvh + gl.expand_dims(out_keys, 1) * stride_dvs
             + gl.expand_dims(cols, 0), dv.to(dtype), mask=in_k)


@gluon.jit
def _attn_bwd_sm90_kernel(q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc, DK, DV, DQAccum,
                          stride_dkb, stride_dks, stride_dkh, stride_dvb, stride_dvs, stride_dvh, stride_ab, stride_ah,
                          group_size, seqlen_q, seqlen_k, qk_scale, sm_scale,
                          CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, KEYS: gl.constexpr,
                          HEAD_DIM: gl.constexpr, NUM_STAGES: gl.constexpr):
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
    # tiles keep the descriptors' [1, rows, 1, HEAD_DIM] boxes; the consumers view them as 2-D
    k_smem = gl.allocate_shared_memory(dtype, [1, BLOCK_N, 1, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [1, BLOCK_N, 1, HEAD_DIM], v_desc.layout)
    q_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, 1, BLOCK_M, 1, HEAD_DIM], q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, 1, BLOCK_M, 1, HEAD_DIM], do_desc.layout)
    lse_smem = gl.allocate_shared_memory(gl.float32, [NUM_STAGES, 1, 1, BLOCK_M], lse_desc.layout)
    delta_smem = gl.allocate_shared_memory(gl.float32, [NUM_STAGES, 1, 1, BLOCK_M], delta_desc.layout)
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], dtype)
    ds_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, BLOCK_M], ds_layout)
    kv_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    do_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    ds_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_ready, count=1)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(do_ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # both consumers release a buffer
    for i in gl.static_range(2):
        mbarrier.init(ds_ready.index(i), count=2)

    tiling = _Tiling(CAUSAL, BLOCK_M, BLOCK_N, KEYS, HEAD_DIM, NUM_STAGES)
    consumer = (k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, ds_smem, kv_ready, q_ready, do_ready, empty,
                ds_ready, DK, DV, DQAccum, stride_dkb, stride_dks, stride_dkh, stride_dvb, stride_dvs, stride_dvh,
                stride_ab, stride_ah, i_b, i_hk, start_n, first_m, m_blocks,
                n_steps, group_size, seqlen_q, seqlen_k, diagonal, qk_scale, sm_scale, tiling)
    producer = (q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc, k_smem, v_smem, q_smem, do_smem, lse_smem,
                delta_smem, kv_ready, q_ready, do_ready, empty, i_b, i_hk, start_n, first_m, m_blocks, n_steps, group_size, tiling)
    # the kernel's own 4 warps are consumer 0; setmaxnreg gives the producer 24 registers a thread
    gl.warp_specialize([(_consumer, (0, ) + consumer), (_consumer, (1, ) + consumer), (_producer, producer)],
                       [4, 1], [240, 24])


@gluon.jit
def _bwd_preprocess_kernel(Out, DOut, Lse, Lse2, Delta, DQAccum,
                           stride_ob, stride_os, stride_oh, stride_dob, stride_dos, stride_doh,
                           stride_lb, stride_lh, stride_pb, stride_ph, stride_ab, stride_ah, seqlen_q,
                           ROWS: gl.constexpr, HEAD_DIM: gl.constexpr):
    """Per block of ``ROWS`` query rows of one head: ``D = rowsum(dO ∘ O)``, ``LSE·log2 e`` (+inf for
    a row that saw no key and for the padding, so that P = 0 there) into buffers padded to whole
    blocks, and zeros into the same rows of the dQ accumulator."""
    layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[4, 8], warps_per_cta=[4, 1],
                                            order=[1, 0])
    i_m = gl.program_id(0)
    i_h = gl.program_id(1)
    i_b = gl.program_id(2)
    rows = i_m * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, layout))
    in_q = rows < seqlen_q
    tile = gl.expand_dims(in_q, 1)
    o = gl.load(Out + i_b * stride_ob + i_h * stride_oh + gl.expand_dims(rows, 1) * stride_os + gl.expand_dims(cols, 0),
                mask=tile, other=0.0).to(gl.float32)  # [ROWS, HEAD_DIM]
    do = gl.load(DOut + i_b * stride_dob + i_h * stride_doh + gl.expand_dims(rows, 1) * stride_dos
                 + gl.expand_dims(cols, 0), mask=tile, other=0.0).to(gl.float32)
    lse = gl.load(Lse + i_b * stride_lb + i_h * stride_lh + rows, mask=in_q, other=float("-inf"))
    padded = i_b * stride_pb + i_h * stride_ph + rows
    gl.store(Delta + padded, gl.sum(o * do, axis=1))
    gl.store(Lse2 + padded, gl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634))
    gl.store(DQAccum + i_b * stride_ab + i_h * stride_ah + gl.expand_dims(rows, 1) * HEAD_DIM + gl.expand_dims(cols, 0),
             gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=layout))


_STATS_LAYOUT = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=3)


def _stats_descriptor(t: torch.Tensor) -> TensorDescriptor:
    """A descriptor over a [batch, nheads, padded seqlen] float32 buffer that moves one block's rows."""
    return TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, BLOCK_M], _STATS_LAYOUT)


def flash_attn_backward_sm90(dout, q, k, v, out, lse, dq, dk, dv, softmax_scale: float, causal: bool) -> None:
    """Writes dq/dk/dv (any strides with a contiguous head dim) for q [B, Nq, Hq, D], k/v [B, Nk, Hk, D],
    out and dout like q, lse [B, Hq, Nq] float32, for inputs that
    ``flashtile.triton.launch.gluon_backward_usable`` found within this file's limits."""
    batch, seqlen_q, nheads_q, head_dim = q.shape
    seqlen_k, nheads_k = k.shape[1], k.shape[2]
    padded_q = -(-seqlen_q // BLOCK_M) * BLOCK_M  # ceil to whole blocks on Python ints
    lse2 = torch.empty((batch, nheads_q, padded_q), dtype=torch.float32, device=q.device)
    delta = torch.empty_like(lse2)
    dq_accum = torch.empty((batch, nheads_q, padded_q, head_dim), dtype=torch.float32, device=q.device)
    _bwd_preprocess_kernel[(padded_q // BLOCK_M, nheads_q, batch)](
        Out=out, DOut=dout, Lse=lse, Lse2=lse2, Delta=delta, DQAccum=dq_accum,
        stride_ob=out.stride(0), stride_os=out.stride(1), stride_oh=out.stride(2),
        stride_dob=dout.stride(0), stride_dos=dout.stride(1), stride_doh=dout.stride(2),
        stride_lb=lse.stride(0), stride_lh=lse.stride(1), stride_pb=lse2.stride(0), stride_ph=lse2.stride(1),
        stride_ab=dq_accum.stride(0), stride_ah=dq_accum.stride(1), seqlen_q=seqlen_q,
        ROWS=BLOCK_M, HEAD_DIM=head_dim, num_warps=4,
    )
    _attn_bwd_sm90_kernel[(-(-seqlen_k // BLOCK_N), nheads_k, batch)](
        q_desc=descriptor(q, BLOCK_M), k_desc=descriptor(k, BLOCK_N), v_desc=descriptor(v, BLOCK_N),
        do_desc=descriptor(dout, BLOCK_M), lse_desc=_stats_descriptor(lse2), delta_desc=_stats_descriptor(delta),
        DK=dk, DV=dv, DQAccum=dq_accum,
        stride_dkb=dk.stride(0), stride_dks=dk.stride(1), stride_dkh=dk.stride(2),
        stride_dvb=dv.stride(0), stride_dvs=dv.stride(1), stride_dvh=dv.stride(2),
        stride_ab=dq_accum.stride(0), stride_ah=dq_accum.stride(1),
        group_size=nheads_q // nheads_k, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
        qk_scale=softmax_scale * 1.4426950408889634, sm_scale=softmax_scale,
        CAUSAL=causal, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, KEYS=KEYS, HEAD_DIM=head_dim, NUM_STAGES=NUM_STAGES,
        num_warps=4,
    )
    dq.copy_(dq_accum[:, :, :seqlen_q].transpose(1, 2))
