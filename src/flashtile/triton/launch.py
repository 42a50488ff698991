"""Launchers: one call's tensors and options → the kernel that computes them, with its grid,
configuration and keyword arguments.

This is where the code paths are chosen:

* the forward runs ``flashtile.gluon.sm90_fwd`` (FlashAttention-3's warp-specialised schedule) on an
  sm_90 GPU for plain full or causal attention in 16 bits at head dims 64/128/192/256 from
  ``configs.GLUON_MIN_SEQLEN`` on, else ``attention.attn_fwd_kernel``, which moves its tiles
  with the tensor copy engine (TMA descriptors) from ``configs.TMA_MIN_SEQLEN`` on where the
  strides allow, else with masked pointer loads;
* the backward runs ``flashtile.gluon.sm90_bwd`` (one fused kernel, dQ summed with atomic adds) on
  an sm_90 GPU for the same plain calls unless ``deterministic`` is asked for; else it is three
  launches: D = rowsum(dO ∘ O), then the dK/dV kernel, then the dQ kernel, with no atomics;
* the KV-cache forward plans its split count (:func:`split_plan`) and merges the splits with
  ``merge.merge_states_kernel``; packed queries against a paged cache that average enough queries per
  sequence (a prefill: :func:`paged_prefill_usable`) run the forward kernel instead, reading K and V
  through the block table (``IS_PAGED``).

Every launcher decides once per call key and replays its launches after (``plans``).

Every kernel argument is given by name (``stride_{tensor}{axis}`` for strides) and put in the
kernel's parameter order by :func:`plans.launch`, so that reordering a kernel's parameters cannot
misbind them. Launches run on the tensors' GPU, which need
not be the current one. Under ``TRITON_INTERPRET=1`` the same kernels run on the CPU, with the
interpreter fix of ``_interpreter`` applied when this module is imported.
"""

from __future__ import annotations

import functools
import math

import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from .. import gluon
from .._options import AttentionOptions, AttentionTensors, cache_capacity
from .._validate import MAX_HEAD_DIM
from . import _interpreter, configs, plans
from ._host import cdiv, cuda_properties, launch_device, next_power_of_2
from .attention import attn_bwd_dkdv_kernel, attn_bwd_dq_kernel, attn_bwd_preprocess_kernel, attn_fwd_kernel
from .decode import kvcache_append_kernel, kvcache_attn_fwd_kernel
from .merge import merge_states_kernel

_interpreter.apply_fixes()
if gluon.written_for():
    from ..gluon import sm90_bwd, sm90_fwd
else:  # another Triton's Gluon may not even import these kernels: the Triton kernels run everything
    sm90_bwd = sm90_fwd = None

__all__ = ["attention_forward", "attention_backward", "kvcache_append", "kvcache_attention_forward",
           "merge_states_into", "num_splits_heuristic", "split_plan", "wide_offsets"]

LOG2E = 1.4426950408889634  # 1 / ln 2; the kernels work in base 2 (exp2) and repeat it as a literal


# ----------------------------------------------------------------------------------------------
# Keyword arguments


@functools.cache
def _stride_names(prefix: str, axes: str) -> tuple[str, ...]:
    return tuple(f"stride_{prefix}{axis}" for axis in axes)


def _strides(prefix: str, axes: str, strides) -> dict:
    """``stride_{prefix}{axis}`` keyword arguments: ``_strides("q", "bshd", q.stride())``."""
    return dict(zip(_stride_names(prefix, axes), strides))


def _token_strides(prefix: str, t: torch.Tensor) -> dict:
    """(batch, seq, head, dim) strides; a packed (total, head, dim) tensor has batch stride 0."""
    return _strides(prefix, "bshd", t.stride() if t.dim() == 4 else (0, *t.stride()))


def _lse_strides(lse: torch.Tensor) -> dict:
    """(batch, head) strides of the log-sum-exp; the token stride is 1 in both layouts."""
    return _strides("l", "bh", (0, lse.stride(0)) if lse.dim() == 2 else (lse.stride(0), lse.stride(1)))


# ----------------------------------------------------------------------------------------------
# Code-path policy


def wide_offsets(**tensors) -> bool:
    """Whether a tensor of the call spans more than 2³¹ − 1 elements: the kernels then form their offsets
    in 64 bits (``WIDE``: every stride but the innermost widened), else in 32 (the common path, unchanged).
    An innermost axis (the head dim; a bias's key axis) that alone spans more is refused: its offsets
    stay 32-bit so that the contiguous loads keep their known unit stride."""
    wide = False
    for name, t in tensors.items():
        if t is None or t.numel() == 0:
            continue
        extent = 1 + sum((size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride()))
        if extent > configs.INT32_MAX:
            wide = True
            if (t.shape[-1] - 1) * abs(t.stride(-1)) > configs.INT32_MAX:
                raise ValueError(f"{name} of shape {tuple(t.shape)} and strides {t.stride()}: its last axis alone "
                                 f"spans more than {configs.INT32_MAX} elements; make it contiguous")
    return wide


def _descriptor_compatible(*tensors: torch.Tensor) -> bool:
    """Whether the copy engine can move tiles of these tensors: a contiguous head dim and positive
    16-byte-aligned strides and bases."""
    return all(
        t.stride(-1) == 1 and t.data_ptr() % 16 == 0
        and all(s > 0 and s * t.element_size() % 16 == 0 for s in t.stride()[:-1])
        for t in tensors
    )


def tma_usable(tensors: AttentionTensors, seqlen_q: int, seqlen_k: int, *tiles: torch.Tensor) -> bool:
    """Whether the forward loads its tiles through tensor descriptors. They need Hopper's copy
    engine (or the interpreter), one sequence per batch row (not packed) and descriptor-compatible
    tensors; and they pay off only from ``TMA_MIN_SEQLEN`` on (benchmarks/NOTES.md, v0.4)."""
    if tensors.is_varlen or min(seqlen_q, seqlen_k) < configs.TMA_MIN_SEQLEN:
        return False
    device = tiles[0].device
    if device.type == "cuda":
        if _capability(device) < (9, 0):
            return False
    elif not _interpreter.interpreting():
        return False
    return _descriptor_compatible(*tiles)


def _capability(device: torch.device) -> tuple[int, int]:
    """The GPU's compute capability (major, minor); (0, 0) for tensors off a GPU."""
    if device.type != "cuda":
        return 0, 0
    properties = cuda_properties(device)
    return properties.major, properties.minor


