"""What ``flashtile bench`` measures: the shapes, their FLOPs, and the attention providers.

A provider's ``build(shape, q, k, v)`` → (``attend(q, k, v)`` → out, context to measure in).
FlexAttention (torch >= 2.5) and flash-attn are imported by their builders, when a case runs:
each may be missing or broken on a given machine (``Provider.unavailable`` says why, before
anything runs).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch.backends.cuda import SDPAParams, can_use_flash_attention
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from ...interface import flash_attn_func

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
BWD_FLOPS_FACTOR = 2.5
# The unit of the rates in the tables and plots: attention on a CPU runs at well under 1 TFLOP/s,
# where TFLOP/s would print as 0.000364. The records keep their *_tflops fields in TFLOP/s.
RATE_UNITS = {"cuda": "TFLOP/s", "cpu": "GFLOP/s"}
PER_TFLOPS = {"TFLOP/s": 1.0, "GFLOP/s": 1e3}
FLOPS_RULE = ("fwd 4*B*H*Nq*Nk*D, x0.5 if causal and Nq = Nk, exact visible pairs if causal and Nq != Nk; "
              "bwd 2.5x fwd; fwd_bwd 3.5x fwd")


@dataclasses.dataclass(frozen=True)
class Shape:
    batch: int
    seqlen_q: int
    seqlen_k: int
    nheads: int
    nheads_k: int
    headdim: int
    causal: bool
    dtype: str  # a key of DTYPES

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.headdim)


def forward_flops(shape: Shape) -> float:
    """FLOPs of QKᵀ and PV over the visible pairs (see flashtile.cli.bench's docstring)."""
    nq, nk = shape.seqlen_q, shape.seqlen_k
    if not shape.causal:
        pairs = nq * nk
    elif nq == nk:
        pairs = nq * nk / 2
    else:  # query i sees keys j ≤ i + nk − nq (bottom-right), at most nk of them
        pairs = sum(min(nk, max(0, i + nk - nq + 1)) for i in range(nq))
    return 4.0 * shape.batch * shape.nheads * shape.headdim * pairs


# ----------------------------------------------------------------------------------------------
# Providers: build(shape, q, k, v) → (attend(q, k, v) → out, context to measure in)


class Unsupported(Exception):
    """A provider cannot run a case; the message says why."""


@dataclasses.dataclass(frozen=True)
class Provider:
    name: str
    label: str
    layout: str  # "bshd" (flash-attn's) or "bhsd" (SDPA's)
    build: Callable
    cuda_only: bool = False
    imports: tuple[str, str] | None = None  # (module, attribute) that the builder imports

    def unavailable(self, device: str) -> str | None:
        """Why this provider cannot run on ``device`` ("cuda" or "cpu"), or None when it can."""
        reasons = []
        if self.cuda_only and device != "cuda":
            reasons.append("needs CUDA, and this machine has none")
        if self.imports:
            error = _import_error(*self.imports)
            if error:
                reasons.append(f"cannot import {'.'.join(self.imports)}: {error}")
        return "; ".join(reasons) or None


def _flashtile(shape, q, k, v, deterministic=False):
    return (lambda q, k, v: flash_attn_func(q, k, v, softmax_scale=shape.scale, causal=shape.causal,
                                            deterministic=deterministic)), contextlib.nullcontext()


def _sdpa(backend_name: str):
    def build(shape, q, k, v):
        kwargs = dict(scale=shape.scale, enable_gqa=shape.nheads != shape.nheads_k)
        if shape.causal and shape.seqlen_q != shape.seqlen_k:
            kwargs["attn_mask"] = _sdpa_bottom_right_causal(backend_name, shape, q, k, v)
        else:
            kwargs["is_causal"] = shape.causal
        return (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, **kwargs)), \
            sdpa_kernel(getattr(SDPBackend, backend_name))

    return build


