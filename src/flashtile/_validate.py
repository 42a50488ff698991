"""Every argument check and default of flashtile's public functions, in one place.

The public modules (``interface``, ``decode``, ``merge``, ``distributed``) call these before any
work, so the same argument gets the same exception type and message everywhere: a ``TypeError``
for a wrong type or dtype, a ``ValueError`` for a wrong value or shape, each naming the argument
and the shapes involved. Checks read only what is on the host (shapes, dtypes, Python scalars):
none synchronises with the GPU. The defaults (softmax scale, causal folded into the window) come
from ``flashtile._options``, which the reference shares.
"""

from __future__ import annotations

import functools
import math
import numbers
import operator
import os

import torch

from ._options import AttentionOptions, cache_capacity, default_softmax_scale, fold_causal

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# a KV cache may also be float8 (with per-(sequence, KV head) scales) under 16-bit queries
FLOAT8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# Index tensors on a GPU are checked only on request: reading their contents costs a host sync.
CHECK_INPUTS_VARIABLE = "FLASHTILE_CHECK_INPUTS"
MAX_HEAD_DIM = 256
# KV-cache attention also takes absorbed MLA decoding (DeepSeek-V3): q/k head dim 576, v head dim 512
MAX_KVCACHE_HEAD_DIM, MAX_KVCACHE_HEAD_DIM_V = 576, 512
MAX_GRID_Y = 65535  # CUDA's limit on a grid's second and third axes


