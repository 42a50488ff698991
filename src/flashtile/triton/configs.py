"""Tuning of the Triton kernels: block shapes per head dim and dtype, and the thresholds that pick
a code path. Numbers come from sweeps on the H200 (benchmarks/tune_configs.py and
benchmarks/tma_threshold.py, bf16; benchmarks/NOTES.md has the tables). Nothing here launches.
"""

from __future__ import annotations

import torch

from ._host import next_power_of_2

INT32_MAX = 2**31 - 1
# On the H200, descriptor loads (with their configs) beat pointer loads at seqlen 4096-16384 in every
# standard case, and lost at 512-2048 in some (benchmarks/NOTES.md, v0.4).
TMA_MIN_SEQLEN = 4096
# (head dim, causal, persistent grid): the seqlen (the shorter of queries and keys) from which the Gluon
# forward (flashtile.gluon.sm90_fwd) beats the Triton one on the H200, its grid being persistent or not
# (``sm90_fwd.persistent``: over at most 2048 keys). At 128 everywhere (1.1-1.4x, v0.5). At 64 on the
# persistent grid from 512, the shortest measured (two consumers: 1.15-1.18x at N = 512-1024, causal
# 1.07-1.19x at 512-2048; below 512 neither the kernels nor the host time per call were compared); on a
# CTA per tile from 2048 (v0.5), causal from 4096 (1.07x there: NOTES.md, sixteenth session). At 192 and 256
# (a CTA per tile: those grids are never persistent) everywhere: 1.12-1.85x the Triton forward at N = 1024-16384,
# full and causal (H100, round 24; NOTES.md, twenty-fourth session); below 1024 unmeasured. The tests set it to
# {} to run the Triton forward on an sm_90 GPU.
GLUON_MIN_SEQLEN = {(128, False, True): 1, (128, True, True): 1, (128, False, False): 1, (128, True, False): 1,
                    (64, False, True): 512, (64, True, True): 512, (64, False, False): 2048, (64, True, False): 4096,
                    (192, False, False): 1, (192, True, False): 1, (256, False, False): 1, (256, True, False): 1}
# Packed queries against a paged cache: from this many queries per sequence on average on, the forward
# kernel (BLOCK_M rows of one head per program, as the contiguous varlen forward) takes them rather
# than the KV-cache kernel (a GQA group's heads in its rows: a few queries per sequence, decoding). H100,
# 32 sequences of 4096 keys, 32:8, d128 (benchmarks/features_round.py paged-route, round 25): the KV-cache
# kernel 197-203 us at 1-16 queries a sequence against the forward kernel's 352-360; at 32 259 against 366;
# at 64 the forward kernel 388 against 486. A vLLM-style mixed batch averaging 49 (58 rows decoding, 6
# prefilling 512): the KV-cache kernel 1743 us against 2091. The crossover lies between 49 and 64.
PAGED_PREFILL_MIN_QUERIES = 64