def _is_sm90(device: torch.device) -> bool:
    return _capability(device) == (9, 0)


def _converts_float8_by_ptx(device: torch.device) -> bool:
    """Whether the KV-cache kernel widens a float8 V tile by the PTX instruction (``CONVERT_V_BY_PTX``):
    a GPU of sm_89 or later, whose PTX has ``cvt.rn.f16x2.e4m3x2``/``e5m2x2`` (earlier ones, where Triton
    still converts e5m2, and the interpreter, on CPU tensors, keep ``.to()``)."""
    return _capability(device) >= (8, 9)


def _plain(options: AttentionOptions, tensors: AttentionTensors) -> bool:
    """Full or causal attention without a bias, ALiBi, softcap, window, dropout or packed batches."""
    return (options.window in ((-1, -1), (-1, 0)) and options.softcap == 0 and options.dropout_p == 0
            and tensors.alibi_slopes is None and tensors.attn_bias is None and not tensors.is_varlen)


def gluon_usable(options: AttentionOptions, tensors: AttentionTensors, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor) -> bool:
    """Whether the forward runs ``flashtile.gluon.sm90_fwd``'s kernel: with the Triton series it is
    written for, on an sm_90 GPU, for plain full or causal attention (a learnable sink allowed) in 16
    bits at a head dim it has (the same for V), with a positive softmax scale (it masks raw scores before
    scaling them), from ``GLUON_MIN_SEQLEN[head_dim, causal, whether its grid is persistent]`` on, for
    tensors within 32-bit offsets."""
    head_dim, seqlen = q.shape[-1], min(q.shape[1], k.shape[1])
    if not _plain(options, tensors) or sm90_fwd is None:
        return False
    grid_is_persistent = sm90_fwd.persistent(k.shape[1], head_dim)
    threshold = configs.GLUON_MIN_SEQLEN.get((head_dim, options.causal, grid_is_persistent), configs.INT32_MAX)
    return (v.shape[-1] == head_dim
            and options.softmax_scale > 0
            and q.dtype in (torch.float16, torch.bfloat16) and q.numel() > 0 and k.numel() > 0
            and seqlen >= threshold
            and _is_sm90(q.device) and _descriptor_compatible(q, k, v) and not wide_offsets(q=q, k=k, v=v))


def gluon_backward_usable(options: AttentionOptions, tensors: AttentionTensors, q, k, v, out, dout,
                          dq, dk, dv) -> bool:
    """Whether the backward runs ``flashtile.gluon.sm90_bwd``'s fused kernels: as the forward, for
    plain full or causal attention in 16 bits (O and dO in Q's dtype: its D is a matmul of the two) at the
    head dims it routes (``sm90_bwd.ROUTED_HEAD_DIMS``; V's the same) on an sm_90 GPU with the Triton series it
    is written for, and not ``deterministic`` (its dQ is summed with atomic adds);
    Q, K, V, O and dO must suit the copy engine, the gradients need a contiguous head dim, and every
    tensor, the padded float32 dQ accumulator included, must stay within 32-bit offsets."""
    if not _plain(options, tensors) or sm90_bwd is None or options.deterministic:
        return False
    batch, seqlen_q, nheads_q, head_dim = q.shape
    padded_q = cdiv(seqlen_q, sm90_bwd.BLOCK_M) * sm90_bwd.BLOCK_M
    return (q.dtype in (torch.float16, torch.bfloat16) and out.dtype == dout.dtype == q.dtype
            and head_dim in sm90_bwd.ROUTED_HEAD_DIMS and v.shape[-1] == head_dim and q.numel() > 0
            and k.numel() > 0 and batch * nheads_q * padded_q * sm90_fwd.tile_head_dim(head_dim) <= configs.INT32_MAX
            and _is_sm90(q.device) and _descriptor_compatible(q, k, v, out, dout)
            and all(t.stride(-1) == 1 for t in (dq, dk, dv))
            and not wide_offsets(q=q, k=k, v=v, out=out, dout=dout, dq=dq, dk=dk, dv=dv))


def _descriptor(t: torch.Tensor, rows: int, padded_head_dim: int) -> TensorDescriptor:
    """A descriptor over [batch, seqlen, nheads, head_dim] that moves [1, rows, 1, padded_head_dim] boxes."""
    return TensorDescriptor(t, list(t.shape), list(t.stride()), [1, rows, 1, padded_head_dim])


# ----------------------------------------------------------------------------------------------
# Attention forward and backward


def _shape(q, k, options: AttentionOptions, tensors: AttentionTensors):
    """(batch, seqlen_q, seqlen_k, nheads_q, nheads_k, head_dim); seqlens are the grid's maxima."""
    if tensors.is_varlen:
        return (tensors.cu_seqlens_q.numel() - 1, options.max_seqlen_q, options.max_seqlen_k,
                q.shape[1], k.shape[1], q.shape[2])
    return q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2], q.shape[3]


def _extents(q, k, tensors: AttentionTensors, shape) -> tuple[int, int]:
    """The kernels' ``seqlen_q``/``seqlen_k``: the lengths, or for a packed batch the token counts,
    which bound each sequence's cu_seqlens there (the grid takes max_seqlen from ``shape``)."""
    return (q.shape[0], k.shape[0]) if tensors.is_varlen else (shape[1], shape[2])


def _expanded_bias(tensors: AttentionTensors, shape) -> torch.Tensor | None:
    """The bias as a (batch, nheads, seqlen_q, seqlen_k) view (broadcast dims get stride 0), or None:
    made once per call, before the launches that read it (a plan refers to it as one of the call's tensors)."""
    batch, seqlen_q, seqlen_k, nheads_q, _, _ = shape
    bias = tensors.attn_bias
    return None if bias is None else bias.expand(batch, nheads_q, seqlen_q, seqlen_k)