def check_tensors(names, tensors, ndim: int) -> None:
    """Each is a float16/bfloat16/float32 tensor of ``ndim`` dimensions."""
    for name, t in zip(names, tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != ndim:
            raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
        if t.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{name} must be float16, bfloat16 or float32, got {t.dtype}")


def check_head_dim(head_dim: int, shapes, name: str = "head dim", limit: int = MAX_HEAD_DIM) -> None:
    """``shapes()`` formats the inputs' shapes for the message, only when it raises."""
    if not 1 <= head_dim <= limit:
        raise ValueError(f"{name} must be in 1..{limit}, got {head_dim} ({shapes()})")


def check_qkv(q, k, v, *, heads_axis: int, names=("q", "k", "v"), packed: bool = False) -> None:
    """Validate (batch, ..., headdim) inputs, or (total, nheads, headdim) when ``packed``."""
    check_tensors(names, (q, k, v), 3 if packed else 4)
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    q_shape, k_shape, v_shape = q.shape, k.shape, v.shape  # each .shape builds a new torch.Size

    def shapes():  # formatted for an error only: this check runs on every call
        return f"q {tuple(q_shape)}, k {tuple(k_shape)}, v {tuple(v_shape)}"

    # equal shapes first: slicing a torch.Size builds another (~0.1 µs each), and MHA's k and v are alike
    if k_shape != v_shape and k_shape[:-1] != v_shape[:-1]:
        raise ValueError(f"k and v must have the same shape but for the head dim, got {shapes()}")
    if not packed and q_shape[0] != k_shape[0]:
        raise ValueError(f"batch sizes differ: {shapes()}")
    head_dim = q_shape[-1]
    if head_dim != k_shape[-1]:
        raise ValueError(f"head dims of q and k differ: {shapes()}")
    check_head_dim(head_dim, shapes)
    check_head_dim(v_shape[-1], shapes, "head dim of v")
    nheads_q, nheads_k = q_shape[heads_axis], k_shape[heads_axis]
    if nheads_k == 0 or nheads_q % nheads_k != 0:
        raise ValueError(
            f"nheads of q ({nheads_q}) must be a multiple of nheads of k/v ({nheads_k}): {shapes()}"
        )


def check_packed(name, t, ndim, count) -> None:
    """``t`` stacks ``count`` tensors on dim −3 (qkv: 3, kv: 2)."""
    check_tensors((name,), (t,), ndim)
    if t.shape[-3] != count:
        raise ValueError(f"{name} must have size {count} in dim -3, got shape {tuple(t.shape)}")


def checks_contents(t: torch.Tensor) -> bool:
    """Whether an index tensor's values are checked: always on the CPU, where reading them is free;
    on a GPU with ``FLASHTILE_CHECK_INPUTS=1`` (one sync per tensor); never while torch.compile
    traces (the values are data it cannot branch on), nor on a tensor torch.func wraps (vmap's have no
    values to read). Unchecked, the kernels still never touch memory outside their tensors (each
    module's docstring says what a bad value gives)."""
    if torch.compiler.is_compiling() or torch._C._functorch.is_functorch_wrapped_tensor(t):
        return False
    return t.device.type == "cpu" or os.environ.get(CHECK_INPUTS_VARIABLE) == "1"


def _shown(values: list[int]) -> str:
    return str(values) if len(values) <= 12 else f"[{', '.join(map(str, values[:12]))}, ...] ({len(values)} values)"


def _cu_lengths(name: str, values: list[int]) -> list[int]:
    """The sequence lengths of cumulative ``values``, which must not decrease."""
    lengths = [end - start for start, end in zip(values, values[1:])]
    if any(length < 0 for length in lengths):
        raise ValueError(f"{name} must be non-decreasing (sequence lengths ≥ 0), got {_shown(values)}")
    return lengths


def _check_cu_values(name: str, cu: torch.Tensor, total: int, tensor: str, max_name: str, max_seqlen: int) -> None:
    values = cu.tolist()
    if values[0] != 0:
        raise ValueError(f"{name} must start at 0, got {_shown(values)}")
    lengths = _cu_lengths(name, values)
    if values[-1] > total:
        raise ValueError(f"{name} ends at {values[-1]}, past the {total} tokens of {tensor}: {_shown(values)}")
    if lengths and max(lengths) > max_seqlen:
        raise ValueError(f"{max_name}={max_seqlen} is less than the longest sequence of {name} ({max(lengths)})")


def check_cu_tensor(name: str, cu, device) -> None:
    """A 1-D int32 (batch + 1,) tensor of cumulative lengths on ``device``."""
    if not isinstance(cu, torch.Tensor) or cu.dtype != torch.int32 or cu.dim() != 1 or cu.numel() < 1:
        got = f"{cu.dtype} of shape {tuple(cu.shape)}" if isinstance(cu, torch.Tensor) else type(cu).__name__
        raise TypeError(f"{name} must be a 1-D int32 tensor (batch + 1,), got {got}")
    if cu.device != device:
        raise ValueError(f"{name} must be on {device}, got {cu.device}")


def check_paged_cu_seqlens_k(cu_seqlens_k, cu_seqlens_q, device) -> None:
    """cu_seqlens_k of a paged varlen call, where its differences are the keys each sequence uses in the
    cache (its total bounds no tensor): one entry per cu_seqlens_q entry, non-decreasing where its values
    are read (:func:`checks_contents`)."""
    check_cu_tensor("cu_seqlens_k", cu_seqlens_k, device)
    if isinstance(cu_seqlens_q, torch.Tensor) and cu_seqlens_k.shape != cu_seqlens_q.shape:
        raise ValueError(f"cu_seqlens_k must have cu_seqlens_q's shape (batch + 1,) = {tuple(cu_seqlens_q.shape)}, "
                         f"got {tuple(cu_seqlens_k.shape)}")
    if checks_contents(cu_seqlens_k):
        _cu_lengths("cu_seqlens_k", cu_seqlens_k.tolist())


def _check_max_seqlen(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise TypeError(f"{name} must be an int ≥ 0, got {value!r}")


def check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, device, total_q: int,
                     total_k: int) -> None:
    """cu_seqlens: 1-D int32 (batch + 1,) on ``device``; their values (see :func:`checks_contents`):
    from 0, non-decreasing, within the total_q / total_k tokens, no sequence longer than max_seqlen."""
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        check_cu_tensor(name, cu, device)
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise ValueError(f"cu_seqlens_q {tuple(cu_seqlens_q.shape)} and cu_seqlens_k "
                         f"{tuple(cu_seqlens_k.shape)} must have the same length (batch + 1)")
    for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        _check_max_seqlen(name, value)
    if checks_contents(cu_seqlens_q):
        _check_cu_values("cu_seqlens_q", cu_seqlens_q, total_q, "q", "max_seqlen_q", max_seqlen_q)
        _check_cu_values("cu_seqlens_k", cu_seqlens_k, total_k, "k", "max_seqlen_k", max_seqlen_k)


def _integer(value) -> int | None:
    """``value`` as an int if it is integer-like — a Python or numpy int, or a 0-d integer tensor —
    else None. A bool is not an int here: ``(True, 0)`` is far more likely a mistake."""
    if isinstance(value, torch.Tensor):
        integral = value.dim() == 0 and not value.is_floating_point() and not value.is_complex()
        return int(value) if integral and value.dtype != torch.bool else None
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def flag(name: str, value) -> bool:
    """A yes/no option: a bool, a numpy bool, or an integer-like 0 or 1 (``causal=1``, a 0-d tensor); not a
    string or a float, which Python's truthiness would read as yes (``causal="no"``)."""
    if isinstance(value, bool):
        return value
    # a 0-d bool tensor, or a numpy bool (dtype kind "b"; numpy is not imported for it)
    dtype = getattr(value, "dtype", None)
    if (dtype == torch.bool or getattr(dtype, "kind", None) == "b") and getattr(value, "shape", None) == ():
        return bool(value)
    integer = _integer(value)
    if integer not in (0, 1):
        raise TypeError(f"{name} must be a bool, got {value!r}")
    return bool(integer)


def window(window_size, causal) -> tuple[int, int]:
    """(left, right) of a valid ``window_size`` with causal folded in (right = 0)."""
    causal = flag("causal", causal)
    bounds = [_integer(w) for w in window_size] if isinstance(window_size, (tuple, list)) else []
    if len(bounds) != 2 or not all(w is not None and w >= -1 for w in bounds):
        raise ValueError(f"window_size must be a pair of ints ≥ -1 (-1 = unbounded), got {window_size!r}")
    return fold_causal(bounds, causal)


def finite_number(name: str, value) -> float:
    """A real number (int, float or numpy scalar; not bool) that is finite → float."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return value


KERNEL_SCALAR_MAX = torch.finfo(torch.float32).max / 2  # room for the factor log2 e = 1.44


def finite_float32(name: str, value) -> float:
    """:func:`finite_number` that the kernels can hold: they take it in float32 times log2 e (1.44), where a
    larger one would become inf and the result NaN."""
    value = finite_number(name, value)
    if abs(value) > KERNEL_SCALAR_MAX:
        raise ValueError(f"{name} must be at most {KERNEL_SCALAR_MAX:.3g} in magnitude (the kernels take it in "
                         f"float32), got {value}")
    return value


def check_alibi(alibi_slopes, batch: int, nheads: int, device):
    """→ the slopes, contiguous: float32 (nheads,) or (batch, nheads); None passes through."""
    if alibi_slopes is None:
        return None
    if not isinstance(alibi_slopes, torch.Tensor) or alibi_slopes.dtype != torch.float32:
        raise TypeError(f"alibi_slopes must be a float32 tensor, got {getattr(alibi_slopes, 'dtype', alibi_slopes)}")
    if tuple(alibi_slopes.shape) not in ((nheads,), (batch, nheads)):
        raise ValueError(f"alibi_slopes must have shape ({nheads},) or ({batch}, {nheads}), "
                         f"got {tuple(alibi_slopes.shape)}")
    if alibi_slopes.device != device:
        raise ValueError(f"alibi_slopes must be on {device}, got {alibi_slopes.device}")
    return alibi_slopes.contiguous()


def check_rotary(rotary_cos, rotary_sin, head_dim: int, device, capacity: int, appends: bool) -> None:
    """rotary_cos and rotary_sin: together or not at all, only with new k and v to append (``appends``:
    they rotate q and the new keys; flash-attn 2 refuses them without), float tensors of one shape
    (seqlen_ro, rotary_dim / 2) on the inputs' device, rotary_dim ≤ headdim ≤ 256, with a row for each of
    the cache's ``capacity`` positions (flash-attn 2's rule: the kernels would clamp a position past the
    table to its last row)."""
    if rotary_cos is None and rotary_sin is None:
        return
    if not appends:
        raise ValueError("rotary_cos and rotary_sin rotate q and the new keys: pass k and v to append as well "
                         "(as flash-attn 2 requires), or rotate q yourself")
    for name, t in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise TypeError(f"{name} must be a float tensor (seqlen_ro, rotary_dim / 2), got "
                            f"{getattr(t, 'dtype', type(t).__name__)}")
        if t.device != device:
            raise ValueError(f"{name} must be on {device}, got {t.device}")
    if rotary_cos.dim() != 2 or rotary_cos.shape != rotary_sin.shape or rotary_cos.shape[0] == 0:
        raise ValueError(f"rotary_cos and rotary_sin must share one shape (seqlen_ro ≥ 1, rotary_dim / 2), got "
                         f"{tuple(rotary_cos.shape)} and {tuple(rotary_sin.shape)}")
    if not 1 <= 2 * rotary_cos.shape[1] <= head_dim:
        raise ValueError(f"rotary_dim = 2 · {rotary_cos.shape[1]} must be in 1..headdim ({head_dim})")
    if rotary_cos.shape[0] < capacity:
        raise ValueError(f"rotary_cos and rotary_sin need a row for each of the KV cache's {capacity} positions "
                         f"(seqlen_ro ≥ the cache's seqlen, as in flash-attn), got {rotary_cos.shape[0]} rows")
    if head_dim > 256:  # the kernels rotate the tile they load, one chunk of at most 256 channels
        raise ValueError(f"rotary embeddings take head dims up to 256 (as flash-attn 2), got headdim {head_dim}")


def check_descale(k_descale, v_descale, k_cache, batch: int, device):
    """→ (k_descale, v_descale): float32 (batch, nheads_k) contiguous scales of a float8 cache (ones where
    none are given); None for a cache in the queries' dtype, which takes none."""
    float8 = k_cache.dtype in FLOAT8_DTYPES
    if not float8:
        if k_descale is not None or v_descale is not None:
            raise ValueError(f"k_descale and v_descale scale a float8 KV cache; k_cache is {k_cache.dtype}")
        return None, None
    shape = (batch, k_cache.shape[2])
    scales = []
    for name, t in (("k_descale", k_descale), ("v_descale", v_descale)):
        if t is None:
            t = torch.ones(shape, dtype=torch.float32, device=device)
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32:
            raise TypeError(f"{name} must be a float32 tensor (batch, nheads_k), got "
                            f"{getattr(t, 'dtype', type(t).__name__)}")
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} must have shape (batch, nheads_k) = {shape}, got {tuple(t.shape)}")
        if t.device != device:
            raise ValueError(f"{name} must be on {device}, got {t.device}")
        scales.append(t.contiguous())
    return tuple(scales)


