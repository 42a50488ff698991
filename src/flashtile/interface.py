"""Public functions: thin, validating, documented. The work happens in ``flashtile.autograd``.

flash-attn 2's functions (``flash_attn_func`` and its packed and variable-length
forms) and an SDPA-compatible ``attention``. Arguments shared by all of them:

* ``softmax_scale`` (``scale``): defaults to 1 / sqrt(headdim).
* ``causal``: aligned to the bottom-right corner. With seqlen_q = 2 and
  seqlen_k = 5 (1 = attended)::

      1 1 1 1 0
      1 1 1 1 1

  and with seqlen_q = 5, seqlen_k = 2 the first three rows see nothing (their
  output is 0, their log-sum-exp −inf)::

      0 0
      0 0
      0 0
      1 0
      1 1
* ``window_size=(left, right)``: query i sees key j iff
  i + Nk − Nq − left ≤ j ≤ i + Nk − Nq + right; −1 is unbounded; with causal,
  right is 0. K/V blocks outside the window are skipped, so the cost grows with
  the window, not with the sequence. The rule holds as written for every bound:
  flash-attn instead turns a bound ≥ seqlen_k into −1, which differs when
  seqlen_q > seqlen_k + right (its first rows then see every key, here none).
* ``softcap > 0``: scores become softcap · tanh(scores / softcap) (Gemma 2).
* ``alibi_slopes`` (nheads,) or (batch, nheads), float32: adds
  −slope · |i + Nk − Nq − j| to the scores.
* ``dropout_p``: dropout on the attention probabilities, with a Philox
  counter-based generator seeded from PyTorch's generator on the inputs' device
  (so ``torch.manual_seed`` reproduces a call); the backward regenerates the mask.
* ``deterministic``: accepted for compatibility; the backward never uses atomics,
  so it is bitwise deterministic whatever this says.
"""

from __future__ import annotations

import math

import torch

from . import reference
from .autograd import KV_PACKED, QKV_PACKED, SEPARATE, FlashAttnFunction, Scalars

MAX_HEAD_DIM = 256
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _check_tensors(names, tensors, ndim: int):
    for name, t in zip(names, tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != ndim:
            raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
        if t.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"{name} must be float16, bfloat16 or float32, got {t.dtype}")


def _check_inputs(q, k, v, *, heads_axis: int, names=("q", "k", "v"), packed: bool = False):
    """Validate (batch, ..., headdim) inputs, or (total, nheads, headdim) when ``packed``."""
    _check_tensors(names, (q, k, v), 3 if packed else 4)
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")

    def shapes():  # formatted for an error only: this check runs on every call
        return f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"

    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {shapes()}")
    if not packed and q.shape[0] != k.shape[0]:
        raise ValueError(f"batch sizes differ: {shapes()}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"head dims differ: {shapes()}")
    head_dim = q.shape[-1]
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head dim must be in 1..{MAX_HEAD_DIM}, got {head_dim} ({shapes()})")
    nheads_q, nheads_k = q.shape[heads_axis], k.shape[heads_axis]
    if nheads_k == 0 or nheads_q % nheads_k != 0:
        raise ValueError(
            f"nheads of q ({nheads_q}) must be a multiple of nheads of k/v ({nheads_k}): {shapes()}"
        )


def _check_packed(name, t, ndim, count):
    _check_tensors((name,), (t,), ndim)
    if t.shape[-3] != count:
        raise ValueError(f"{name} must have size {count} in dim -3, got shape {tuple(t.shape)}")


def _check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, device):
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(cu, torch.Tensor) or cu.dtype != torch.int32 or cu.dim() != 1 or cu.numel() < 1:
            got = f"{cu.dtype} of shape {tuple(cu.shape)}" if isinstance(cu, torch.Tensor) else type(cu).__name__
            raise TypeError(f"{name} must be a 1-D int32 tensor (batch + 1,), got {got}")
        if cu.device != device:
            raise ValueError(f"{name} must be on {device}, got {cu.device}")
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise ValueError(f"cu_seqlens_q {tuple(cu_seqlens_q.shape)} and cu_seqlens_k "
                         f"{tuple(cu_seqlens_k.shape)} must have the same length (batch + 1)")
    for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if not isinstance(value, int) or value < 0:
            raise TypeError(f"{name} must be an int ≥ 0, got {value!r}")


def _window(window_size, causal: bool) -> tuple[int, int]:
    if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2
            or not all(isinstance(w, int) and w >= -1 for w in window_size)):
        raise ValueError(f"window_size must be a pair of ints ≥ -1 (-1 = unbounded), got {window_size!r}")
    left, right = window_size
    return left, 0 if causal else right


def _check_alibi(alibi_slopes, batch: int, nheads: int, device):
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


def _check_scalars(softcap, dropout_p):
    if softcap < 0:
        raise ValueError(f"softcap must be ≥ 0 (0 = off), got {softcap}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")