def _variant_arguments(options: AttentionOptions, tensors: AttentionTensors, q: torch.Tensor, k: torch.Tensor,
                       shape, bias: torch.Tensor | None) -> dict:
    """The keyword arguments that the forward, dK/dV and dQ kernels share: the variants' tensors
    (``q`` stands in for an absent one, never read), their strides, scalars and constexpr switches;
    ``bias``: :func:`_expanded_bias`."""
    batch, seqlen_q, seqlen_k, nheads_q, nheads_k, _ = shape
    extent_q, extent_k = _extents(q, k, tensors, shape)
    slopes = tensors.alibi_slopes
    softcap = options.softcap
    return dict(
        Bias=q if bias is None else bias,
        AlibiSlopes=q if slopes is None else slopes,
        Seed=q if tensors.dropout_seed is None else tensors.dropout_seed,
        CuSeqlensQ=tensors.cu_seqlens_q if tensors.is_varlen else q,
        CuSeqlensK=tensors.cu_seqlens_k if tensors.is_varlen else q,
        **_strides("b", "bhmn", (0, 0, 0, 0) if bias is None else bias.stride()),
        stride_ab=slopes.stride(0) if slopes is not None and slopes.dim() == 2 else 0,
        nheads_q=nheads_q, group_size=nheads_q // nheads_k, seqlen_q=extent_q, seqlen_k=extent_k,
        qk_scale=options.softmax_scale * LOG2E,
        softcap_scale=options.softmax_scale / softcap if softcap > 0 else 1.0,
        softcap_log2=softcap * LOG2E,
        window_left=options.window_left, window_right=options.window_right, dropout_p=options.dropout_p,
        MASK_LEFT=options.window_left >= 0, MASK_RIGHT=options.window_right >= 0, HAS_SOFTCAP=softcap > 0,
        HAS_ALIBI=slopes is not None, HAS_BIAS=bias is not None, HAS_DROPOUT=options.dropout_p > 0,
        IS_VARLEN=tensors.is_varlen, DOT_PRECISION=configs.dot_precision(q.dtype),
    )


def _forward_outputs(q, head_dim_v, batch, nheads_q, seqlen_q, tensors: AttentionTensors):
    """(out, lse) to write into; out is q's shape with V's head dim. A packed batch's are filled with 0
    and −inf first: tokens that its cu_seqlens leave out of every sequence are never written by the kernel."""
    out_shape = (*q.shape[:-1], head_dim_v)
    if tensors.is_varlen:
        return q.new_zeros(out_shape), _lse_buffer((nheads_q, q.shape[0]), True, q)
    # new_empty: ~0.5 µs a call less than torch.empty with a dtype and device (the small calls' host time)
    return q.new_empty(out_shape), _lse_buffer((batch, nheads_q, seqlen_q), False, q)


def _lse_buffer(shape, packed: bool, like: torch.Tensor) -> torch.Tensor:
    """A log-sum-exp buffer (float32) on ``like``'s device: a packed batch's starts at −inf, since tokens
    outside every sequence are never written."""
    if packed:
        return like.new_full(shape, float("-inf"), dtype=torch.float32)
    return like.new_empty(shape, dtype=torch.float32)


def attention_forward(q, k, v, options: AttentionOptions, tensors: AttentionTensors):
    """q [B, Nq, Hq, D], k [B, Nk, Hk, D], v [B, Nk, Hk, Dv] (any strides), or packed [total, H, D] with
    ``tensors.cu_seqlens_*`` → (out like q with Dv, lse [B, Hq, Nq] or [Hq, total_q], float32).
    Decided once per call key (``plans``): the code path, then the kernel's launch."""
    call_key = plans.key("fwd", options, q, k, v, *tensors)
    plan = plans.lookup(call_key)
    if plan is None:
        plan = plans.LaunchPlan(gluon=gluon_usable(options, tensors, q, k, v))
    with launch_device(q):
        if plan.gluon:
            out, lse = _forward_outputs(q, v.shape[-1], q.shape[0], q.shape[2], q.shape[1], tensors)
            call = (q, k, v, out, lse, tensors.learnable_sink)
            plans.replay_or_record(call_key, plan, call, lambda plan: sm90_fwd.record_forward(
                plan, *call, options.softmax_scale * LOG2E, options.causal))
            return out, lse
        shape = _shape(q, k, options, tensors)
        batch, seqlen_q, _, nheads_q, _, _ = shape
        out, lse = _forward_outputs(q, v.shape[-1], batch, nheads_q, seqlen_q, tensors)
        bias = _expanded_bias(tensors, shape)
        call = (q, k, v, out, lse, bias, *tensors)
        plans.replay_or_record(call_key, plan, call, lambda plan: _record_forward(
            plan, q, k, v, out, lse, options, tensors, bias, shape))
    return out, lse


def _record_forward(plan: plans.LaunchPlan, q, k, v, out, lse, options: AttentionOptions, tensors: AttentionTensors,
                    bias, shape) -> None:
    """The Triton forward's launch: tiles by the copy engine or by pointers, and the configuration."""
    batch, seqlen_q, seqlen_k, nheads_q, _, head_dim = shape
    head_dim_v = v.shape[-1]
    wide = wide_offsets(q=q, k=k, v=v, out=out, attn_bias=tensors.attn_bias)
    padded, padded_v = configs.block_d(head_dim), configs.block_d(head_dim_v)
    use_tma = tma_usable(tensors, seqlen_q, seqlen_k, q, k, v, out)
    cfg = configs.fwd_config(max(padded, padded_v), q.dtype, options.window_right >= 0,
                             tensors.attn_bias is not None, use_tma)
    tiles = dict(Q=q, K=k, V=v, Out=out)
    if use_tma:
        tiles = dict(Q=_descriptor(q, cfg["BLOCK_M"], padded), K=_descriptor(k, cfg["BLOCK_N"], padded),
                     V=_descriptor(v, cfg["BLOCK_N"], padded_v), Out=_descriptor(out, cfg["BLOCK_M"], padded_v))
    plans.launch(
        plan, attn_fwd_kernel, (cdiv(seqlen_q, cfg["BLOCK_M"]), nheads_q, batch),
        **tiles, Lse=lse, **_variant_arguments(options, tensors, q, k, shape, bias),
        Sinks=q if tensors.learnable_sink is None else tensors.learnable_sink,
        **_token_strides("q", q), **_token_strides("k", k), **_token_strides("v", v),
        **_token_strides("o", out), **_lse_strides(lse),
        HAS_SINK=tensors.learnable_sink is not None, USE_TMA=use_tma, HEAD_DIM=head_dim, BLOCK_D=padded,
        HEAD_DIM_V=head_dim_v, BLOCK_DV=padded_v, WIDE=wide, **_pages(None, None, k, cfg["BLOCK_N"]), **cfg,
    )