def _sdpa_bottom_right_causal(backend_name, shape, q, k, v):
    # SDPA's is_causal aligns top-left. Bottom-right needs CausalBias, which bypasses
    # sdpa_kernel and calls the flash kernel itself when it can, so only sdpa_flash is
    # measurable, and only where the flash kernel takes the inputs.
    if backend_name != "FLASH_ATTENTION":
        raise Unsupported("causal with seqlen_q != seqlen_k: SDPA's is_causal is top-left aligned, and "
                          "CausalBias (bottom-right) picks its own kernel (flash when it can)")
    if not can_use_flash_attention(SDPAParams(q, k, v, None, 0.0, False, shape.nheads != shape.nheads_k), True):
        raise Unsupported("CausalBias (bottom-right causal) would not use the flash kernel for these inputs")
    return causal_lower_right(shape.seqlen_q, shape.seqlen_k)


@functools.cache
def _compiled_flex_attention():
    from torch.nn.attention.flex_attention import flex_attention  # torch >= 2.5 only

    # dynamic=False: kernels specialised to each shape, as a model with fixed shapes gets
    # them. The sweep has more shapes than dynamo's default recompile limit (8), past
    # which it would silently fall back to eager flex_attention.
    config = torch._dynamo.config
    limit_name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    setattr(config, limit_name, max(getattr(config, limit_name), 256))
    return torch.compile(flex_attention, dynamic=False)


def _flex(shape, q, k, v):
    from torch.nn.attention.flex_attention import create_block_mask  # torch >= 2.5 only

    flex_attention = _compiled_flex_attention()
    block_mask = None
    if shape.causal:
        diagonal = shape.seqlen_k - shape.seqlen_q

        def bottom_right_causal(b, h, q_idx, kv_idx):
            return kv_idx <= q_idx + diagonal

        # once per shape, outside the timing, as a training loop builds it once
        block_mask = create_block_mask(bottom_right_causal, None, None, shape.seqlen_q, shape.seqlen_k,
                                       device=q.device)
    gqa = shape.nheads != shape.nheads_k
    return (lambda q, k, v: flex_attention(q, k, v, block_mask=block_mask, scale=shape.scale, enable_gqa=gqa)), \
        contextlib.nullcontext()


def _flash_attn_2(shape, q, k, v):
    from flash_attn import flash_attn_func as fa2

    return (lambda q, k, v: fa2(q, k, v, softmax_scale=shape.scale, causal=shape.causal)), contextlib.nullcontext()


def _flash_attn_4(shape, q, k, v):
    from flash_attn.cute import flash_attn_func as fa4

    def attend(q, k, v):
        result = fa4(q, k, v, softmax_scale=shape.scale, causal=shape.causal)
        return result[0] if isinstance(result, tuple) else result  # (out, lse) in recent versions

    return attend, contextlib.nullcontext()


@functools.cache
def _import_error(module: str, attribute: str) -> str | None:
    """Why ``module.attribute`` cannot be imported, or None when it can."""
    try:
        found = hasattr(importlib.import_module(module), attribute)
    except Exception as error:  # a broken install (missing CUDA libraries, ...) counts as absent
        return f"{type(error).__name__}: {error}"
    return None if found else f"{module} has no {attribute}"


PROVIDERS = {p.name: p for p in [
    Provider("flashtile", "flashtile", "bshd", _flashtile),
    Provider("flashtile_det", "flashtile deterministic=True", "bshd", functools.partial(_flashtile, deterministic=True)),
    Provider("sdpa_flash", "SDPA flash (FA2)", "bhsd", _sdpa("FLASH_ATTENTION")),
    Provider("sdpa_cudnn", "SDPA cuDNN", "bhsd", _sdpa("CUDNN_ATTENTION"), cuda_only=True),
    Provider("sdpa_efficient", "SDPA mem-efficient", "bhsd", _sdpa("EFFICIENT_ATTENTION"), cuda_only=True),
    Provider("sdpa_math", "SDPA math", "bhsd", _sdpa("MATH")),
    Provider("flex", "FlexAttention (compiled)", "bhsd", _flex, cuda_only=True,
             imports=("torch.nn.attention.flex_attention", "flex_attention")),
    Provider("fa2", "flash-attn 2", "bshd", _flash_attn_2, cuda_only=True, imports=("flash_attn", "flash_attn_func")),
    Provider("fa4", "FA4 (flash-attn-4 CuTe)", "bshd", _flash_attn_4, cuda_only=True,
             imports=("flash_attn.cute", "flash_attn_func")),
]}