def check_out(out, shape: tuple, dtype, device):
    """``out``: None, or a tensor of the result's shape, dtype and device (written in place)."""
    if out is None:
        return None
    if not isinstance(out, torch.Tensor) or out.dtype != dtype:
        raise TypeError(f"out must be a {dtype} tensor, got {getattr(out, 'dtype', type(out).__name__)}")
    if tuple(out.shape) != tuple(shape):
        raise ValueError(f"out must have shape {tuple(shape)}, got {tuple(out.shape)}")
    if out.device != device:
        raise ValueError(f"out must be on {device}, got {out.device}")
    _check_not_self_overlapping(out)
    return out


def _check_not_self_overlapping(out: torch.Tensor) -> None:
    """An ``out`` that a kernel writes in place: no two of its elements share memory."""
    if any(stride == 0 and size > 1 for size, stride in zip(out.shape, out.stride())):
        raise ValueError(f"out must not overlap itself (an expanded tensor), got strides {out.stride()} for shape "
                         f"{tuple(out.shape)}")


def check_cache_leftpad(cache_leftpad, batch: int, block_table, device, cache_seqlens, capacity: int):
    """cache_leftpad: None or int32 (batch,) on the inputs' device; not with a paged cache (as flash-attn).
    Where its values are read (:func:`checks_contents`), sequence b's first key is a slot of its old keys or
    the first new one: 0 ≤ cache_leftpad[b] ≤ cache_seqlens[b] (the cache's capacity where cache_seqlens is
    None), as flash-attn 2's tests draw it. Unchecked (a GPU tensor), the kernels clamp a value into
    [0, cache_seqlens[b] + new keys] (``flashtile.triton.decode``): no load leaves the cache."""
    if cache_leftpad is None:
        return None
    if block_table is not None:
        raise NotImplementedError("cache_leftpad cannot be combined with block_table (as in flash-attn)")
    _check_int32("cache_leftpad", cache_leftpad, (batch,))
    if cache_leftpad.device != device:
        raise ValueError(f"cache_leftpad must be on {device}, got {cache_leftpad.device}")
    if checks_contents(cache_leftpad):
        if isinstance(cache_seqlens, torch.Tensor) and checks_contents(cache_seqlens):
            ends = [(end, f"cache_seqlens[{b}]") for b, end in enumerate(cache_seqlens.tolist())]
        elif isinstance(cache_seqlens, int):
            ends = [(cache_seqlens, "cache_seqlens")] * batch
        else:
            ends = [(capacity, "the cache's capacity")] * batch
        for b, (start, (end, name)) in enumerate(zip(cache_leftpad.tolist(), ends)):
            if not 0 <= start <= end:
                raise ValueError(f"cache_leftpad[{b}]={start} must be in 0..{end} ({name})")
    return cache_leftpad