def _attend(layout, a, b, c, q, k, *, softmax_scale, causal, window_size, softcap, alibi_slopes, dropout_p,
            attn_bias=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=0, max_seqlen_k=0,
            return_attn_probs=False):
    """Shared tail of every public function; q and k are views for shapes (heads on dim −2)."""
    varlen = cu_seqlens_q is not None
    batch = cu_seqlens_q.numel() - 1 if varlen else q.shape[0]
    _check_scalars(softcap, dropout_p)
    left, right = _window(window_size, bool(causal))
    alibi_slopes = _check_alibi(alibi_slopes, batch, q.shape[-2], q.device)
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    dropout_seed = None
    if dropout_p > 0:
        dropout_seed = torch.randint(0, 2**63 - 1, (1,), dtype=torch.int64, device=q.device)
    scalars = Scalars(scale, left, right, float(softcap), float(dropout_p), max_seqlen_q, max_seqlen_k)
    if cu_seqlens_k is cu_seqlens_q:
        cu_seqlens_k = None  # FlashAttnFunction's spelling of "the same"
    out, lse = FlashAttnFunction.apply(layout, a, b, c, attn_bias, alibi_slopes, dropout_seed,
                                       cu_seqlens_q, cu_seqlens_k, scalars)
    if not return_attn_probs:
        return out
    probs = None
    if dropout_p > 0 and not varlen:
        probs = _dropout_probs(q, k, _unpack_v(layout, a, b, c), scalars, alibi_slopes, attn_bias, dropout_seed)
    return out, lse, probs


def _unpack_v(layout, a, b, c):
    return a.unbind(-3)[2] if layout == QKV_PACKED else b.unbind(-3)[1] if layout == KV_PACKED else c


def _dropout_probs(q, k, v, scalars: Scalars, alibi_slopes, attn_bias, dropout_seed):
    """flash-attn's S_dmask, for testing: the undropped probabilities (batch, nheads, Nq, Nk)
    with the entries that dropout removed negated. O(N²) memory, formed by the reference."""
    with torch.no_grad():
        qt, kt, vt = (t.transpose(1, 2).float() for t in (q, k, v))  # float32: P exact to its rounding
        seed = int(dropout_seed.item())
        _, _, p = reference.attention_forward(
            qt, kt, vt, scalars.softmax_scale, window_size=(scalars.window_left, scalars.window_right),
            softcap=scalars.softcap, alibi_slopes=alibi_slopes, attn_bias=attn_bias,
        )
        keep = reference.dropout_keep_mask(seed, q.shape[0], q.shape[2], q.shape[1], k.shape[1],
                                           scalars.dropout_p, device=q.device)
        return torch.where(keep, p, -p).to(q.dtype)


def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
):
    """Exact attention ``softmax(q kᵀ · softmax_scale) v``, argument-compatible with flash-attn 2.

    Arguments (the shared ones are described in the module docstring):
        q: (batch, seqlen_q, nheads, headdim), float16 / bfloat16 / float32.
        k, v: (batch, seqlen_k, nheads_k, headdim); nheads a multiple of nheads_k
            (GQA/MQA: query head h uses KV head h // (nheads // nheads_k)).
        return_attn_probs: also return the log-sum-exp and, when dropout_p > 0, the
            probabilities with dropped entries negated (flash-attn's S_dmask, for
            testing; O(N²) memory), else None.

    Returns:
        out (batch, seqlen_q, nheads, headdim) in q's dtype; with return_attn_probs,
        ``(out, softmax_lse, S_dmask)`` where softmax_lse is (batch, nheads, seqlen_q),
        float32, natural log.
    """
    _check_inputs(q, k, v, heads_axis=2)
    return _attend(SEPARATE, q, k, v, q, k, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                   softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p,
                   return_attn_probs=return_attn_probs)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                              softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """:func:`flash_attn_func` on qkv (batch, seqlen, 3, nheads, headdim); the gradient comes packed
    the same way, written in place with no concatenation."""
    _check_packed("qkv", qkv, 5, 3)
    q, k, v = qkv.unbind(-3)
    _check_inputs(q, k, v, heads_axis=2)
    return _attend(QKV_PACKED, qkv, None, None, q, k, softmax_scale=softmax_scale, causal=causal,
                   window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p,
                   return_attn_probs=return_attn_probs)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                             softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """:func:`flash_attn_func` on q and kv (batch, seqlen_k, 2, nheads_k, headdim); kv's gradient
    comes packed the same way."""
    _check_packed("kv", kv, 5, 2)
    k, v = kv.unbind(-3)
    _check_inputs(q, k, v, heads_axis=2)
    return _attend(KV_PACKED, q, kv, None, q, k, softmax_scale=softmax_scale, causal=causal,
                   window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p,
                   return_attn_probs=return_attn_probs)


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
):
    """Attention over a batch of sequences packed without padding, as flash-attn 2's.

    Arguments:
        q: (total_q, nheads, headdim), the sequences' queries one after another.
        k, v: (total_k, nheads_k, headdim).
        cu_seqlens_q, cu_seqlens_k: int32 (batch + 1,), the cumulative sequence
            lengths: sequence b is tokens [cu[b], cu[b + 1]). Each sequence attends only
            within itself; causal and windows are aligned per sequence (bottom-right).
            Lengths may be 0.
        max_seqlen_q, max_seqlen_k: ints, the longest sequence lengths (they size the
            grid; no host sync reads cu_seqlens).
        alibi_slopes: (nheads,) or (batch, nheads). The rest as :func:`flash_attn_func`.

    Returns:
        out (total_q, nheads, headdim); with return_attn_probs, ``(out, softmax_lse, None)``
        with softmax_lse (nheads, total_q), float32, natural log.
    """
    _check_inputs(q, k, v, heads_axis=1, packed=True)
    _check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q.device)
    return _attend(SEPARATE, q, k, v, q, k, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                   softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p, cu_seqlens_q=cu_seqlens_q,
                   cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                   return_attn_probs=return_attn_probs)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None,
                                     causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                                     deterministic=False, return_attn_probs=False):
    """:func:`flash_attn_varlen_func` on qkv (total, 3, nheads, headdim), with one cu_seqlens."""
    _check_packed("qkv", qkv, 4, 3)
    q, k, v = qkv.unbind(-3)
    _check_inputs(q, k, v, heads_axis=1, packed=True)
    _check_cu_seqlens(cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, q.device)
    return _attend(QKV_PACKED, qkv, None, None, q, k, softmax_scale=softmax_scale, causal=causal,
                   window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p,
                   cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens, max_seqlen_q=max_seqlen,
                   max_seqlen_k=max_seqlen, return_attn_probs=return_attn_probs)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """:func:`flash_attn_varlen_func` on q and kv (total_k, 2, nheads_k, headdim)."""
    _check_packed("kv", kv, 4, 2)
    k, v = kv.unbind(-3)
    _check_inputs(q, k, v, heads_axis=1, packed=True)
    _check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q.device)
    return _attend(KV_PACKED, q, kv, None, q, k, softmax_scale=softmax_scale, causal=causal,
                   window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p,
                   cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                   max_seqlen_k=max_seqlen_k, return_attn_probs=return_attn_probs)


