"""Pure-PyTorch references: the specification the Triton kernels are judged against.

Two algorithms, written so that each step of the derivation is visible:

* **Standard attention** materialises the scores ``S`` and ``P = softmax(S)``
  (O(N²) memory). Its backward is written out with the formulas

      dV = P_dropᵀ dO,   dP = dO Vᵀ,   dP_eff = dP ∘ Z,   D = rowsum(dO ∘ O),
      dS = P ∘ (dP_eff − D),   dS_raw = dS ∘ (1 − tanh²(q·k·scale / c))  (softcap c),
      dQ = scale · dS_raw K,   dK = scale · dS_rawᵀ Q,   d bias = dS,

  where ``Z = keep / (1 − p)`` is the dropout factor (1 without dropout) and
  ``P_drop = P ∘ Z``.

* **Tiled attention** (FlashAttention) never stores S or P. The forward walks
  the visible K/V blocks with an online softmax: each row keeps a running max
  ``m`` and sum ``ℓ``; a new block rescales both ``ℓ`` and the unnormalised
  output by ``exp(m_old − m_new)``; the output is divided by ``ℓ`` once at the
  end, and the log-sum-exp ``L = m + log ℓ`` is kept per row. The backward
  recomputes each block ``P_ij = exp(S_ij − L_i)`` from ``L`` and uses
  ``D_i = rowsum(dO_i ∘ O_i)``, which equals ``rowsum(dP_eff ∘ P)``. Extra memory
  is O(N), except the bias gradient, which is as large as the bias.

The tiled functions double as flashtile's CPU path: they batch over batch and
heads, so each block is one matmul. Both algorithms build a block's scores with
the same helper, in the order of ``flashtile.scores`` (the kernels' helpers):

1. ``s = q·k · scale``, or with softcap ``c > 0``: ``s = c · tanh(q·k · scale / c)``;
2. ALiBi: ``s −= slope · |i + Nk − Nq − j|``;
3. ``attn_bias``: a float bias is added; a bool bias is a mask (True = may attend);
4. visibility: key ``j`` is visible to query ``i`` iff
   ``i + Nk − Nq − left ≤ j ≤ i + Nk − Nq + right`` (−1 = unbounded; causal is
   ``right = 0``); invisible scores are −inf. Blocks entirely outside the window
   are skipped (:func:`key_range`, :func:`query_range`), never computed.

Dropout keeps ``P_ij`` iff a Philox-4x32-10 uniform ``u ≥ p``, the counter being
``(j, i, batch·nheads + head, 0)`` and the key the 64-bit seed, exactly as the
kernels' ``tl.random.philox`` draws it (:func:`philox_uniform`): any block of the
mask can be rebuilt on its own, so neither the kernels nor the tiled path store it.
The log-sum-exp is that of the undropped scores.

Conventions (shared with the kernels):
* layout (batch, nheads, seqlen, headdim), as ``scaled_dot_product_attention``;
  the variable-length functions take flash-attn's packed (total, nheads, headdim);
* GQA/MQA: query head ``h`` reads key/value head ``h // (nheads_q // nheads_k)``;
* the log-sum-exp is in natural log, float32 (float64 for float64 inputs);
* causal masking is aligned to the bottom-right corner: query ``i`` sees key
  ``j`` iff ``j ≤ i + seqlen_k − seqlen_q`` (flash-attn ≥ 2.1);
* a row that sees no key has output 0 and log-sum-exp −inf, and no NaN anywhere.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = [
    "normalize_window",
    "visible_mask",
    "causal_mask",
    "key_range",
    "query_range",
    "philox_uniform",
    "dropout_keep_mask",
    "online_softmax",
    "merge_softmax_states",
    "attention_forward",
    "attention_backward",
    "tiled_attention_forward",
    "tiled_attention_backward",
    "varlen_attention_forward",
    "tiled_varlen_attention_forward",
    "tiled_varlen_attention_backward",
]


# ----------------------------------------------------------------------------------------------
# Visibility: causal and sliding window, and the block ranges that skip invisible blocks


def normalize_window(causal: bool, window_size=(-1, -1)) -> tuple[int, int]:
    """(left, right) of the sliding window, −1 = unbounded; causal sets right = 0 (as flash-attn)."""
    left, right = (int(w) for w in window_size)
    return left, 0 if causal else right


def visible_mask(seqlen_q: int, seqlen_k: int, causal: bool = False, window_size=(-1, -1), device=None):
    """Boolean [seqlen_q, seqlen_k]: True where query i may attend key j.

    ``i + Nk − Nq − left ≤ j ≤ i + Nk − Nq + right``, a bound of −1 being absent;
    causal means ``right = 0`` (bottom-right alignment).
    """
    return _visible(torch.arange(seqlen_q, device=device), torch.arange(seqlen_k, device=device),
                    seqlen_k - seqlen_q, normalize_window(causal, window_size))


def causal_mask(seqlen_q: int, seqlen_k: int, device=None) -> torch.Tensor:
    """Boolean [seqlen_q, seqlen_k], True where query i may attend key j (bottom-right aligned)."""
    return visible_mask(seqlen_q, seqlen_k, causal=True, device=device)


def _visible(rows, cols, diagonal: int, window: tuple[int, int]) -> torch.Tensor:
    """Boolean [len(rows), len(cols)] by the window rule; ``diagonal = Nk − Nq``."""
    left, right = window
    rel = cols[None, :] - rows[:, None] - diagonal  # j − (i + Nk − Nq)
    visible = torch.ones(rel.shape, dtype=torch.bool, device=rel.device)
    if left >= 0:
        visible &= rel >= -left
    if right >= 0:
        visible &= rel <= right
    return visible


def key_range(row_start: int, row_end: int, seqlen_q: int, seqlen_k: int, window: tuple[int, int],
              block_n: int) -> tuple[int, int]:
    """[lo, hi) of the keys that queries [row_start, row_end) can see; lo a multiple of block_n.

    ``window`` is the normalised (left, right). Mirrors ``scores._key_range``: the
    K blocks ``range(lo, hi, block_n)`` are exactly those holding a visible key.
    """
    left, right = window
    diagonal = seqlen_k - seqlen_q
    lo = max(row_start + diagonal - left, 0) // block_n * block_n if left >= 0 else 0
    hi = min(row_end + diagonal + right, seqlen_k) if right >= 0 else seqlen_k
    return lo, hi


def query_range(col_start: int, col_end: int, seqlen_q: int, seqlen_k: int, window: tuple[int, int],
                block_m: int) -> tuple[int, int]:
    """[lo, hi) of the queries that see any of keys [col_start, col_end); lo a multiple of block_m.

    Mirrors ``scores._query_range``.
    """
    left, right = window
    diagonal = seqlen_k - seqlen_q
    lo = max(col_start - diagonal - right, 0) // block_m * block_m if right >= 0 else 0
    hi = min(col_end - diagonal + left, seqlen_q) if left >= 0 else seqlen_q
    return lo, hi


# ----------------------------------------------------------------------------------------------
# Dropout: Philox-4x32-10 as triton.language.random, in int64 arithmetic

_UINT32 = 0xFFFFFFFF
_PHILOX_KEY_A, _PHILOX_KEY_B = 0x9E3779B9, 0xBB67AE85
_PHILOX_ROUND_A, _PHILOX_ROUND_B = 0xD2511F53, 0xCD9E8D57
_PHILOX_ROUNDS = 10
_INT32_TO_UNIFORM = 4.6566127342e-10  # tl.random.uint_to_uniform_float: max int32 · this < 1 in float32


def _mul_wide(a: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(high, low) 32-bit words of ``a · x`` for a uint32 constant and uint32 values held in int64.

    Split into 16-bit halves so that no partial product overflows int64.
    """
    a_hi, a_lo = a >> 16, a & 0xFFFF
    x_hi, x_lo = x >> 16, x & 0xFFFF
    low_low = a_lo * x_lo  # < 2^32
    middle = a_hi * x_lo + a_lo * x_hi + (low_low >> 16)  # < 2^34
    high = a_hi * x_hi + (middle >> 16)
    low = ((middle & 0xFFFF) << 16) | (low_low & 0xFFFF)
    return high, low