def _pages(block_table, seqused_k, k_cache, block_n: int) -> dict:
    """The forward kernel's paged-cache arguments (``IS_PAGED``) for key blocks of ``block_n``; without a
    table, stand-ins (``k_cache``, never read)."""
    if block_table is None:
        return dict(BlockTable=k_cache, SequsedK=k_cache, stride_tb=0, stride_tn=0, page_size=1, num_pages=1,
                    IS_PAGED=False, PAGE_SPLIT=0)
    page_size = k_cache.shape[1]
    return dict(BlockTable=block_table, SequsedK=seqused_k, **_strides("t", "bn", block_table.stride()),
                page_size=page_size, num_pages=k_cache.shape[0], IS_PAGED=True,
                PAGE_SPLIT=configs.page_split(page_size, block_n))


def attention_backward(dout, q, k, v, out, lse, options: AttentionOptions, tensors: AttentionTensors,
                       dq, dk, dv, bias_grad: bool = False):
    """Writes the gradients of :func:`attention_forward` into ``dq``/``dk``/``dv`` (possibly strided
    buffers, such as the slices of a packed gradient). Returns (the bias gradient reduced to the
    bias's shape when ``bias_grad``, else None; D = rowsum(dO ∘ O) float32 in lse's layout, which the
    kernels form and a learnable sink's gradient reads; rows outside every packed sequence unwritten).
    Bitwise deterministic except on the fused sm_90 path, which ``options.deterministic`` turns off.
    Decided once per call key (``plans``), as the forward."""
    call_key = plans.key("bwd", options, bias_grad, dout, q, k, v, out, lse, dq, dk, dv, *tensors)
    plan = plans.lookup(call_key)
    if plan is None:
        plan = plans.LaunchPlan(gluon=gluon_backward_usable(options, tensors, q, k, v, out, dout, dq, dk, dv))
    if plan.gluon:
        with launch_device(q):
            lse2, delta, dq_accum = sm90_bwd.backward_buffers(q)
            call = (dout, q, k, v, out, lse, dk, dv, lse2, delta, dq_accum)
            plans.replay_or_record(call_key, plan, call, lambda plan: sm90_bwd.record_backward(
                plan, *call, options.softmax_scale, options.causal))
            seqlen_q = q.shape[1]
            dq.copy_(dq_accum[:, :seqlen_q, :, :q.shape[-1]])
        return None, delta[:, :, :seqlen_q]
    shape = _shape(q, k, options, tensors)
    batch, seqlen_q, seqlen_k, nheads_q, nheads_k, head_dim = shape
    lse = lse.contiguous()  # D takes the log-sum-exp's strides: a strided slice would misplace it
    if tensors.is_varlen:  # tokens outside every sequence: zero gradients (the kernels never write them)
        for grad in (dq, dk, dv):
            grad.zero_()
    dbias = None
    if bias_grad:
        if batch * nheads_q * seqlen_q * seqlen_k > configs.INT32_MAX:
            raise ValueError(f"the bias gradient (batch, nheads, seqlen_q, seqlen_k) = "
                             f"{(batch, nheads_q, seqlen_q, seqlen_k)} exceeds 32-bit offsets")
        # zeros: entries in blocks that the window skips are never written
        dbias = torch.zeros((batch, nheads_q, seqlen_q, seqlen_k), dtype=torch.float32, device=q.device)
    delta = torch.empty_like(lse)
    bias = _expanded_bias(tensors, shape)
    call = (dout, q, k, v, out, lse, dq, dk, dv, delta, dbias, bias, *tensors)
    with launch_device(q):
        plans.replay_or_record(call_key, plan, call, lambda plan: _record_backward(
            plan, dout, q, k, v, out, lse, options, tensors, dq, dk, dv, delta, dbias, bias, shape))
    if dbias is not None:
        dbias = dbias.sum_to_size(tensors.attn_bias.shape).to(tensors.attn_bias.dtype)
    return dbias, delta


def _record_backward(plan: plans.LaunchPlan, dout, q, k, v, out, lse, options: AttentionOptions,
                     tensors: AttentionTensors, dq, dk, dv, delta, dbias, bias, shape) -> None:
    """The Triton backward's three launches: D = rowsum(dO ∘ O), then dK/dV, then dQ."""
    batch, seqlen_q, seqlen_k, nheads_q, nheads_k, head_dim = shape
    head_dim_v = v.shape[-1]
    dkdv_cfg, dq_cfg = configs.bwd_configs(head_dim, head_dim_v, q.dtype)
    variant = _variant_arguments(options, tensors, q, k, shape, bias)
    wide = wide_offsets(q=q, k=k, v=v, out=out, dout=dout, dq=dq, dk=dk, dv=dv, attn_bias=tensors.attn_bias)
    block_d, block_d2 = configs.bwd_head_dim_chunks(head_dim)
    block_dv, block_dv2 = configs.bwd_head_dim_chunks(head_dim_v)
    # the preprocess's matmul on float32 runs on the CUDA cores, its tiles in shared memory: 16 rows keep
    # those within 32 KiB at a 256-wide head (64 would take 128 KiB, beyond many GPUs' 99 KiB)
    preprocess_rows = 16 if out.dtype == torch.float32 else 64
    plans.launch(
        plan, attn_bwd_preprocess_kernel, (cdiv(seqlen_q, preprocess_rows), nheads_q, batch),
        Out=out, DOut=dout, Delta=delta, CuSeqlensQ=variant["CuSeqlensQ"],
        **_token_strides("o", out), **_token_strides("do", dout), **_lse_strides(lse),
        seqlen_q=variant["seqlen_q"], IS_VARLEN=tensors.is_varlen, HEAD_DIM=head_dim_v, BLOCK_D=block_dv,
        BLOCK_D2=block_dv2, BLOCK_M=preprocess_rows, D_BY_MATMUL=out.dtype == dout.dtype,
        DOT_PRECISION=variant["DOT_PRECISION"], WIDE=wide,
    )
    shared = dict(Q=q, K=k, V=v, DOut=dout, Lse=lse, Delta=delta, **variant,
                  **_token_strides("q", q), **_token_strides("k", k), **_token_strides("v", v),
                  **_token_strides("do", dout), **_lse_strides(lse),
                  sm_scale=options.softmax_scale, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_D2=block_d2,
                  HEAD_DIM_V=head_dim_v, BLOCK_DV=block_dv, BLOCK_DV2=block_dv2, WIDE=wide)
    plans.launch(
        plan, attn_bwd_dkdv_kernel, (cdiv(seqlen_k, dkdv_cfg["BLOCK_N"]), nheads_k, batch),
        DK=dk, DV=dv, DBias=q if dbias is None else dbias, **_token_strides("dk", dk),
        **_token_strides("dv", dv), BIAS_GRAD=dbias is not None, **shared, **dkdv_cfg,
    )
    plans.launch(
        plan, attn_bwd_dq_kernel, (cdiv(seqlen_q, dq_cfg["BLOCK_M"]), nheads_q, batch),
        DQ=dq, **_token_strides("dq", dq), **shared, **dq_cfg,
    )


