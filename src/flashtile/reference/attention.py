"""Standard and tiled attention (the CPU path), built on one helper for a block's scores.

The standard functions materialise S and P and write the backward out formula by formula;
the tiled functions walk the visible blocks with an online softmax and recompute P in the
backward (see the package docstring, ``flashtile.reference``). :class:`ScoreOptions`
(built by :func:`score_options`), :func:`standard_forward`, :func:`tiled_forward` and
:func:`tiled_backward` are shared with the packed functions of ``reference.varlen``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .._options import default_softmax_scale
from .dropout import keep_mask_block
from .masks import key_range, normalize_window, query_range, visible

__all__ = [
    "ScoreOptions",
    "score_options",
    "compute_dtype",
    "standard_forward",
    "tiled_forward",
    "tiled_backward",
    "attention_forward",
    "attention_backward",
    "tiled_attention_forward",
    "tiled_attention_backward",
]


# ----------------------------------------------------------------------------------------------
# Scores of a block, shared by the standard and the tiled algorithms


@dataclass(frozen=True)
class ScoreOptions:
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
    sink: torch.Tensor | None = None  # the learnable sink logits [1, Hk, G, 1] in the compute dtype


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the scores are computed in: float64 for float64 inputs, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _group_queries(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """View q [B, Hq, N, ...] as [B, Hk, G, N, ...] so that K/V broadcast over the group."""
    return q.unflatten(1, (k.shape[1], q.shape[1] // k.shape[1]))


def score_options(q, k, dtype, softmax_scale, causal, window_size, softcap, alibi_slopes, attn_bias, dropout_p,
                  dropout_seed, first_batch: int = 0, learnable_sink=None) -> ScoreOptions:
    """Options for q [B, Hq, Nq, D], k [B, Hk, Nk, D]; ``first_batch`` offsets the dropout counter;
    ``learnable_sink`` (Hq,): a logit per head in every row's softmax denominator, with no value."""
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
    sink = None
    if learnable_sink is not None:
        sink = grouped(learnable_sink.to(device=q.device, dtype=dtype).view(1, nheads, 1))
    seq_head = torch.arange(first_batch * nheads, (first_batch + batch) * nheads, device=q.device)
    return ScoreOptions(
        scale=default_softmax_scale(q.shape[-1], softmax_scale), window=normalize_window(causal, window_size),
        softcap=float(softcap), alibi=alibi, bias=bias, dropout_p=float(dropout_p), dropout_seed=dropout_seed,
        seq_head=grouped(seq_head.view(batch, nheads, 1, 1)), seqlen_q=seqlen_q, seqlen_k=seqlen_k, sink=sink,
    )


def _block_scores(opts: ScoreOptions, q_blk, k_blk, m0: int, m1: int, n0: int, n1: int) -> torch.Tensor:
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
    return s.masked_fill(~visible(rows, cols, diagonal, opts.window), -math.inf)


def _softcap_derivative(opts: ScoreOptions, q_blk, k_blk) -> torch.Tensor:
    """d(c · tanh(x)) / d(c · x) = 1 − tanh²(x), x = q·k · scale / c: turns dS into dS_raw."""
    t = torch.tanh((q_blk @ k_blk.transpose(-1, -2)) * (opts.scale / opts.softcap))
    return 1 - t * t