def philox_uniform(seed: int, seq_head: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """float32 uniforms in [0, 1) of the dropout mask, bit-identical to the kernels' draw.

    Philox-4x32-10 (``triton.language.random.philox``) with key
    ``(seed mod 2³², seed >> 32)`` and counter ``(j, i, seq_head, 0)``; the first
    output word is mapped to [0, 1) as ``tl.random.uint_to_uniform_float`` does.
    ``seq_head`` [..., 1, 1] is ``batch·nheads + head``; rows [BM] and cols [BN] are
    query and key positions. Returns [..., BM, BN].
    """
    seed = int(seed)
    k0, k1 = seed & _UINT32, (seed >> 32) & _UINT32
    device = rows.device
    c0 = cols.to(torch.int64)[None, :] & _UINT32  # [1, BN]
    c1 = rows.to(torch.int64)[:, None] & _UINT32  # [BM, 1]
    c2 = seq_head.to(device=device, dtype=torch.int64) & _UINT32  # [..., 1, 1]
    c3 = torch.zeros((), dtype=torch.int64, device=device)
    for _ in range(_PHILOX_ROUNDS):
        high_b, low_b = _mul_wide(_PHILOX_ROUND_B, c2)
        high_a, low_a = _mul_wide(_PHILOX_ROUND_A, c0)
        c0, c1, c2, c3 = high_b ^ c1 ^ k0, low_b, high_a ^ c3 ^ k1, low_a
        # -- raise the key
        k0 = (k0 + _PHILOX_KEY_A) & _UINT32
        k1 = (k1 + _PHILOX_KEY_B) & _UINT32
    # bitcast the first word to int32, fold negatives onto [0, 2^31), scale in float32
    x = torch.where(c0 >= 2**31, c0 - 2**32, c0)
    x = torch.where(x < 0, -x - 1, x)
    return x.to(torch.float32) * torch.tensor(_INT32_TO_UNIFORM, dtype=torch.float32, device=device)


def _keep(seed: int, seq_head, rows, cols, dropout_p: float) -> torch.Tensor:
    return philox_uniform(seed, seq_head, rows, cols) >= torch.tensor(dropout_p, dtype=torch.float32)


def dropout_keep_mask(seed: int, batch: int, nheads: int, seqlen_q: int, seqlen_k: int, dropout_p: float,
                      device=None) -> torch.Tensor:
    """Boolean [batch, nheads, seqlen_q, seqlen_k]: which probabilities survive dropout.

    Bit-identical to ``scores._dropout_keep``: kept iff the Philox uniform of
    counter ``(j, i, b·nheads + h, 0)`` is ≥ dropout_p (in float32).
    """
    seq_head = torch.arange(batch * nheads, device=device).view(batch, nheads, 1, 1)
    return _keep(seed, seq_head, torch.arange(seqlen_q, device=device), torch.arange(seqlen_k, device=device),
                 dropout_p)


# ----------------------------------------------------------------------------------------------
# Online softmax


def online_softmax(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Running max and normaliser of a 1-D sequence, one element at a time.

    Returns ``(m, ℓ)`` with ``ℓ = Σ exp(x_i − m)``. For x = [1, 3, 2, 5] this is
    m = 5, ℓ = e⁻⁴ + e⁻² + e⁻³ + e⁰ ≈ 1.2034, the worked example of the seeds.
    """
    m = torch.tensor(-math.inf, dtype=x.dtype)
    ell = torch.tensor(0.0, dtype=x.dtype)
    for x_i in x:
        m_new = torch.maximum(m, x_i)
        # -- rescale the old sum to the new max, then add the new term
        ell = ell * torch.exp(m - m_new) + torch.exp(x_i - m_new)
        m = m_new
    return m, ell


def merge_softmax_states(a, b):
    """Merge two partial softmax states ``(m, ℓ, Õ)`` over disjoint key sets.

    ``Õ`` is the unnormalised output Σ exp(s − m) v. The merge is exact,
    associative and commutative; a state with m = −inf (no keys) is neutral.
    """
    m_a, l_a, o_a = a
    m_b, l_b, o_b = b
    m = torch.maximum(m_a, m_b)
    m_safe = torch.where(torch.isinf(m) & (m < 0), torch.zeros_like(m), m)
    alpha = torch.exp(m_a - m_safe)
    beta = torch.exp(m_b - m_safe)
    return m, alpha * l_a + beta * l_b, alpha[..., None] * o_a + beta[..., None] * o_b


# ----------------------------------------------------------------------------------------------
# Scores of a block, shared by the standard and the tiled algorithms


@dataclass(frozen=True)
class _Options:
    """Everything that shapes the scores, in the grouped layout [B, Hk, G, ...]."""

    scale: float
    window: tuple[int, int]  # normalised (left, right)
    softcap: float
    alibi: torch.Tensor | None  # slopes [B, Hk, G, 1, 1] in the compute dtype
    bias: torch.Tensor | None  # [B, Hk, G, Nq, Nk] (an expanded view), float or bool
    dropout_p: float
    dropout_seed: int | None
    seq_head: torch.Tensor  # Philox counter word 2 = batch·nheads + head, [B, Hk, G, 1, 1]
    seqlen_q: int
    seqlen_k: int


def _default_scale(head_dim: int, softmax_scale: float | None) -> float:
    return 1.0 / math.sqrt(head_dim) if softmax_scale is None else softmax_scale


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _group_queries(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """View q [B, Hq, N, ...] as [B, Hk, G, N, ...] so that K/V broadcast over the group."""
    return q.unflatten(1, (k.shape[1], q.shape[1] // k.shape[1]))


def _options(q, k, dtype, softmax_scale, causal, window_size, softcap, alibi_slopes, attn_bias, dropout_p,
             dropout_seed, first_batch: int = 0) -> _Options:
    """Options for q [B, Hq, Nq, D], k [B, Hk, Nk, D]; ``first_batch`` offsets the dropout counter."""
    batch, nheads, seqlen_q = q.shape[:3]
    seqlen_k = k.shape[2]
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    if dropout_p > 0 and dropout_seed is None:
        raise ValueError("dropout_p > 0 needs a dropout_seed")
    if softcap < 0:
        raise ValueError(f"softcap must be ≥ 0, got {softcap}")

    def grouped(t):  # [B, Hq, ...] → [B, Hk, G, ...]
        return _group_queries(t, k)

    alibi = None
    if alibi_slopes is not None:
        slopes = alibi_slopes.to(device=q.device, dtype=dtype).expand(batch, nheads)  # (H,) or (B, H)
        alibi = grouped(slopes[:, :, None, None])
    bias = None
    if attn_bias is not None:
        bias = grouped(attn_bias.to(q.device).expand(batch, nheads, seqlen_q, seqlen_k))
        if bias.dtype != torch.bool:
            bias = bias.to(dtype)
    seq_head = torch.arange(first_batch * nheads, (first_batch + batch) * nheads, device=q.device)
    return _Options(
        scale=_default_scale(q.shape[-1], softmax_scale), window=normalize_window(causal, window_size),
        softcap=float(softcap), alibi=alibi, bias=bias, dropout_p=float(dropout_p), dropout_seed=dropout_seed,
        seq_head=grouped(seq_head.view(batch, nheads, 1, 1)), seqlen_q=seqlen_q, seqlen_k=seqlen_k,
    )


def _block_scores(opts: _Options, q_blk, k_blk, m0: int, m1: int, n0: int, n1: int) -> torch.Tensor:
    """Scores [B, Hk, G, BM, BN] of queries [m0, m1) against keys [n0, n1); −inf where invisible.

    q_blk [B, Hk, G, BM, D], k_blk [B, Hk, 1, BN, D].
    """
    qk = q_blk @ k_blk.transpose(-1, -2)  # [B, Hk, G, BM, BN]
    if opts.softcap > 0:
        s = opts.softcap * torch.tanh(qk * (opts.scale / opts.softcap))
    else:
        s = qk * opts.scale
    rows = torch.arange(m0, m1, device=qk.device)
    cols = torch.arange(n0, n1, device=qk.device)
    diagonal = opts.seqlen_k - opts.seqlen_q
    if opts.alibi is not None:
        distance = (rows[:, None] + diagonal - cols[None, :]).abs()  # |i + Nk − Nq − j|
        s = s - opts.alibi * distance.to(s.dtype)
    if opts.bias is not None:
        bias = opts.bias[..., m0:m1, n0:n1]
        s = s.masked_fill(~bias, -math.inf) if bias.dtype == torch.bool else s + bias
    return s.masked_fill(~_visible(rows, cols, diagonal, opts.window), -math.inf)


def _softcap_derivative(opts: _Options, q_blk, k_blk) -> torch.Tensor:
    """d(c · tanh(x)) / d(c · x) = 1 − tanh²(x), x = q·k · scale / c: turns dS into dS_raw."""
    t = torch.tanh((q_blk @ k_blk.transpose(-1, -2)) * (opts.scale / opts.softcap))
    return 1 - t * t


def _dropout_factor(opts: _Options, m0: int, m1: int, n0: int, n1: int, dtype) -> torch.Tensor | None:
    """Z = keep / (1 − p) of the block [B, Hk, G, BM, BN], or None without dropout."""
    if opts.dropout_p == 0:
        return None
    device = opts.seq_head.device
    keep = _keep(opts.dropout_seed, opts.seq_head, torch.arange(m0, m1, device=device),
                 torch.arange(n0, n1, device=device), opts.dropout_p)
    return keep.to(dtype) * (1.0 / (1.0 - opts.dropout_p))


def _sum_to(grad: torch.Tensor, shape) -> torch.Tensor:
    """Sum ``grad`` over the dimensions where ``shape`` (same rank) is 1: the adjoint of expand."""
    dims = tuple(d for d, size in enumerate(shape) if size == 1 and grad.shape[d] != 1)
    return grad.sum(dims, keepdim=True) if dims else grad


def _float_bias_grad_shape(attn_bias) -> tuple[int, ...] | None:
    """A float bias's shape padded to 4-D with leading 1s; None for no bias or a bool mask."""
    if attn_bias is None or attn_bias.dtype == torch.bool:
        return None
    return (1,) * (4 - attn_bias.dim()) + tuple(attn_bias.shape)


# ----------------------------------------------------------------------------------------------
# Standard attention


def _standard_forward(q, k, v, opts: _Options):
    seqlen_q, seqlen_k = q.shape[2], k.shape[2]
    qg = _group_queries(q, k)  # [B, Hk, G, Nq, D]
    s = _block_scores(opts, qg, k.unsqueeze(2), 0, seqlen_q, 0, seqlen_k)  # [B, Hk, G, Nq, Nk]
    # lse by logsumexp and P = exp(S − L), as the kernels rebuild P. A row with no visible key
    # gets P = 0 and lse = -inf; its scores are replaced by 0 inside logsumexp, whose gradient
    # would be NaN on a row of -inf.
    seen = ~torch.isneginf(s).all(-1)  # [B, Hk, G, Nq]
    lse = torch.logsumexp(torch.where(seen[..., None], s, torch.zeros_like(s)), dim=-1)
    lse = torch.where(seen, lse, -math.inf)
    p = torch.exp(s - torch.where(seen, lse, math.inf)[..., None])
    z = _dropout_factor(opts, 0, seqlen_q, 0, seqlen_k, p.dtype)
    out = (p if z is None else p * z) @ v.unsqueeze(2)  # [B, Hk, G, Nq, D]
    return out.flatten(1, 2), lse.flatten(1, 2), p.flatten(1, 2)


def attention_forward(q, k, v, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                      alibi_slopes=None, attn_bias=None, dropout_p=0.0, dropout_seed=None):
    """Standard attention, in the dtype of the inputs. Differentiable by autograd (attn_bias too).

    q [B, Hq, Nq, D], k and v [B, Hk, Nk, D]; alibi_slopes (Hq,) or (B, Hq);
    attn_bias broadcastable to [B, Hq, Nq, Nk], float (added) or bool (True = may
    attend); dropout needs an integer ``dropout_seed``. Returns (out [B, Hq, Nq, D],
    lse [B, Hq, Nq] of the undropped scores, p [B, Hq, Nq, Nk] undropped).
    """
    opts = _options(q, k, q.dtype, softmax_scale, causal, window_size, softcap, alibi_slopes, attn_bias,
                    dropout_p, dropout_seed)
    return _standard_forward(q, k, v, opts)


def attention_backward(q, k, v, dout, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                       alibi_slopes=None, attn_bias=None, dropout_p=0.0, dropout_seed=None):
    """Backward of standard attention with the formulas written out (P recomputed once).

    Returns (dq, dk, dv, dbias): dbias is shaped like a float attn_bias, else None.
    """
    opts = _options(q, k, q.dtype, softmax_scale, causal, window_size, softcap, alibi_slopes, attn_bias,
                    dropout_p, dropout_seed)
    seqlen_q, seqlen_k = q.shape[2], k.shape[2]
    with torch.no_grad():
        out, _, p = _standard_forward(q, k, v, opts)
    p = _group_queries(p, k)  # [B, Hk, G, Nq, Nk]
    do = _group_queries(dout, k)  # [B, Hk, G, Nq, D]
    qg = _group_queries(q, k)
    z = _dropout_factor(opts, 0, seqlen_q, 0, seqlen_k, p.dtype)
    p_drop = p if z is None else p * z
    dv = (p_drop.transpose(-1, -2) @ do).sum(2)  # dV = P_dropᵀ dO, summed over the query group
    dp = do @ v.unsqueeze(2).transpose(-1, -2)  # dP = dO Vᵀ
    dp_eff = dp if z is None else dp * z  # dP_eff = dP ∘ keep / (1 − p)
    delta = (do * _group_queries(out, k)).sum(-1, keepdim=True)  # D = rowsum(dO ∘ O)
    ds = p * (dp_eff - delta)  # dS = P ∘ (dP_eff − D)
    bias_shape = _float_bias_grad_shape(attn_bias)
    dbias = None if bias_shape is None else _sum_to(ds.flatten(1, 2), bias_shape).reshape(attn_bias.shape)
    if opts.softcap > 0:
        ds = ds * _softcap_derivative(opts, qg, k.unsqueeze(2))  # dS_raw = dS ∘ (1 − tanh²)
    dq = opts.scale * (ds @ k.unsqueeze(2))  # dQ = scale · dS_raw K
    dk = opts.scale * (ds.transpose(-1, -2) @ qg).sum(2)  # dK = scale · dS_rawᵀ Q
    return dq.flatten(1, 2), dk, dv, dbias


# ----------------------------------------------------------------------------------------------
# Tiled attention (FlashAttention): the CPU path


def _tiled_forward(q, k, v, opts: _Options, block_m: int, block_n: int):
    cdt = _compute_dtype(q.dtype)
    seqlen_q, seqlen_k = q.shape[2], k.shape[2]
    qg = _group_queries(q, k)  # [B, Hk, G, Nq, D]
    out = torch.empty(qg.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(qg.shape[:-1], dtype=cdt, device=q.device)
    for m0 in range(0, seqlen_q, block_m):
        m1 = min(m0 + block_m, seqlen_q)
        q_blk = qg[..., m0:m1, :].to(cdt)  # [B, Hk, G, BM, D]
        m_i = torch.full(q_blk.shape[:-1], -math.inf, dtype=cdt, device=q.device)
        l_i = torch.zeros_like(m_i)
        acc = torch.zeros(q_blk.shape, dtype=cdt, device=q.device)
        lo, hi = key_range(m0, m1, seqlen_q, seqlen_k, opts.window, block_n)
        for n0 in range(lo, hi, block_n):
            n1 = min(n0 + block_n, seqlen_k)
            k_blk = k[:, :, None, n0:n1].to(cdt)  # [B, Hk, 1, BN, D]
            v_blk = v[:, :, None, n0:n1].to(cdt)
            s = _block_scores(opts, q_blk, k_blk, m0, m1, n0, n1)  # [B, Hk, G, BM, BN]
            # -- online softmax: new running max, rescale factor for the old state
            m_new = torch.maximum(m_i, s.amax(-1))
            m_safe = torch.where(torch.isneginf(m_new), torch.zeros_like(m_new), m_new)
            p = torch.exp(s - m_safe[..., None])
            alpha = torch.exp(m_i - m_safe)
            l_i = l_i * alpha + p.sum(-1)  # the normaliser is that of the undropped P
            z = _dropout_factor(opts, m0, m1, n0, n1, cdt)
            acc = acc * alpha[..., None] + (p if z is None else p * z) @ v_blk
            m_i = m_new
        # -- normalise once; rows that saw no key keep output 0 and lse -inf
        seen = l_i > 0
        out[..., m0:m1, :] = (acc / torch.where(seen, l_i, 1.0)[..., None]).to(q.dtype)
        lse[..., m0:m1] = torch.where(seen, m_i + torch.log(l_i), -math.inf)
    return out.flatten(1, 2), lse.flatten(1, 2)


def _tiled_backward(q, k, v, out, lse, dout, opts: _Options, bias_shape, block_m: int, block_n: int):
    """→ (dq, dk, dv, dbias [bias shape padded to 4-D, compute dtype] or None)."""
    cdt = _compute_dtype(q.dtype)
    seqlen_q, seqlen_k = q.shape[2], k.shape[2]
    qg = _group_queries(q, k)  # [B, Hk, G, Nq, D]
    dog = _group_queries(dout, k)
    # D_i = rowsum(dO_i ∘ O_i), equal to rowsum(dP_eff ∘ P)
    delta = (dog.to(cdt) * _group_queries(out, k).to(cdt)).sum(-1)  # [B, Hk, G, Nq]
    lse_g = _group_queries(lse.to(cdt), k)
    lse_safe = torch.where(torch.isneginf(lse_g), torch.full_like(lse_g, math.inf), lse_g)
    dq = torch.zeros(qg.shape, dtype=cdt, device=q.device)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    dbias = None if bias_shape is None else torch.zeros(bias_shape, dtype=cdt, device=q.device)
    for n0 in range(0, seqlen_k, block_n):
        n1 = min(n0 + block_n, seqlen_k)
        k_blk = k[:, :, None, n0:n1].to(cdt)  # [B, Hk, 1, BN, D]
        v_blk = v[:, :, None, n0:n1].to(cdt)
        dk_acc = torch.zeros(k_blk.shape, dtype=cdt, device=q.device)
        dv_acc = torch.zeros_like(dk_acc)
        lo, hi = query_range(n0, n1, seqlen_q, seqlen_k, opts.window, block_m)
        for m0 in range(lo, hi, block_m):
            m1 = min(m0 + block_m, seqlen_q)
            q_blk = qg[..., m0:m1, :].to(cdt)  # [B, Hk, G, BM, D]
            do_blk = dog[..., m0:m1, :].to(cdt)
            s = _block_scores(opts, q_blk, k_blk, m0, m1, n0, n1)  # [B, Hk, G, BM, BN]
            p = torch.exp(s - lse_safe[..., m0:m1, None])  # P_ij = exp(S_ij − L_i), 0 where invisible
            z = _dropout_factor(opts, m0, m1, n0, n1, cdt)
            dv_acc += ((p if z is None else p * z).transpose(-1, -2) @ do_blk).sum(2, keepdim=True)
            dp = do_blk @ v_blk.transpose(-1, -2)
            ds = p * ((dp if z is None else dp * z) - delta[..., m0:m1, None])  # P ∘ (dP_eff − D)
            if dbias is not None:
                rows = slice(m0, m1) if bias_shape[2] > 1 else slice(0, 1)
                cols = slice(n0, n1) if bias_shape[3] > 1 else slice(0, 1)
                dbias[:, :, rows, cols] += _sum_to(ds.flatten(1, 2), dbias[:, :, rows, cols].shape)
            if opts.softcap > 0:
                ds = ds * _softcap_derivative(opts, q_blk, k_blk)
            dq[..., m0:m1, :] += opts.scale * (ds @ k_blk)
            dk_acc += opts.scale * (ds.transpose(-1, -2) @ q_blk).sum(2, keepdim=True)
        dk[:, :, n0:n1] = dk_acc.squeeze(2).to(k.dtype)
        dv[:, :, n0:n1] = dv_acc.squeeze(2).to(v.dtype)
    return dq.flatten(1, 2).to(q.dtype), dk, dv, dbias


def tiled_attention_forward(q, k, v, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            alibi_slopes=None, attn_bias=None, dropout_p=0.0, dropout_seed=None,
                            block_m=256, block_n=256):
    """FlashAttention forward with online softmax; O(N) extra memory.

    Same arguments as :func:`attention_forward`; returns (out in q's dtype, lse).
    K/V blocks outside the window are skipped; the dropout mask is drawn per block.
    """
    opts = _options(q, k, _compute_dtype(q.dtype), softmax_scale, causal, window_size, softcap, alibi_slopes,
                    attn_bias, dropout_p, dropout_seed)
    return _tiled_forward(q, k, v, opts, block_m, block_n)


def tiled_attention_backward(q, k, v, out, lse, dout, softmax_scale=None, causal=False, window_size=(-1, -1),
                             softcap=0.0, alibi_slopes=None, attn_bias=None, dropout_p=0.0, dropout_seed=None,
                             block_m=256, block_n=256):
    """FlashAttention backward: recompute P per block from the log-sum-exp.

    Outer loop over K/V blocks (dK, dV accumulate on chip), inner loop over the
    Q blocks that see them; dQ accumulates in an O(N) buffer, the bias gradient in
    a buffer shaped like the bias. Returns (dq, dk, dv, dbias) in the input dtypes;
    dbias is None unless attn_bias is a float tensor.
    """
    opts = _options(q, k, _compute_dtype(q.dtype), softmax_scale, causal, window_size, softcap, alibi_slopes,
                    attn_bias, dropout_p, dropout_seed)
    bias_shape = _float_bias_grad_shape(attn_bias)
    dq, dk, dv, dbias = _tiled_backward(q, k, v, out, lse, dout, opts, bias_shape, block_m, block_n)
    if dbias is not None:
        dbias = dbias.reshape(attn_bias.shape).to(attn_bias.dtype)
    return dq, dk, dv, dbias


# ----------------------------------------------------------------------------------------------
# Variable-length batches (flash-attn's packed layout)


def _sequences(cu_seqlens_q, cu_seqlens_k, attn_bias=None):
    """(index, q slice, k slice) of each sequence of a packed batch."""
    if attn_bias is not None:
        raise NotImplementedError("attn_bias is not supported for packed (variable-length) batches")
    starts_q, starts_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    if len(starts_q) != len(starts_k):
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k differ in length: {len(starts_q)} vs {len(starts_k)}")
    for i in range(len(starts_q) - 1):
        yield i, slice(starts_q[i], starts_q[i + 1]), slice(starts_k[i], starts_k[i + 1])


def _unpack(t: torch.Tensor, rows: slice) -> torch.Tensor:
    """(total, H, D) rows of one sequence → [1, H, N, D]."""
    return t[rows].transpose(0, 1)[None]


def _sequence_options(q_i, k_i, dtype, i, softmax_scale, causal, window_size, softcap, alibi_slopes, dropout_p,
                      dropout_seed):
    slopes = alibi_slopes[i] if alibi_slopes is not None and alibi_slopes.dim() == 2 else alibi_slopes
    return _options(q_i, k_i, dtype, softmax_scale, causal, window_size, softcap, slopes, None, dropout_p,
                    dropout_seed, first_batch=i)


def varlen_attention_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale=None, causal=False,
                             window_size=(-1, -1), softcap=0.0, alibi_slopes=None, dropout_p=0.0,
                             dropout_seed=None):
    """Standard attention of each sequence of a packed batch alone. Differentiable by autograd.

    q (total_q, Hq, D), k and v (total_k, Hk, D); cu_seqlens_* int32 (batch + 1,)
    cumulative lengths; alibi_slopes (Hq,) or (batch, Hq). Masks and ALiBi are
    aligned per sequence; the dropout counter uses the sequence index as the batch
    index and positions within the sequence. Returns (out (total_q, Hq, D),
    lse (Hq, total_q)).
    """
    outs, lses = [], []
    for i, rows_q, rows_k in _sequences(cu_seqlens_q, cu_seqlens_k):
        q_i, k_i, v_i = _unpack(q, rows_q), _unpack(k, rows_k), _unpack(v, rows_k)
        opts = _sequence_options(q_i, k_i, q.dtype, i, softmax_scale, causal, window_size, softcap, alibi_slopes,
                                 dropout_p, dropout_seed)
        out, lse, _ = _standard_forward(q_i, k_i, v_i, opts)
        outs.append(out[0].transpose(0, 1))
        lses.append(lse[0])
    empty_lse = q.new_empty((q.shape[1], 0))
    return torch.cat(outs) if outs else torch.zeros_like(q), torch.cat(lses, 1) if lses else empty_lse


def tiled_varlen_attention_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale=None, causal=False,
                                   window_size=(-1, -1), softcap=0.0, alibi_slopes=None, attn_bias=None,
                                   dropout_p=0.0, dropout_seed=None, block_m=256, block_n=256):
    """The CPU path of a packed batch: the tiled forward per sequence.

    Shapes as :func:`varlen_attention_forward`; returns (out (total_q, Hq, D) in q's
    dtype, lse (Hq, total_q) in the compute dtype). ``attn_bias`` must be None.
    """
    out = torch.zeros_like(q)
    lse = torch.full((q.shape[1], q.shape[0]), -math.inf, dtype=_compute_dtype(q.dtype), device=q.device)
    for i, rows_q, rows_k in _sequences(cu_seqlens_q, cu_seqlens_k, attn_bias):
        q_i, k_i, v_i = _unpack(q, rows_q), _unpack(k, rows_k), _unpack(v, rows_k)
        opts = _sequence_options(q_i, k_i, _compute_dtype(q.dtype), i, softmax_scale, causal, window_size, softcap,
                                 alibi_slopes, dropout_p, dropout_seed)
        out_i, lse_i = _tiled_forward(q_i, k_i, v_i, opts, block_m, block_n)
        out[rows_q] = out_i[0].transpose(0, 1)
        lse[:, rows_q] = lse_i[0]
    return out, lse


def tiled_varlen_attention_backward(q, k, v, out, lse, dout, cu_seqlens_q, cu_seqlens_k, softmax_scale=None,
                                    causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                                    attn_bias=None, dropout_p=0.0, dropout_seed=None, block_m=256, block_n=256):
    """Backward of :func:`tiled_varlen_attention_forward` → (dq, dk, dv) shaped like q, k, v."""
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for i, rows_q, rows_k in _sequences(cu_seqlens_q, cu_seqlens_k, attn_bias):
        q_i, k_i, v_i = _unpack(q, rows_q), _unpack(k, rows_k), _unpack(v, rows_k)
        opts = _sequence_options(q_i, k_i, _compute_dtype(q.dtype), i, softmax_scale, causal, window_size, softcap,
                                 alibi_slopes, dropout_p, dropout_seed)
        grads = _tiled_backward(q_i, k_i, v_i, _unpack(out, rows_q), lse[None, :, rows_q], _unpack(dout, rows_q),
                                opts, None, block_m, block_n)
        dq[rows_q], dk[rows_k], dv[rows_k] = (g[0].transpose(0, 1) for g in grads[:3])
    return dq, dk, dv