# ----------------------------------------------------------------------------------------------
# Attention against a KV cache, and merging partial results


@functools.lru_cache(maxsize=4096)  # a decoding loop asks the same question every step; the scan costs µs
def num_splits_heuristic(num_programs: int, num_sms: int, num_key_blocks: int, max_splits: int = 128,
                         programs_per_sm: int = 2) -> int:
    """Split count for ``num_programs`` (batch · nheads_k · query blocks) programs, flash-attn 2's rule.

    Memory-bound decoding needs every SM streaming: with fewer programs than about
    ``programs_per_sm`` per SM, the key range is split. Among the split counts that change the number
    of blocks per split, take the smallest whose wave efficiency (programs / (waves · slots))
    is within 85% of the best one. Splits never exceed the number of key blocks.
    """
    slots = programs_per_sm * num_sms
    if num_programs >= 0.8 * slots:
        return 1
    max_splits = max(1, min(max_splits, slots, num_key_blocks))

    def eligible(s: int) -> bool:  # a split count that leaves the blocks per split unchanged is pointless
        return s == 1 or math.ceil(num_key_blocks / s) != math.ceil(num_key_blocks / (s - 1))

    def efficiency(s: int) -> float:
        waves = num_programs * s / slots
        return waves / math.ceil(waves)

    best = max(efficiency(s) for s in range(1, max_splits + 1) if eligible(s))
    return next(s for s in range(1, max_splits + 1) if eligible(s) and efficiency(s) >= 0.85 * best)


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return cuda_properties(device).multi_processor_count
    return 1  # the interpreter runs one program at a time


def split_plan(batch, seqlen_q, group_size, nheads_k, head_dim, dtype, max_seqlen_k, device, num_splits=0,
               config=None, cache_dtype=None):
    """→ (block config, query-row blocks, split count) of a call; num_splits 0 = heuristic;
    ``head_dim``: the larger of Q/K's and V's; ``cache_dtype``: the cache's (a float8 cache asks for more programs).

    The heuristic sees the cache's capacity (max_seqlen_k), not the valid lengths, which
    live on the device: reading them would cost a host sync per decoding step.
    """
    cfg = dict(configs.decode_config(head_dim, dtype, seqlen_q * group_size), **(config or {}))
    num_m_blocks = cdiv(seqlen_q * group_size, cfg["BLOCK_M"])
    num_key_blocks = max(1, cdiv(max_seqlen_k, cfg["BLOCK_N"]))
    if num_splits == 0:
        num_splits = num_splits_heuristic(batch * nheads_k * num_m_blocks, _num_sms(device), num_key_blocks,
                                          programs_per_sm=configs.decode_programs_per_sm(cache_dtype or dtype))
    return cfg, num_m_blocks, min(num_splits, num_key_blocks)


def _packed_rows(part: torch.Tensor, varlen: bool) -> tuple[int, ...]:
    """A partial result's strides; packed, the sequences share its one batch row (batch stride 0)."""
    strides = part.stride()
    return (strides[0], 0, *strides[2:]) if varlen else strides