def _dropout_factor(opts: ScoreOptions, m0: int, m1: int, n0: int, n1: int, dtype) -> torch.Tensor | None:
    """Z = keep / (1 − p) of the block [B, Hk, G, BM, BN], or None without dropout."""
    if opts.dropout_p == 0:
        return None
    device = opts.seq_head.device
    keep = keep_mask_block(opts.dropout_seed, opts.seq_head, torch.arange(m0, m1, device=device),
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


def standard_forward(q, k, v, opts: ScoreOptions):
    """Standard attention with ``opts`` → (out [B, Hq, Nq, D], lse [B, Hq, Nq], p [B, Hq, Nq, Nk])."""
    seqlen_q, seqlen_k = q.shape[2], k.shape[2]
    qg = _group_queries(q, k)  # [B, Hk, G, Nq, D]
    s = _block_scores(opts, qg, k.unsqueeze(2), 0, seqlen_q, 0, seqlen_k)  # [B, Hk, G, Nq, Nk]
    # lse by logsumexp and P = exp(S − L), as the kernels rebuild P. A row with no visible key
    # gets P = 0 and lse = -inf; its scores are replaced by 0 inside logsumexp, whose gradient
    # would be NaN on a row of -inf. A sink joins the denominator as one more column with no value.
    columns = s if opts.sink is None else torch.cat([s, opts.sink[..., None].expand(*s.shape[:-1], 1)], dim=-1)
    seen = ~torch.isneginf(columns).all(-1)  # [B, Hk, G, Nq]
    lse = torch.logsumexp(torch.where(seen[..., None], columns, torch.zeros_like(columns)), dim=-1)
    lse = torch.where(seen, lse, -math.inf)
    p = torch.exp(s - torch.where(seen, lse, math.inf)[..., None])
    z = _dropout_factor(opts, 0, seqlen_q, 0, seqlen_k, p.dtype)
    out = (p if z is None else p * z) @ v.unsqueeze(2)  # [B, Hk, G, Nq, D]
    return out.flatten(1, 2), lse.flatten(1, 2), p.flatten(1, 2)


def attention_forward(q, k, v, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                      alibi_slopes=None, attn_bias=None, dropout_p=0.0, dropout_seed=None, learnable_sink=None):
    """Standard attention, in the dtype of the inputs. Differentiable by autograd (attn_bias and
    learnable_sink too).

    q [B, Hq, Nq, D], k and v [B, Hk, Nk, D]; alibi_slopes (Hq,) or (B, Hq);
    attn_bias broadcastable to [B, Hq, Nq, Nk], float (added) or bool (True = may
    attend); dropout needs an integer ``dropout_seed``; learnable_sink (Hq,): a logit per
    head added to each row's denominator (lse = log(exp(sink) + Σ exp(s)), no value, not
    dropped). Returns (out [B, Hq, Nq, D], lse [B, Hq, Nq] of the undropped scores,
    p [B, Hq, Nq, Nk] undropped).
    """
    opts = score_options(q, k, q.dtype, softmax_scale, causal, window_size, softcap, alibi_slopes, attn_bias,
                         dropout_p, dropout_seed, learnable_sink=learnable_sink)
    return standard_forward(q, k, v, opts)


def attention_backward(q, k, v, dout, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                       alibi_slopes=None, attn_bias=None, dropout_p=0.0, dropout_seed=None):
    """Backward of standard attention with the formulas written out (P recomputed once).

    Returns (dq, dk, dv, dbias): dbias is shaped like a float attn_bias, else None.
    """
    opts = score_options(q, k, q.dtype, softmax_scale, causal, window_size, softcap, alibi_slopes, attn_bias,
                         dropout_p, dropout_seed)
    seqlen_q, seqlen_k = q.shape[2], k.shape[2]
    with torch.no_grad():
        out, _, p = standard_forward(q, k, v, opts)
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


def tiled_forward(q, k, v, opts: ScoreOptions, block_m: int, block_n: int):
    """The tiled forward with ``opts`` → (out [B, Hq, Nq, Dv] in q's dtype, lse [B, Hq, Nq], compute dtype)."""
    cdt = compute_dtype(q.dtype)
    seqlen_q, seqlen_k = q.shape[2], k.shape[2]
    qg = _group_queries(q, k)  # [B, Hk, G, Nq, D]
    out = torch.empty((*qg.shape[:-1], v.shape[-1]), dtype=q.dtype, device=q.device)  # [B, Hk, G, Nq, Dv]
    lse = torch.empty(qg.shape[:-1], dtype=cdt, device=q.device)
    for m0 in range(0, seqlen_q, block_m):
        m1 = min(m0 + block_m, seqlen_q)
        q_blk = qg[..., m0:m1, :].to(cdt)  # [B, Hk, G, BM, D]
        m_i = torch.full(q_blk.shape[:-1], -math.inf, dtype=cdt, device=q.device)
        l_i = torch.zeros_like(m_i)
        if opts.sink is not None:  # the sink is a first key with no value: max = sink, sum = 1
            m_i = opts.sink.expand_as(m_i).clone()
            l_i = torch.ones_like(m_i)
        acc = torch.zeros((*q_blk.shape[:-1], v.shape[-1]), dtype=cdt, device=q.device)  # [B, Hk, G, BM, Dv]
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


def tiled_backward(q, k, v, out, lse, dout, opts: ScoreOptions, bias_shape, block_m: int, block_n: int):
    """→ (dq, dk, dv, dbias [bias shape padded to 4-D, compute dtype] or None)."""
    cdt = compute_dtype(q.dtype)
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
        v_blk = v[:, :, None, n0:n1].to(cdt)  # [B, Hk, 1, BN, Dv]
        dk_acc = torch.zeros(k_blk.shape, dtype=cdt, device=q.device)
        dv_acc = torch.zeros(v_blk.shape, dtype=cdt, device=q.device)
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
                            learnable_sink=None, block_m=256, block_n=256):
    """FlashAttention forward with online softmax; O(N) extra memory.

    Same arguments as :func:`attention_forward`; returns (out in q's dtype, lse).
    K/V blocks outside the window are skipped; the dropout mask is drawn per block.
    The backward needs no sink: the log-sum-exp it is given includes it.
    """
    opts = score_options(q, k, compute_dtype(q.dtype), softmax_scale, causal, window_size, softcap, alibi_slopes,
                         attn_bias, dropout_p, dropout_seed, learnable_sink=learnable_sink)
    return tiled_forward(q, k, v, opts, block_m, block_n)


def tiled_attention_backward(q, k, v, out, lse, dout, softmax_scale=None, causal=False, window_size=(-1, -1),
                             softcap=0.0, alibi_slopes=None, attn_bias=None, dropout_p=0.0, dropout_seed=None,
                             block_m=256, block_n=256):
    """FlashAttention backward: recompute P per block from the log-sum-exp.

    Outer loop over K/V blocks (dK, dV accumulate on chip), inner loop over the
    Q blocks that see them; dQ accumulates in an O(N) buffer, the bias gradient in
    a buffer shaped like the bias. Returns (dq, dk, dv, dbias) in the input dtypes;
    dbias is None unless attn_bias is a float tensor.
    """
    opts = score_options(q, k, compute_dtype(q.dtype), softmax_scale, causal, window_size, softcap, alibi_slopes,
                         attn_bias, dropout_p, dropout_seed)
    bias_shape = _float_bias_grad_shape(attn_bias)
    dq, dk, dv, dbias = tiled_backward(q, k, v, out, lse, dout, opts, bias_shape, block_m, block_n)
    if dbias is not None:
        dbias = dbias.reshape(attn_bias.shape).to(attn_bias.dtype)
    return dq, dk, dv, dbias