def _attn_mask_as_bias(attn_mask, q, k):
    """SDPA's attn_mask as an additive bias: bool True = may attend (else −inf), float added."""
    if attn_mask is None:
        return None
    if not isinstance(attn_mask, torch.Tensor):
        raise TypeError(f"attn_mask must be a torch.Tensor, got {type(attn_mask).__name__}")
    full = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    try:
        broadcast = torch.broadcast_shapes(attn_mask.shape, full)
    except RuntimeError:
        broadcast = None
    if broadcast != full:
        raise ValueError(f"attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to "
                         f"(batch, nheads, seqlen_q, seqlen_k) = {full}")
    if attn_mask.device != q.device:
        raise ValueError(f"attn_mask must be on {q.device}, got {attn_mask.device}")
    if attn_mask.dtype == torch.bool:
        return torch.zeros(attn_mask.shape, dtype=q.dtype, device=q.device).masked_fill(~attn_mask, -math.inf)
    if attn_mask.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"attn_mask must be bool or float16/bfloat16/float32, got {attn_mask.dtype}")
    return attn_mask


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """Drop-in for ``torch.nn.functional.scaled_dot_product_attention``.

    q: (batch, nheads, seqlen_q, headdim); k, v: (batch, nheads_k, seqlen_k, headdim).
    ``attn_mask``: bool (True = may attend) or float (added to the scaled scores),
    broadcastable to (batch, nheads, seqlen_q, seqlen_k); a float mask that requires
    grad gets its gradient (reduced over broadcast dims). ``dropout_p`` is applied as
    given, as SDPA does (pass 0 in eval). ``enable_gqa=True`` is required when
    nheads_k < nheads, as in SDPA. ``is_causal`` is aligned to the bottom-right corner
    as in flash-attn (SDPA aligns it top-left; the two agree when seqlen_q = seqlen_k)
    and, as in SDPA, cannot be combined with attn_mask. Returns (batch, nheads,
    seqlen_q, headdim).
    """
    _check_inputs(q, k, v, heads_axis=1)
    if q.shape[1] != k.shape[1] and not enable_gqa:
        raise ValueError(
            f"nheads of q ({q.shape[1]}) and k ({k.shape[1]}) differ; pass enable_gqa=True for GQA/MQA"
        )
    if attn_mask is not None and is_causal:
        raise ValueError("attn_mask and is_causal cannot both be set (as in SDPA)")
    bias = _attn_mask_as_bias(attn_mask, q, k)
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    out = _attend(SEPARATE, qt, kt, vt, qt, kt, softmax_scale=scale, causal=is_causal, window_size=(-1, -1),
                  softcap=0.0, alibi_slopes=None, dropout_p=dropout_p, attn_bias=bias)
    return out.transpose(1, 2)