def check_learnable_sink(learnable_sink, nheads: int, device):
    """→ the sink logits, contiguous: float32 (nheads,) on the inputs' device; None passes through."""
    if learnable_sink is None:
        return None
    if not isinstance(learnable_sink, torch.Tensor) or learnable_sink.dtype != torch.float32:
        got = getattr(learnable_sink, "dtype", learnable_sink)
        raise TypeError(f"learnable_sink must be a float32 tensor, got {got}")
    if tuple(learnable_sink.shape) != (nheads,):
        raise ValueError(f"learnable_sink must have shape ({nheads},) (one logit per query head), "
                         f"got {tuple(learnable_sink.shape)}")
    if learnable_sink.device != device:
        raise ValueError(f"learnable_sink must be on {device}, got {learnable_sink.device}")
    return learnable_sink.contiguous()


def check_softcap(softcap) -> float:
    softcap = finite_float32("softcap", softcap)
    if softcap < 0:
        raise ValueError(f"softcap must be a number ≥ 0 (0 = off), got {softcap!r}")
    return softcap


def check_dropout(dropout_p) -> float:
    dropout_p = finite_number("dropout_p", dropout_p)
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    return dropout_p


def deterministic(asked) -> bool:
    """Whether the backward must be bitwise deterministic: when asked (flash-attn's ``deterministic``)
    or when PyTorch is told to use deterministic algorithms (``torch.use_deterministic_algorithms``,
    which SDPA's users rely on)."""
    return bool(asked) or torch.are_deterministic_algorithms_enabled()