def kvcache_attention_forward(q, k_cache, v_cache, seqlens_k, cache_batch_idx, block_table,
                              options: AttentionOptions, alibi_slopes=None, num_splits: int = 0,
                              config: dict | None = None, learnable_sink=None, cu_seqlens_q=None,
                              max_seqlen_q: int = 0, cache_leftpad=None, k_descale=None, v_descale=None, out=None,
                              rotary_cos=None, rotary_sin=None, rotary_start=None, rotary_interleaved: bool = False):
    """q [B, Sq, Hq, D]; caches [B_cache, S_cache, Hk, D or Dv] or paged [num_blocks, page_size, Hk, D or Dv]
    with block_table [B, max_blocks] int32; seqlens_k [B] int32 (valid keys per sequence, after any
    append); ``options``: softmax scale, window (causal folded in) and softcap; alibi_slopes [Hq] or
    [B, Hq] float32; num_splits 0 = heuristic; ``config`` overrides the block shapes (benchmark
    tuning); learnable_sink [Hq] float32. → (out [B, Sq, Hq, Dv] in q's dtype, lse [B, Hq, Sq] float32).
    With ``cu_seqlens_q`` (int32 [B + 1]), q is packed [total_q, Hq, D], the longest sequence has
    ``max_seqlen_q`` queries, and → (out [total_q, Hq, Dv], lse [Hq, total_q]); tokens outside every
    sequence get 0 and −inf. ``cache_leftpad`` int32 [B]: sequence b's keys start at that slot.
    ``k_descale``, ``v_descale`` float32 [B, Hk]: a float8 cache's scales (both given, or neither).
    ``out``: the output's tensor (its shape, q's dtype, any strides), written in place. ``rotary_cos``,
    ``rotary_sin`` (seqlen_ro, rotary_dim / 2), ``rotary_start`` int32 [B]: q is rotated as it is loaded
    (``reference.rotary_positions``' rule; all at ``rotary_start`` for full attention), head dim ≤ 256."""
    call_key = plans.key(
        "kvcache_fwd", options, num_splits, config and tuple(sorted(config.items())), max_seqlen_q,
        rotary_interleaved, q, k_cache, v_cache, seqlens_k, cache_batch_idx, block_table, alibi_slopes,
        learnable_sink, cu_seqlens_q, cache_leftpad, k_descale, v_descale, out, rotary_cos, rotary_sin, rotary_start)
    plan = plans.lookup(call_key)
    varlen = cu_seqlens_q is not None
    if varlen:  # one "batch row" of total_q tokens, each sequence at its own rows
        total_q, nheads_q, head_dim = q.shape
        batch, seqlen_q = seqlens_k.shape[0], max_seqlen_q
        lead, rows = (1, total_q), total_q
    else:
        batch, seqlen_q, nheads_q, head_dim = q.shape
        lead, rows = (batch, seqlen_q), seqlen_q
    head_dim_v = v_cache.shape[-1]
    if plan is None:
        if paged_prefill_usable(q, k_cache, v_cache, cache_batch_idx, block_table, cu_seqlens_q, cache_leftpad,
                                k_descale, rotary_cos, config):
            plan = plans.LaunchPlan(prefill=True)
        else:
            max_seqlen_k = cache_capacity(k_cache, block_table)
            cfg, num_m_blocks, splits = split_plan(batch, seqlen_q, nheads_q // k_cache.shape[2], k_cache.shape[2],
                                                   max(head_dim, head_dim_v), q.dtype, max_seqlen_k, q.device,
                                                   num_splits, config, k_cache.dtype)
            plan = plans.LaunchPlan(prefill=False, cfg=cfg, num_m_blocks=num_m_blocks, num_splits=splits)
    if plan.prefill:
        return _paged_prefill(plan, call_key, q, k_cache, v_cache, seqlens_k, block_table, options, alibi_slopes,
                              learnable_sink, cu_seqlens_q, max_seqlen_q, out)
    # packed queries: tokens that no sequence covers are never written, so they start at 0 and -inf
    allocate = torch.zeros if varlen else torch.empty
    if out is None:  # [B, Sq, Hq, Dv] or [1, total_q, Hq, Dv]
        out = allocate((*lead, nheads_q, head_dim_v), dtype=q.dtype, device=q.device)
    elif varlen:
        out = out.zero_()[None]  # as allocated: tokens outside every sequence read 0
    lse = _lse_buffer((lead[0], nheads_q, rows), varlen, q)  # [B, Hq, Sq] or [1, Hq, total_q]
    if plan.num_splits == 1:
        # one split: the kernel's partial result is the final one, written in q's dtype
        out_part, lse_part = out.unsqueeze(0), lse.unsqueeze(0)
    else:
        out_part = allocate((plan.num_splits, *out.shape), dtype=torch.float32, device=q.device)
        lse_part = _lse_buffer((plan.num_splits, *lse.shape), varlen, q)
    # tensors a configuration does not use are passed as (unread) stand-ins: one view for both
    stand_in = seqlens_k[:, None] if block_table is None or alibi_slopes is None else None
    table = block_table if block_table is not None else stand_in
    slopes = stand_in if alibi_slopes is None else alibi_slopes.expand(batch, nheads_q)
    if rotary_cos is not None:  # the kernels index the tables' rows by one stride
        rotary_cos, rotary_sin = rotary_cos.contiguous(), rotary_sin.contiguous()
    call = (q, k_cache, v_cache, out_part, lse_part, seqlens_k, cache_batch_idx, table, slopes, learnable_sink,
            cu_seqlens_q, cache_leftpad, k_descale, v_descale, rotary_cos, rotary_sin, rotary_start, out, lse)

    def record(plan: plans.LaunchPlan) -> None:
        _record_kvcache_attention(
            plan, q, k_cache, v_cache, out_part, lse_part, seqlens_k, cache_batch_idx, block_table, table, slopes,
            options, alibi_slopes, learnable_sink, cu_seqlens_q, cache_leftpad, k_descale, v_descale, rotary_cos,
            rotary_sin, rotary_start, rotary_interleaved, head_dim, nheads_q, batch, rows)
        if plan.num_splits > 1:  # the splits' merge in the same plan: a step replays both launches at once
            _record_merge(plan, out_part, lse_part, out, lse)

    with launch_device(q):
        plans.replay_or_record(call_key, plan, call, record)
    return (out[0], lse[0]) if varlen else (out, lse)


def paged_prefill_usable(q, k_cache, v_cache, cache_batch_idx, block_table, cu_seqlens_q, cache_leftpad, k_descale,
                         rotary_cos, config=None) -> bool:
    """Whether packed queries against a paged cache run the forward kernel (``attn_fwd_kernel`` with
    ``IS_PAGED``: BLOCK_M query rows of one head per program, as a contiguous varlen forward) rather than
    the KV-cache kernel, which packs a GQA group's heads into its rows and suits a few queries per
    sequence: when the sequences average ``configs.PAGED_PREFILL_MIN_QUERIES`` queries or more (a
    prefill or a chunked prefill, not a batch of decoding rows), without the KV-cache kernel's own
    features (a float8 cache, rotary, cache_leftpad, block shapes given by ``config``), at head dims
    the forward kernel has."""
    if block_table is None or cu_seqlens_q is None or config is not None:
        return False
    if any(t is not None for t in (cache_batch_idx, cache_leftpad, k_descale, rotary_cos)):
        return False
    batch = cu_seqlens_q.shape[0] - 1
    return (max(q.shape[-1], v_cache.shape[-1]) <= MAX_HEAD_DIM and k_cache.dtype == q.dtype
            and q.shape[0] >= configs.PAGED_PREFILL_MIN_QUERIES * max(batch, 1))


def _paged_prefill(plan: plans.LaunchPlan, call_key, q, k_cache, v_cache, seqused_k, block_table,
                   options: AttentionOptions, alibi_slopes, learnable_sink, cu_seqlens_q, max_seqlen_q, out):
    """Packed queries [total_q, Hq, D] against a paged cache by the forward kernel (:func:`paged_prefill_usable`)
    → (out [total_q, Hq, Dv], lse [Hq, total_q]); tokens outside every sequence get 0 and −inf."""
    total_q, nheads_q, head_dim = q.shape
    head_dim_v = v_cache.shape[-1]
    out = torch.zeros((total_q, nheads_q, head_dim_v), dtype=q.dtype, device=q.device) if out is None else out.zero_()
    lse = torch.full((nheads_q, total_q), float("-inf"), dtype=torch.float32, device=q.device)
    call = (q, k_cache, v_cache, out, lse, seqused_k, block_table, alibi_slopes, learnable_sink, cu_seqlens_q)

    def record(plan: plans.LaunchPlan) -> None:
        batch, capacity = block_table.shape[0], cache_capacity(k_cache, block_table)
        tensors = AttentionTensors(alibi_slopes=alibi_slopes, cu_seqlens_q=cu_seqlens_q,
                                   cu_seqlens_k=cu_seqlens_q,  # a stand-in: IS_PAGED replaces the key bounds
                                   learnable_sink=learnable_sink)
        shape = (batch, max_seqlen_q, capacity, nheads_q, k_cache.shape[2], head_dim)
        padded, padded_v = configs.block_d(head_dim), configs.block_d(head_dim_v)
        cfg = configs.paged_fwd_config(configs.fwd_config(max(padded, padded_v), q.dtype, options.window_right >= 0,
                                                          False, False), k_cache.shape[1])
        arguments = _variant_arguments(options, tensors, q, k_cache, shape, None)
        arguments.update(seqlen_k=capacity)  # the table's capacity, which clamps each sequence's key count
        plans.launch(
            plan, attn_fwd_kernel, (cdiv(max_seqlen_q, cfg["BLOCK_M"]), nheads_q, batch),
            Q=q, K=k_cache, V=v_cache, Out=out, Lse=lse, **arguments,
            Sinks=q if learnable_sink is None else learnable_sink,
            **_token_strides("q", q), **_token_strides("k", k_cache), **_token_strides("v", v_cache),
            **_token_strides("o", out), **_lse_strides(lse),
            HAS_SINK=learnable_sink is not None, USE_TMA=False, HEAD_DIM=head_dim, BLOCK_D=padded,
            HEAD_DIM_V=head_dim_v, BLOCK_DV=padded_v,
            WIDE=wide_offsets(q=q, k_cache=k_cache, v_cache=v_cache, out=out),
            **_pages(block_table, seqused_k, k_cache, cfg["BLOCK_N"]), **cfg,
        )

    with launch_device(q):
        plans.replay_or_record(call_key, plan, call, record)
    return out, lse