# Block shapes (BLOCK_M, BLOCK_N, num_warps, num_stages) for 16-bit inputs, from sweeps on the H200
# (benchmarks/tune_configs.py, bf16, seqlen 8192; benchmarks/NOTES.md has the tables).
_FWD_16BIT = {
    # (largest BLOCK_D, causal, tensor descriptors): config
    (64, False, True): (128, 64, 8, 3), (64, True, True): (128, 64, 4, 3),
    (128, False, True): (128, 128, 8, 3), (128, True, True): (128, 128, 8, 3),
    (256, False, True): (64, 32, 4, 3), (256, True, True): (64, 32, 4, 3),
    # pointer loads (short or packed sequences): causal favours smaller Q blocks there
    (64, False, False): (128, 64, 8, 3), (64, True, False): (64, 64, 4, 3),
    (128, False, False): (128, 128, 8, 3), (128, True, False): (64, 64, 4, 3),
    (256, False, False): (64, 32, 4, 2), (256, True, False): (64, 32, 4, 2),
}
# The backward's two kernels each have their own config: (dK/dV kernel, dQ kernel).
_BWD_16BIT = {
    64: ((64, 64, 4, 3), (64, 64, 4, 3)),
    128: ((64, 64, 4, 2), (64, 64, 4, 2)),
    256: ((32, 32, 4, 2), (64, 32, 4, 1)),
}
# Head dims held in two chunks of 128 + up to 64 (``bwd_head_dim_chunks``: 192, and 129-160 as 128 + 32) take
# tiles of their own: the 256-wide class's were chosen before the chunks, and the corrected tuner's sweep at 192
# found narrower dK/dV blocks and a second dQ stage faster (H100, bf16, seqlen 4096, round 24: the whole backward
# with the dK/dV (16, 64, 4, 2) 5.13 ms against 6.86, causal 3.03 against 3.77; with the dQ (64, 32, 4, 2) 6.27
# against 6.78, causal 3.35 against 3.67, each swept with the other kernel at the class's default). The 128 + 32
# heads and MLA's 192/128 take them untimed, by the same register and shared-memory argument.
_BWD_16BIT_TWO_CHUNKS = {256: ((16, 64, 4, 2), (64, 32, 4, 2))}
# float32 tiles are twice as wide in shared memory: half the blocks (not tuned).
_FWD_32BIT = {64: (128, 32, 4, 3), 128: (128, 32, 8, 2), 256: (64, 16, 4, 2)}
_BWD_32BIT = {
    64: ((64, 32, 4, 2), (64, 32, 4, 2)),
    128: ((32, 32, 8, 2), (32, 32, 8, 2)),
    256: ((16, 16, 4, 1), (16, 16, 4, 1)),
}


def block_d(head_dim: int) -> int:
    """The head dim padded to a power of two ≥ 16 inside the kernels (masked loads; users never pad)."""
    return max(16, next_power_of_2(head_dim))


def bwd_head_dim_chunks(head_dim: int) -> tuple[int, int]:
    """(first chunk, second chunk or 0) in which the backward kernels hold a head dim: a power of two and a
    smaller one (192 = 128 + 64, 96 = 64 + 32, 80 = 64 + 16) where the two cover fewer columns than
    :func:`block_d`'s padding, whose zero columns every matmul would multiply (a quarter of the work at 192
    and 96); one chunk, padded as :func:`block_d`, elsewhere (powers of two, and 224 = 128 + 128)."""
    padded = block_d(head_dim)
    first = padded // 2
    if first < 32 or head_dim <= first:
        return padded, 0
    second = max(16, next_power_of_2(head_dim - first))
    return (first, second) if first + second < padded else (padded, 0)


def dot_precision(dtype: torch.dtype) -> str:
    # float32 inputs get exact float32 products, as torch.matmul gives them by default.
    return "ieee" if dtype == torch.float32 else "tf32"


def _config(block_m, block_n, num_warps, num_stages) -> dict:
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps, num_stages=num_stages)


def _size_class(padded_head_dim: int) -> int:
    return 64 if padded_head_dim <= 64 else 128 if padded_head_dim <= 128 else 256


def fwd_config(padded_head_dim: int, dtype: torch.dtype, causal: bool, has_bias: bool = False,
               tma: bool = False) -> dict:
    """The forward kernel's block shapes, warps and pipeline stages."""
    if dtype == torch.float32:
        return _config(*_FWD_32BIT[_size_class(padded_head_dim)])
    block_m, block_n, num_warps, num_stages = _FWD_16BIT[(_size_class(padded_head_dim), causal, tma)]
    if has_bias:
        # the pipelined [BLOCK_M, BLOCK_N] bias tiles must fit beside K and V in shared memory:
        # (128, 128, 8, 3) at hdim 128 asked for 288 KiB of the H200's 227 KiB
        block_n = min(block_n, 64)
    return _config(block_m, block_n, num_warps, num_stages)