def attention_options(head_dim: int, softmax_scale, causal, window_size, softcap, dropout_p=0.0,
                      max_seqlen_q: int = 0, max_seqlen_k: int = 0, deterministic_asked=False,
                      returns_lse: bool = True) -> AttentionOptions:
    """The validated options of one call, with the defaults applied. Calls whose options are plain
    Python values (the usual ones) are validated once per distinct set: ~5 µs of a CPU core a call."""
    arguments = (head_dim, softmax_scale, causal, window_size, softcap, dropout_p, max_seqlen_q, max_seqlen_k,
                 bool(returns_lse))
    options = (_plain_options(*arguments) if _plain(arguments) else _options(*arguments))
    return options._replace(deterministic=True) if deterministic(deterministic_asked) else options


def kvcache_options(head_dim: int, softmax_scale, causal, window_size, softcap, capacity: int) -> AttentionOptions:
    """:func:`attention_options` of a KV-cache call, with flash-attn 2's rule for windows: a side at least
    as long as the cache (``capacity`` positions) bounds no key and becomes −1, so such a call is not
    "local", which also decides where q is rotated (at cache_seqlens, not at its own positions)."""
    options = attention_options(head_dim, softmax_scale, causal, window_size, softcap)
    left, right = options.window
    if left >= capacity or right >= capacity:
        options = options._replace(window_left=-1 if left >= capacity else left,
                                   window_right=-1 if right >= capacity else right)
    return options


def _plain(arguments) -> bool:
    """Whether every option is a Python bool, int, float or None, the window a pair of ints: values
    that hash as they compare, so a cache keyed on them cannot hand one call's validation to another
    (a ``(True, 0)`` window would hash as ``(1, 0)`` and escape its error)."""
    head_dim, softmax_scale, causal, window_size, softcap, dropout_p, max_seqlen_q, max_seqlen_k, _ = arguments
    # spelled out, not all(...) over generators: this runs on every call
    return (type(window_size) is tuple and len(window_size) == 2
            and type(window_size[0]) is int and type(window_size[1]) is int and type(causal) is bool
            and type(head_dim) is int and type(max_seqlen_q) is int and type(max_seqlen_k) is int
            and type(softmax_scale) in _PLAIN_NUMBERS and type(softcap) in _PLAIN_NUMBERS
            and type(dropout_p) in _PLAIN_NUMBERS)


_PLAIN_NUMBERS = (float, int, type(None))


def _options(head_dim: int, softmax_scale, causal, window_size, softcap, dropout_p, max_seqlen_q: int,
             max_seqlen_k: int, returns_lse: bool) -> AttentionOptions:
    softcap, dropout_p = check_softcap(softcap), check_dropout(dropout_p)
    left, right = window(window_size, causal)
    if softmax_scale is not None:
        softmax_scale = finite_float32("softmax_scale", softmax_scale)
    softmax_scale = default_softmax_scale(head_dim, softmax_scale)
    if softcap > 0 and abs(softmax_scale / softcap) > KERNEL_SCALAR_MAX:  # the kernels scale scores by this
        raise ValueError(f"softmax_scale / softcap must be at most {KERNEL_SCALAR_MAX:.3g} in magnitude (the "
                         f"kernels take it in float32), got {softmax_scale} / {softcap}")
    return AttentionOptions(softmax_scale, left, right, softcap, dropout_p, max_seqlen_q, max_seqlen_k, False,
                            returns_lse)


# typed: 1 and 1.0 (and True) are distinct keys; a call that raises caches nothing
_plain_options = functools.lru_cache(maxsize=1024, typed=True)(_options)


def check_attn_mask(attn_mask, q, k) -> None:
    """SDPA's attn_mask for q, k in (batch, nheads, seqlen, headdim): None, or a bool or float16/bfloat16/
    float32 tensor on q's device that broadcasts to (batch, nheads, seqlen_q, seqlen_k)."""
    if attn_mask is None:
        return
    if not isinstance(attn_mask, torch.Tensor):
        raise TypeError(f"attn_mask must be a torch.Tensor, got {type(attn_mask).__name__}")
    full = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    # broadcastable to exactly `full`: a loop, not torch.broadcast_shapes (~60 µs) or any() over a generator
    # (~4 µs; this runs on every call)
    shape = attn_mask.shape
    broadcasts = len(shape) <= 4
    for size, target in zip(shape, full[4 - len(shape):] if broadcasts else ()):
        broadcasts = broadcasts and (size == 1 or size == target)
    if not broadcasts:
        raise ValueError(f"attn_mask of shape {tuple(shape)} does not broadcast to "
                         f"(batch, nheads, seqlen_q, seqlen_k) = {full}")
    if attn_mask.device != q.device:
        raise ValueError(f"attn_mask must be on {q.device}, got {attn_mask.device}")
    if attn_mask.dtype != torch.bool and attn_mask.dtype not in FLOAT_DTYPES:
        raise TypeError(f"attn_mask must be bool or float16/bfloat16/float32, got {attn_mask.dtype}")