def _record_kvcache_attention(plan: plans.LaunchPlan, q, k_cache, v_cache, out_part, lse_part, seqlens_k,
                              cache_batch_idx, block_table, table, slopes, options: AttentionOptions, alibi_slopes,
                              learnable_sink, cu_seqlens_q, cache_leftpad, k_descale, v_descale, rotary_cos,
                              rotary_sin, rotary_start,
                              rotary_interleaved, head_dim, nheads_q, batch, rows) -> None:
    """The split-KV kernel's launch, by ``plan``'s configuration and split count; ``table`` and ``slopes``
    are the block table and ALiBi slopes as the kernel reads them, or stand-ins."""
    varlen, paged = cu_seqlens_q is not None, block_table is not None
    head_dim_v = v_cache.shape[-1]
    nheads_k = k_cache.shape[2]
    max_seqlen_k = cache_capacity(k_cache, block_table)
    softcap = options.softcap
    chunk, padded_v = configs.decode_chunk_d(head_dim), configs.block_d(head_dim_v)
    wide = wide_offsets(q=q, k_cache=k_cache, v_cache=v_cache, out=out_part, lse=lse_part)
    plans.launch(
        plan, kvcache_attn_fwd_kernel, (plan.num_m_blocks, batch * nheads_k, plan.num_splits),
        Q=q, K=k_cache, V=v_cache, Out=out_part, Lse=lse_part, SeqlensK=seqlens_k,
        CacheBatchIdx=seqlens_k if cache_batch_idx is None else cache_batch_idx, BlockTable=table,
        AlibiSlopes=slopes, Sinks=slopes if learnable_sink is None else learnable_sink,
        CuSeqlensQ=cu_seqlens_q if varlen else seqlens_k,
        CacheLeftpad=seqlens_k if cache_leftpad is None else cache_leftpad,
        KDescale=slopes if k_descale is None else k_descale, VDescale=slopes if v_descale is None else v_descale,
        **_descale_strides(k_descale), **_rotary_arguments(rotary_cos, rotary_sin, rotary_interleaved, seqlens_k),
        RotaryStart=seqlens_k if rotary_start is None else rotary_start,
        ROTARY_AT_START=options.window == (-1, -1),
        **_token_strides("q", q), **_strides("k", "bshd", k_cache.stride()),
        **_strides("v", "bshd", v_cache.stride()), **_strides("o", "pbshd", _packed_rows(out_part, varlen)),
        **_strides("l", "pbhs", _packed_rows(lse_part, varlen)), **_strides("t", "bn", table.stride()),
        **_strides("a", "bh", slopes.stride()),
        nheads_k=nheads_k, group_size=nheads_q // nheads_k, seqlen_q=rows, num_splits=plan.num_splits,
        page_size=k_cache.shape[1], capacity=max_seqlen_k, cache_rows=k_cache.shape[0],
        qk_scale=options.softmax_scale * LOG2E,
        softcap_scale=options.softmax_scale / softcap if softcap > 0 else 0.0, softcap_log2=softcap * LOG2E,
        window_left=options.window_left, window_right=options.window_right,
        IS_PAGED=paged, PAGE_SPLIT=configs.page_split(k_cache.shape[1], plan.cfg["BLOCK_N"]) if paged else 0,
        HAS_BATCH_IDX=cache_batch_idx is not None, IS_VARLEN_Q=varlen,
        HAS_LEFTPAD=cache_leftpad is not None, HAS_DESCALE=k_descale is not None,
        CONVERT_V_BY_PTX=k_descale is not None and _converts_float8_by_ptx(q.device),
        MASK_LEFT=options.window_left >= 0, MASK_RIGHT=options.window_right >= 0,
        HAS_SOFTCAP=softcap > 0, HAS_ALIBI=alibi_slopes is not None, HAS_SINK=learnable_sink is not None,
        HEAD_DIM=head_dim, BLOCK_D=chunk, HEAD_DIM_V=head_dim_v, BLOCK_DV=padded_v,
        DOT_PRECISION=configs.dot_precision(q.dtype), WIDE=wide, **plan.cfg,
    )


def _float8_format(dtype) -> dict:
    """The float8 cache format's largest value, mantissa bits and smallest normal exponent (zeros without one)."""
    if dtype is None:
        return dict(FP8_MAX=0.0, FP8_MANTISSA=0, FP8_MIN_EXPONENT=0)
    info = torch.finfo(dtype)
    return dict(FP8_MAX=info.max, FP8_MANTISSA=round(-math.log2(info.eps)),
                FP8_MIN_EXPONENT=round(math.log2(info.tiny)))


def _rotary_arguments(rotary_cos, rotary_sin, interleaved: bool, stand_in) -> dict:
    """The rotary tables' kernel arguments (``decode._rotary``); without tables, ROTARY_DIM 0 and stand-ins.
    The tables must be contiguous (the kernels index their rows by one stride): the launchers make them
    so once per call, before a plan binds them."""
    if rotary_cos is None:
        return dict(RotaryCos=stand_in, RotarySin=stand_in, stride_ro=0, seqlen_ro=1, ROTARY_DIM=0,
                    ROTARY_INTERLEAVED=False)
    return dict(RotaryCos=rotary_cos, RotarySin=rotary_sin, stride_ro=rotary_cos.stride(0),
                seqlen_ro=rotary_cos.shape[0], ROTARY_DIM=2 * rotary_cos.shape[1], ROTARY_INTERLEAVED=interleaved)


