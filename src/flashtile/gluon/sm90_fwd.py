"""The forward on Hopper (sm_90) in Gluon, with FlashAttention-3's warp-specialised schedule.

Triton's tile language cannot express what closes the forward's gap on the H200: its two
warpgroups take turns at the matmuls and the softmax, so the tensor cores idle while exp2 runs
(benchmarks/NOTES.md, "The profile"). Gluon (``triton.experimental.gluon``, in Triton 3.6) exposes
the pieces, still in Python:

* one CTA per block of 64·c query rows (one program per (Q block, head, batch), as in ``flashtile.triton.attention``), split
  into partitions of warps that share K/V tiles in shared memory:
  - a **producer warp** moves Q once, then K_j and V_j into a ring of ``NUM_STAGES`` buffers with
    the tensor copy engine (TMA), each buffer guarded by a "ready" and an "empty" mbarrier;
  - **c consumer warpgroups** (``CONSUMERS``: three at head dim 64, two at 128), 64 query rows
    each, run the online softmax (base 2, log2 e folded into the scale) with ``wgmma``, and
    ``setmaxnreg`` gives them the registers the producer does not need;
* inside a consumer, the matmuls of neighbouring blocks overlap (FA3's intra-warpgroup
  pipelining): ``S_j = Q K_jᵀ`` and ``O += P_{j-1} V_{j-1}`` are issued together, the consumer
  waits for S_j alone and computes softmax(S_j) while the PV matmul still runs, then rescales O;
* the consumers are not synchronised with each other, so one's softmax also runs under another's
  matmuls (an explicit ping-pong turn between them measured no faster: NOTES.md, v0.5);
* a learnable sink (gpt-oss) joins each row's denominator in the epilogue: with the row's running
  max M (scaled, base 2), sum ℓ and unnormalised output acc, and the sink's logit σ in base 2,
  ``μ = max(M, σ)``, ``den = ℓ·2^(M−μ) + 2^(σ−μ)``, ``o = acc·2^(M−μ) / den``,
  ``LSE = (μ + log2 den)·ln 2``: the same mass as starting the online softmax at (σ, 1), and no work in the main loop;
* causal programs run longest first (reversed Q-block order); only blocks that cross the diagonal
  or the end of the keys pay for masking. Visibility is the causal case of the one rule of
  ``flashtile.triton.scores`` (key ``j`` visible to query ``i`` iff ``j ≤ i + Nk − Nq``), written
  again here in Gluon's language because a Gluon kernel cannot call Triton functions.

Conventions are those of ``flashtile.triton.attention``: (batch, seqlen, nheads, head_dim) tensors with any
16-byte-aligned strides, GQA by ``h // (nheads_q // nheads_k)``, bottom-right causal alignment, the
log-sum-exp in natural log, float32, and a row that sees no key gets output 0 and LSE −inf.

Limits (``flashtile.triton.launch.attention_forward`` sends everything else to the Triton kernel, which stays the
portable path and the interpreter-tested specification): sm_90 only; bf16/fp16; head dims 64 and
128; full or causal attention (with or without a learnable sink) without bias, ALiBi, softcap,
window, dropout or packed batches; a
positive softmax scale (masking sets raw scores to −inf before the scale multiplies them, and the
running max is kept over raw scores: with a scale ≤ 0 masked entries would give NaN).
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


# Consumer warpgroups per CTA, by head dim; each takes 64 query rows (H200 sweeps, NOTES.md v0.5: three
# at head dim 64 beat two by 5-11% from seqlen 2048; at 128 a third would spill, since the setmaxnreg
# budget drops from 240 to 160 registers). K/V blocks of 128 keys in two buffers (three, or blocks of
# 64, measured no faster).
CONSUMERS = {64: 3, 128: 2}
ROWS, BLOCK_N, NUM_STAGES = 64, 128, 2


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

    @gluon.constexpr_function
    def __init__(self, CAUSAL, NUM_CONSUMERS, ROWS, BLOCK_N, HEAD_DIM, NUM_STAGES, HAS_SINK):
        self.CAUSAL = gl.constexpr(CAUSAL)
        self.NUM_CONSUMERS = gl.constexpr(NUM_CONSUMERS)
        self.ROWS = gl.constexpr(ROWS)
        self.BLOCK_N = gl.constexpr(BLOCK_N)
        self.HEAD_DIM = gl.constexpr(HEAD_DIM)
        self.NUM_STAGES = gl.constexpr(NUM_STAGES)
        self.HAS_SINK = gl.constexpr(HAS_SINK)


_GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}


@gluon.jit
def _producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty,
              i_b, i_hq, i_hk, row_start, n_blocks, tiling):
    """One warp: each consumer's Q rows once, then the K/V ring, a buffer refilled once every consumer
    freed it."""
    BLOCK_N: gl.constexpr = tiling.BLOCK_N
    NUM_STAGES: gl.constexpr = tiling.NUM_STAGES
    mbarrier.expect(q_bar, tiling.NUM_CONSUMERS * q_desc.block_type.nbytes)
    for c in gl.static_range(tiling.NUM_CONSUMERS):
        tma.async_copy_global_to_shared(q_desc, [i_b, row_start + c * tiling.ROWS, i_hq, 0], q_bar, q_smem.index(c))
    for j in range(n_blocks):
        stage = j % NUM_STAGES
        # a fresh mbarrier counts the phase before its first as complete: the first lap passes
        free_phase = ((j // NUM_STAGES) & 1) ^ 1
        mbarrier.wait(k_empty.index(stage), free_phase)
        mbarrier.expect(k_ready.index(stage), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [i_b, j * BLOCK_N, i_hk, 0], k_ready.index(stage),
                                        k_smem.index(stage))
        mbarrier.wait(v_empty.index(stage), free_phase)
        mbarrier.expect(v_ready.index(stage), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [i_b, j * BLOCK_N, i_hk, 0], v_ready.index(stage),
                                        v_smem.index(stage))


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
def _consumer(which, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty,
              o_desc, Lse, stride_lb, stride_lh, Sinks, i_b, i_hq, row_start, n_blocks, unmasked_hi,
              seqlen_q, seqlen_k, diagonal, qk_scale, tiling):
    """One warpgroup: query rows [row_start + which·ROWS, +ROWS) against every K/V block."""
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

    my_start = row_start + which * ROWS
    rows = my_start + gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))
    q = q_smem.index(which).reshape([ROWS, HEAD_DIM])  # [ROWS, HEAD_DIM]
    m_i = gl.full([ROWS], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([ROWS], gl.float32, layout=gl.SliceLayout(1, s_layout))
    acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=o_layout)
    s_unused = gl.zeros([ROWS, BLOCK_N], gl.float32, layout=s_layout)  # use_acc=False ignores it
    mbarrier.wait(q_bar, 0)

    if n_blocks > 0:
        # -- block 0: S_0 alone
        mbarrier.wait(k_ready.index(0), 0)
        k_t = k_smem.index(0).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0))  # [HEAD_DIM, BLOCK_N]
        s_token = warpgroup_mma(q, k_t, s_unused, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(0, deps=(s_token, ))  # [ROWS, BLOCK_N]
        mbarrier.arrive(k_empty.index(0))
        p, alpha, m_i, l_i = _online_softmax(s, m_i, l_i, rows, 0, seqlen_k, diagonal, qk_scale, unmasked_hi,
                                             CAUSAL, BLOCK_N, s_layout)
        p_op = gl.convert_layout(p.to(dtype), p_layout)  # [ROWS, BLOCK_N], registers: wgmma's A
        for j in range(1, n_blocks):
            stage = j % NUM_STAGES
            prev = (j - 1) % NUM_STAGES
            mbarrier.wait(k_ready.index(stage), (j // NUM_STAGES) & 1)
            mbarrier.wait(v_ready.index(prev), ((j - 1) // NUM_STAGES) & 1)
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
        # -- the last block's PV
        last = (n_blocks - 1) % NUM_STAGES
        mbarrier.wait(v_ready.index(last), ((n_blocks - 1) // NUM_STAGES) & 1)
        o_token = warpgroup_mma(p_op, v_smem.index(last).reshape([BLOCK_N, HEAD_DIM]), acc, is_async=True)
        acc, p_op = warpgroup_mma_wait(0, deps=(o_token, p_op))
        mbarrier.arrive(v_empty.index(last))

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
    # every S matmul has completed, so Q's tile is free to stage O for the copy engine,
    # which clips the rows past seqlen_q
    o_tile = q_smem.index(which)
    o_tile.reshape([ROWS, HEAD_DIM]).store(out.to(dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, [i_b, my_start, i_hq, 0], o_tile)
    tma.store_wait(0)


@gluon.jit
def _attn_fwd_sm90_kernel(q_desc, k_desc, v_desc, o_desc, Lse, stride_lb, stride_lh, Sinks,
                          group_size, seqlen_q, seqlen_k, qk_scale,
                          CAUSAL: gl.constexpr, NUM_CONSUMERS: gl.constexpr, ROWS: gl.constexpr,
                          BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, NUM_STAGES: gl.constexpr,
                          HAS_SINK: gl.constexpr):
    BLOCK_M: gl.constexpr = NUM_CONSUMERS * ROWS
    i_m = gl.num_programs(0) - 1 - gl.program_id(0)  # longest first under causal masking
    i_hq = gl.program_id(1)
    i_b = gl.program_id(2)
    i_hk = i_hq // group_size
    row_start = i_m * BLOCK_M
    diagonal = seqlen_k - seqlen_q  # bottom-right alignment
    if CAUSAL:
        last_row = gl.minimum(row_start + BLOCK_M, seqlen_q) - 1
        keys_end = gl.maximum(gl.minimum(seqlen_k, last_row + diagonal + 1), 0)
        unmasked_hi = gl.maximum(gl.minimum(row_start + diagonal + 1, seqlen_k), 0) // BLOCK_N * BLOCK_N
    else:
        keys_end = seqlen_k
        unmasked_hi = seqlen_k // BLOCK_N * BLOCK_N
    n_blocks = gl.cdiv(keys_end, BLOCK_N)

    dtype: gl.constexpr = q_desc.dtype
    # tiles keep the descriptors' [1, rows, 1, HEAD_DIM] boxes; the consumers view them as 2-D
    q_smem = gl.allocate_shared_memory(dtype, [NUM_CONSUMERS, 1, ROWS, 1, HEAD_DIM], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, 1, BLOCK_N, 1, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, 1, BLOCK_N, 1, HEAD_DIM], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=NUM_CONSUMERS)  # every consumer releases a buffer
        mbarrier.init(v_empty.index(i), count=NUM_CONSUMERS)

    tiling = _Tiling(CAUSAL, NUM_CONSUMERS, ROWS, BLOCK_N, HEAD_DIM, NUM_STAGES, HAS_SINK)
    consumer = (q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty, o_desc, Lse, stride_lb, stride_lh,
                Sinks, i_b, i_hq, row_start, n_blocks, unmasked_hi, seqlen_q, seqlen_k, diagonal, qk_scale, tiling)
    producer = (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty,
                i_b, i_hq, i_hk, row_start, n_blocks, tiling)
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


def descriptor(t: torch.Tensor, rows: int) -> TensorDescriptor:
    """A descriptor over [batch, seqlen, nheads, head_dim] that moves [1, rows, 1, head_dim] boxes."""
    box = (1, rows, 1, t.shape[-1])
    return TensorDescriptor(t, list(t.shape), list(t.stride()), list(box), _box_layout(box, t.dtype))


def record_forward(plan: plans.LaunchPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, learnable_sink: torch.Tensor | None, qk_scale: float, causal: bool) -> None:
    """Writes out (like q) and lse [B, Hq, Nq] float32 of q [B, Nq, Hq, D], k/v [B, Nk, Hk, D], for inputs
    that ``flashtile.triton.launch.gluon_usable`` found within this file's limits, launching through
    ``plan`` (``flashtile.triton.plans``: later calls of the key replay the launch on their tensors);
    ``qk_scale = softmax_scale · log2 e``; ``learnable_sink`` float32 [Hq] or None."""
    batch, seqlen_q, nheads_q, head_dim = q.shape
    seqlen_k, nheads_k = k.shape[1], k.shape[2]
    num_consumers = CONSUMERS[head_dim]
    grid = (-(-seqlen_q // (num_consumers * ROWS)), nheads_q, batch)  # ceil division on Python ints
    plans.launch(
        plan, _attn_fwd_sm90_kernel, grid,
        q_desc=descriptor(q, ROWS), k_desc=descriptor(k, BLOCK_N), v_desc=descriptor(v, BLOCK_N),
        o_desc=descriptor(out, ROWS), Lse=lse, stride_lb=lse.stride(0), stride_lh=lse.stride(1),
        Sinks=lse if learnable_sink is None else learnable_sink, group_size=nheads_q // nheads_k,
        seqlen_q=seqlen_q, seqlen_k=seqlen_k, qk_scale=qk_scale,
        CAUSAL=causal, NUM_CONSUMERS=num_consumers, ROWS=ROWS, BLOCK_N=BLOCK_N, HEAD_DIM=head_dim,
        NUM_STAGES=NUM_STAGES, HAS_SINK=learnable_sink is not None, num_warps=4,
    )