def attn_mask_to_bias(attn_mask, q):
    """A mask :func:`check_attn_mask` accepted as an additive bias: bool True = may attend (else −inf),
    float added as it is."""
    if attn_mask is None or attn_mask.dtype != torch.bool:
        return attn_mask
    return torch.full(attn_mask.shape, -math.inf, dtype=q.dtype, device=q.device).masked_fill_(attn_mask, 0.0)


# ----------------------------------------------------------------------------------------------
# Attention against a KV cache


def _check_int32(name, t, shape) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {t.dtype}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")


def check_kvcache_inputs(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table,
                         cu_seqlens_q=None, max_seqlen_q=None, seqlens_name: str = "cache_seqlens") -> int:
    """The tensors of ``flash_attn_with_kvcache`` (and of the paged varlen call) → the batch size; an
    int ``cache_seqlens`` must fit the cache. With ``cu_seqlens_q`` q and the new k, v are packed
    (total_q, nheads, headdim), sequence b's at rows [cu_seqlens_q[b], cu_seqlens_q[b + 1]).
    ``seqlens_name``: how the caller names ``cache_seqlens`` (the paged varlen call's ``seqused_k``)."""
    packed = cu_seqlens_q is not None
    tensors = [("q", q), ("k_cache", k_cache), ("v_cache", v_cache)]
    if (k is None) != (v is None):
        raise ValueError("k and v must be given together (or both None)")
    if k is not None:
        tensors += [("k", k), ("v", v)]
    float8_cache = isinstance(k_cache, torch.Tensor) and k_cache.dtype in FLOAT8_DTYPES
    for name, t in tensors:
        if float8_cache and name in ("k_cache", "v_cache"):
            if not isinstance(t, torch.Tensor) or t.dtype != k_cache.dtype or t.dim() != 4:
                raise TypeError(f"{name} must be a 4-D {k_cache.dtype} tensor like k_cache, got "
                                f"{getattr(t, 'dtype', type(t).__name__)} of shape {tuple(getattr(t, 'shape', ()))}")
            if q.dtype not in (torch.float16, torch.bfloat16):
                raise TypeError(f"a float8 KV cache needs float16 or bfloat16 queries, got q {q.dtype}")
            if t.device != q.device:
                raise ValueError(f"{name} must be on q's device {q.device}, got {t.device}")
            continue
        check_tensors((name,), (t,), 3 if packed and name in ("q", "k", "v") else 4)
        if t.dtype != q.dtype:
            raise TypeError(f"{name} must have q's dtype {q.dtype}, got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name} must be on q's device {q.device}, got {t.device}")

    def shapes() -> str:  # formatted for an error only: this check runs on every decoding step
        return f"q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}"

    if packed:
        check_cu_tensor("cu_seqlens_q", cu_seqlens_q, q.device)
        _check_max_seqlen("max_seqlen_q", max_seqlen_q)
        if checks_contents(cu_seqlens_q):
            _check_cu_values("cu_seqlens_q", cu_seqlens_q, q.shape[0], "q", "max_seqlen_q", max_seqlen_q)
        (total_q, nheads_q, head_dim), batch = q.shape, cu_seqlens_q.numel() - 1
    else:
        batch, seqlen_q, nheads_q, head_dim = q.shape
    if k_cache.shape[:-1] != v_cache.shape[:-1]:
        raise ValueError(f"k_cache and v_cache must have the same shape but for the head dim, got {shapes()}")
    nheads_k, head_dim_v = k_cache.shape[2], v_cache.shape[3]
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"head dims of q and k_cache differ: {shapes()}")
    check_head_dim(head_dim, shapes, limit=MAX_KVCACHE_HEAD_DIM)
    check_head_dim(head_dim_v, shapes, "head dim of v_cache", MAX_KVCACHE_HEAD_DIM_V)
    if nheads_k == 0 or nheads_q % nheads_k != 0:
        raise ValueError(f"nheads of q ({nheads_q}) must be a multiple of nheads of the cache ({nheads_k}): {shapes()}")
    if batch * nheads_k > MAX_GRID_Y:
        raise ValueError(f"batch · nheads of the cache ({batch} · {nheads_k}) must be ≤ {MAX_GRID_Y}, the kernel "
                         f"grid's second axis: split the batch into several calls ({shapes()})")
    if k is not None:
        for name, t, dim in (("k", k, head_dim), ("v", v, head_dim_v)):
            dims = "headdim_v" if t is v else "headdim"
            expected, layout = (((total_q, nheads_k, dim), f"(total_q, nheads_k, {dims}), packed like q") if packed
                                else ((batch, k.shape[1], nheads_k, dim), f"(batch, seqlen_new, nheads_k, {dims})"))
            if tuple(t.shape) != expected:
                raise ValueError(f"{name} must be {layout} = {expected}, got {tuple(t.shape)} ({shapes()})")
        if cache_seqlens is None:
            raise ValueError("cache_seqlens is required when k and v are appended to the cache")
    if isinstance(cache_seqlens, torch.Tensor):
        _check_int32(seqlens_name, cache_seqlens, (batch,))
    elif cache_seqlens is not None and (not isinstance(cache_seqlens, int) or isinstance(cache_seqlens, bool)):
        raise TypeError(f"cache_seqlens must be an int or an int32 tensor, got {type(cache_seqlens).__name__}")
    if block_table is not None:
        if cache_batch_idx is not None:
            raise NotImplementedError("cache_batch_idx cannot be combined with block_table (as in flash-attn)")
        if not isinstance(block_table, torch.Tensor) or block_table.dim() != 2:
            raise ValueError(f"block_table must be a 2-D (batch, max_blocks) int32 tensor, got "
                             f"{tuple(block_table.shape) if isinstance(block_table, torch.Tensor) else block_table!r}")
        _check_int32("block_table", block_table, (batch, block_table.shape[1]))
        if k_cache.shape[1] == 0:  # the kernels find a key's page by dividing by the page size
            raise ValueError(f"a paged cache needs pages of at least one slot, got k_cache {tuple(k_cache.shape)}")
        capacity = cache_capacity(k_cache, block_table)
    else:
        if cache_batch_idx is not None:
            _check_int32("cache_batch_idx", cache_batch_idx, (batch,))
        elif k_cache.shape[0] != batch:
            raise ValueError(f"batch sizes differ: {shapes()}; pass cache_batch_idx to use other cache rows")
        capacity = cache_capacity(k_cache, None)
    for name, t in ((seqlens_name, cache_seqlens), ("cache_batch_idx", cache_batch_idx),
                    ("block_table", block_table)):
        if isinstance(t, torch.Tensor) and t.device != q.device:
            raise ValueError(f"{name} must be on q's device {q.device}, got {t.device}")
    def new_lengths() -> list[int]:
        """Each sequence's new keys: packed, from cu_seqlens_q where its values are free to read, else
        at most max_seqlen_q. Built only where a check reads it (not on a GPU decoding step's path)."""
        if packed and k is not None:
            if checks_contents(cu_seqlens_q):
                bounds = cu_seqlens_q.tolist()
                return [end - start for start, end in zip(bounds, bounds[1:])]
            return [max_seqlen_q] * batch
        return [k.shape[1] if k is not None else 0] * batch

    if isinstance(cache_seqlens, int):
        needed = cache_seqlens + max(new_lengths(), default=0)
        if not 0 <= cache_seqlens or needed > capacity:
            raise ValueError(f"cache_seqlens={cache_seqlens} (+ {needed - cache_seqlens} new) does not fit "
                             f"a cache of {capacity} positions")
    _check_kvcache_indices(k_cache, cache_seqlens, new_lengths, capacity, cache_batch_idx, block_table, seqlens_name)
    return batch