def _descale_strides(k_descale) -> dict:
    """(batch, head) strides of the float8 scales (k's and v's are both (batch, nheads_k), contiguous)."""
    return _strides("s", "bh", (0, 0) if k_descale is None else k_descale.stride())


def kvcache_append(k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx=None, block_table=None,
                   cu_seqlens_new=None, max_seqlen_new: int = 0, k_descale=None, v_descale=None, rotary_cos=None,
                   rotary_sin=None, rotary_interleaved: bool = False) -> None:
    """Write k [B, Sn, Hk, D], v [B, Sn, Hk, Dv] into the caches in place at positions cache_seqlens[b] +
    0..Sn-1; writes outside the cache are dropped (``decode.kvcache_append_kernel``). With
    ``cu_seqlens_new`` (int32 [B + 1]) k, v are packed [total_new, Hk, D], the longest sequence
    appending ``max_seqlen_new``. A float8 cache stores x / descale (``k_descale``, ``v_descale`` [B, Hk]),
    saturated to the format's largest finite value. ``rotary_cos``, ``rotary_sin`` (seqlen_ro,
    rotary_dim / 2): k is rotated at its positions before it is stored."""
    call_key = plans.key("kvcache_append", max_seqlen_new, rotary_interleaved, k_cache, v_cache, k, v, cache_seqlens,
                         cache_batch_idx, block_table, cu_seqlens_new, k_descale, v_descale, rotary_cos, rotary_sin)
    plan = plans.lookup(call_key) or plans.LaunchPlan()
    table = block_table if block_table is not None else cache_seqlens[:, None]  # an unread stand-in when not paged
    if rotary_cos is not None:  # the kernel indexes the tables' rows by one stride
        rotary_cos, rotary_sin = rotary_cos.contiguous(), rotary_sin.contiguous()
    call = (k, v, k_cache, v_cache, cache_seqlens, cache_batch_idx, table, cu_seqlens_new, k_descale, v_descale,
            rotary_cos, rotary_sin)
    with launch_device(k):
        plans.replay_or_record(call_key, plan, call, lambda plan: _record_kvcache_append(
            plan, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table, table, cu_seqlens_new,
            max_seqlen_new, k_descale, v_descale, rotary_cos, rotary_sin, rotary_interleaved))


def _record_kvcache_append(plan: plans.LaunchPlan, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx,
                           block_table, table, cu_seqlens_new, max_seqlen_new, k_descale, v_descale, rotary_cos,
                           rotary_sin, rotary_interleaved) -> None:
    varlen = cu_seqlens_new is not None
    if varlen:
        (_, nheads_k, head_dim), batch, seqlen_new = k.shape, cache_seqlens.shape[0], max_seqlen_new
    else:
        batch, seqlen_new, nheads_k, head_dim = k.shape
    paged = block_table is not None
    capacity = cache_capacity(k_cache, block_table)
    block_s = min(64, next_power_of_2(seqlen_new))
    plans.launch(
        plan, kvcache_append_kernel, (cdiv(seqlen_new, block_s), nheads_k, batch),
        K=k, V=v, KCache=k_cache, VCache=v_cache, CacheSeqlens=cache_seqlens,
        CacheBatchIdx=cache_seqlens if cache_batch_idx is None else cache_batch_idx, BlockTable=table,
        CuSeqlensNew=cu_seqlens_new if varlen else cache_seqlens,
        KDescale=cache_seqlens if k_descale is None else k_descale,
        VDescale=cache_seqlens if v_descale is None else v_descale, **_descale_strides(k_descale),
        **_rotary_arguments(rotary_cos, rotary_sin, rotary_interleaved, cache_seqlens),
        **_token_strides("k", k), **_token_strides("v", v),
        **_strides("c", "bshd", k_cache.stride()), **_strides("w", "bshd", v_cache.stride()),
        **_strides("t", "bn", table.stride()),
        seqlen_new=k.shape[0] if varlen else seqlen_new, page_size=k_cache.shape[1], capacity=capacity,
        cache_rows=k_cache.shape[0], IS_PAGED=paged, HAS_BATCH_IDX=cache_batch_idx is not None,
        IS_VARLEN=varlen, HAS_DESCALE=k_descale is not None,
        **_float8_format(k_cache.dtype if k_descale is not None else None), HEAD_DIM=head_dim,
        BLOCK_D=configs.block_d(head_dim), HEAD_DIM_V=v.shape[-1], BLOCK_DV=configs.block_d(v.shape[-1]),
        BLOCK_S=block_s, WIDE=wide_offsets(k=k, v=v, k_cache=k_cache, v_cache=v_cache),
    )


def merge_states_into(outs: torch.Tensor, lses: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
    """outs [P, N, S, H, D], lses [P, N, H, S] (any strides) merged into out [N, S, H, D] (any float
    dtype) and lse [N, H, S] float32, written in place."""
    call_key = plans.key("merge", outs, lses, out, lse)
    plan = plans.lookup(call_key) or plans.LaunchPlan()
    with launch_device(outs):
        plans.replay_or_record(call_key, plan, (outs, lses, out, lse),
                               lambda plan: _record_merge(plan, outs, lses, out, lse))


def _record_merge(plan: plans.LaunchPlan, outs, lses, out, lse) -> None:
    """The merge kernel's launch for :func:`merge_states_into`'s arguments, recorded in ``plan``; none where
    there is nothing to merge."""
    if out.numel() == 0 and lse.numel() == 0:
        return
    _, n, seqlen, nheads, head_dim = outs.shape
    block_s = min(16, next_power_of_2(seqlen))
    plans.launch(
        plan, merge_states_kernel, (cdiv(seqlen, block_s), nheads, n), Outs=outs, Lses=lses, Out=out, Lse=lse,
        **_strides("o", "pnshd", outs.stride()), **_strides("l", "pnhs", lses.stride()),
        **_strides("m", "nshd", out.stride()), **_strides("L", "nhs", lse.stride()),
        num_parts=outs.shape[0], seqlen=seqlen, HEAD_DIM=head_dim, BLOCK_D=configs.block_d(head_dim),
        BLOCK_S=block_s, WIDE=wide_offsets(outs=outs, lses=lses, out=out, lse=lse),
    )