def bwd_configs(head_dim: int, head_dim_v: int, dtype: torch.dtype) -> tuple[dict, dict]:
    """(dK/dV kernel config, dQ kernel config) for Q/K's ``head_dim`` and V's ``head_dim_v``: by the wider one's
    padded size class, and whether the kernels hold it in two chunks (:func:`bwd_head_dim_chunks`)."""
    widest = max(head_dim, head_dim_v)
    size = _size_class(block_d(widest))
    if dtype == torch.float32:
        table = _BWD_32BIT
    elif bwd_head_dim_chunks(widest)[1] > 0 and size in _BWD_16BIT_TWO_CHUNKS:
        table = _BWD_16BIT_TWO_CHUNKS
    else:
        table = _BWD_16BIT
    dkdv, dq = table[size]
    return _config(*dkdv), _config(*dq)


def decode_programs_per_sm(cache_dtype: torch.dtype) -> int:
    """How many KV-cache programs per SM the split heuristic aims for: two, or four for a float8 cache,
    whose blocks carry half the bytes in flight (batch 16, 8192 keys, 32:8 on the H100: 133 µs at the
    heuristic's two splits, 126 at four, 125.5 at eight; results/serving_2026-12-05/r2_h100_tune_fp8.log)."""
    return 4 if cache_dtype.itemsize == 1 else 2


def page_split(page_size: int, block_n: int) -> int:
    """How the forward and KV-cache kernels read a paged key block's page ids (``PAGE_SPLIT``,
    ``attention._paged_rows``, ``decode._paged_rows``): 1 when every block lies in one page,
    ``block_n // page_size`` scalar loads when the block spans up to 4 whole pages, else 0, a vector load
    that Triton's pipeliner makes an asynchronous copy the K/V copies must wait behind (0.34× the contiguous
    forward on an H100 at every page size; benchmarks/NOTES.md)."""
    if page_size % block_n == 0:
        return 1
    if block_n % page_size == 0 and block_n // page_size <= 4:
        return block_n // page_size
    return 0


def paged_fwd_config(config: dict, page_size: int) -> dict:
    """The forward kernel's ``config`` for a paged cache of ``page_size``: where its key block spans more than
    4 pages (:func:`page_split` 0: 16-key pages and 128-key blocks, a non-causal head dim 128 call) the block
    narrows to 4 pages, if that leaves it 16 keys at least (``tl.dot``'s least), so that its page ids stay
    scalar loads and out of the copies' way."""
    block_n = config["BLOCK_N"]
    if page_split(page_size, block_n) == 0 and block_n % page_size == 0 and 4 * page_size >= 16:
        return dict(config, BLOCK_N=4 * page_size)
    return config


def decode_chunk_d(head_dim: int) -> int:
    """The KV-cache kernel's Q·Kᵀ chunk of the head dim: the whole padded head dim up to 256 (Q stays
    in registers), 64-wide chunks beyond (absorbed MLA's 576 = 9 · 64)."""
    return block_d(head_dim) if head_dim <= 256 else 64


def decode_config(head_dim: int, dtype: torch.dtype, query_rows: int) -> dict:
    """Block shapes of the KV-cache kernel (``head_dim``: the larger of Q/K's and V's; ``dtype``: q's):
    the M block holds the packed (query position, head) rows, at least 16 for tl.dot. A float8 cache
    takes the same blocks and more programs (:func:`decode_programs_per_sm`): with K and V in tensors of
    their own, 128-key blocks read it at 0.67 of the copy bandwidth, these at 0.70, and these split 4 ways
    at 0.74 (H100, batch 16, 8192 keys, 32:8; results/serving_2026-12-05/r2_h100_tune_fp8.log). Beyond
    256 (absorbed MLA, a [BLOCK_M, 512] float32 accumulator) the blocks shrink; those shapes are not
    tuned on a GPU."""
    wide = dtype == torch.float32
    block_m = min(64, max(16, next_power_of_2(query_rows)))
    if head_dim <= 128:
        return dict(BLOCK_M=block_m, BLOCK_N=64 if not wide else 32, num_warps=4, num_stages=3)
    if head_dim <= 256:
        return dict(BLOCK_M=min(block_m, 32), BLOCK_N=32 if not wide else 16, num_warps=4, num_stages=2)
    return dict(BLOCK_M=16, BLOCK_N=32 if not wide else 16, num_warps=8, num_stages=2)