def _check_kvcache_indices(k_cache, cache_seqlens, new_lengths, capacity: int, cache_batch_idx,
                           block_table, seqlens_name: str) -> None:
    """The values of the index tensors, where :func:`checks_contents` reads them: every sequence
    (with its ``new_lengths()[b]`` new keys) fits the cache, cache rows and the pages it uses exist."""
    cache_rows, page_size = k_cache.shape[:2]
    reads_seqlens = isinstance(cache_seqlens, torch.Tensor) and checks_contents(cache_seqlens)
    reads_table = block_table is not None and checks_contents(block_table)
    if reads_seqlens or reads_table:
        new_lengths = new_lengths()
    if reads_seqlens:
        lengths = cache_seqlens.tolist()
        bad = [(b, n) for b, n in enumerate(lengths) if not 0 <= n <= capacity - new_lengths[b]]
        if bad:
            b, n = bad[0]
            raise ValueError(f"{seqlens_name}[{b}]={n} (+ {new_lengths[b]} new) does not fit a cache of {capacity} "
                             f"positions ({len(bad)} sequences out of range)")
    if cache_batch_idx is not None and checks_contents(cache_batch_idx):
        rows = cache_batch_idx.tolist()
        bad = [(b, r) for b, r in enumerate(rows) if not 0 <= r < cache_rows]
        if bad:
            raise ValueError(f"cache_batch_idx[{bad[0][0]}]={bad[0][1]} is not a row of the cache "
                             f"(0..{cache_rows - 1})")
    if reads_table:
        if isinstance(cache_seqlens, torch.Tensor):
            lengths = [n + new for n, new in zip(cache_seqlens.tolist(), new_lengths)]
        else:
            lengths = [capacity if cache_seqlens is None else cache_seqlens + new for new in new_lengths]
        for b, (row, length) in enumerate(zip(block_table.tolist(), lengths)):
            used = row[:-(-length // page_size)]  # the pages holding the sequence's keys
            bad = [(j, page) for j, page in enumerate(used) if not 0 <= page < cache_rows]
            if bad:
                raise ValueError(f"block_table[{b}, {bad[0][0]}]={bad[0][1]} is not a page of the cache "
                                 f"(0..{cache_rows - 1})")


def check_num_splits(num_splits) -> int:
    if not isinstance(num_splits, int) or isinstance(num_splits, bool) or num_splits < 0:
        raise ValueError(f"num_splits must be an int ≥ 0, got {num_splits!r}")
    return num_splits


# ----------------------------------------------------------------------------------------------
# Merging partial results


def check_states(outs, lses, names=("outs", "lses")) -> None:
    """outs [P, ..., seqlen, nheads, headdim] float16/bfloat16/float32 and lses [P, ..., nheads,
    seqlen], floating point (the merge weighs in float32: float64 outputs would be merged at float32
    precision, so they are refused rather than silently rounded). ``names``: the caller's for the two."""
    for name, t in zip(names, (outs, lses)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if outs.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{names[0]} must be float16, bfloat16 or float32, got {outs.dtype}")
    if outs.dim() < 4:
        raise ValueError(f"outs must be [P, ..., seqlen, nheads, headdim], got shape {tuple(outs.shape)}")
    if outs.shape[0] == 0:
        raise ValueError(f"outs must hold at least one partial result (P ≥ 1), got shape {tuple(outs.shape)}")
    expected = (*outs.shape[:-3], outs.shape[-2], outs.shape[-3])
    if tuple(lses.shape) != expected:
        raise ValueError(
            f"lses must be [P, ..., nheads, seqlen] = {expected} for outs {tuple(outs.shape)}, got {tuple(lses.shape)}"
        )
    if outs.device != lses.device:
        raise ValueError(f"{names[0]} and {names[1]} must be on one device, got {outs.device}, {lses.device}")


def check_state_pair(out_a, lse_a, out_b, lse_b) -> None:
    """Two partial results to merge have the same shapes."""
    for name, a, b in (("out", out_a, out_b), ("lse", lse_a, lse_b)):
        for part, t in (("a", a), ("b", b)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name}_{part} must be a torch.Tensor, got {type(t).__name__}")
        if a.shape != b.shape:
            raise ValueError(f"{name}_a {tuple(a.shape)} and {name}_b {tuple(b.shape)} must have the same shape")


def check_combine(out_partial, lse_partial, out, out_dtype=None) -> None:
    """FA3's combine layouts: out_partial (splits, batch, seqlen, nheads, headdim), lse_partial
    (splits, batch, seqlen, nheads), and out (batch, seqlen, nheads, headdim) if given; the result's
    dtype (``out``'s, ``out_dtype``) float16, bfloat16 or float32, and the two the same where both are given."""
    for name, t, ndim in (("out_partial", out_partial, 5), ("lse_partial", lse_partial, 4)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != ndim:
            raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if lse_partial.shape != out_partial.shape[:4]:
        raise ValueError(f"lse_partial must be (num_splits, batch, seqlen, nheads) = {tuple(out_partial.shape[:4])} "
                         f"for out_partial {tuple(out_partial.shape)}, got {tuple(lse_partial.shape)}")
    if out_partial.shape[0] == 0:
        raise ValueError(f"out_partial must hold at least one split (num_splits ≥ 1), got shape "
                         f"{tuple(out_partial.shape)}")
    # dtypes and devices, by the merge's own rule
    check_states(out_partial, lse_partial.transpose(-1, -2), names=("out_partial", "lse_partial"))
    if out is not None:
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
        if out.shape != out_partial.shape[1:]:
            raise ValueError(f"out must have shape {tuple(out_partial.shape[1:])}, got {tuple(out.shape)}")
        if out.dtype not in FLOAT_DTYPES:
            raise TypeError(f"out must be float16, bfloat16 or float32, got {out.dtype}")
        if out.device != out_partial.device:
            raise ValueError(f"out must be on out_partial's device {out_partial.device}, got {out.device}")
        _check_not_self_overlapping(out)
        if out_dtype is not None and out_dtype != out.dtype:
            raise TypeError(f"out_dtype {out_dtype} differs from out's dtype {out.dtype}")
    if out_dtype is not None and out_dtype not in FLOAT_DTYPES:
        raise TypeError(f"out_dtype must be torch.float16, torch.bfloat16 or torch.float32, got {out_dtype}")

