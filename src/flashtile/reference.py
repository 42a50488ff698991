"""Pure-PyTorch references: the specification the Triton kernels are judged against.

Two algorithms, written so that each step of the derivation is visible:

* **Standard attention** materialises ``S = Q Kᵀ · scale`` and ``P = softmax(S)``
  (O(N²) memory). Its backward is written out with the formulas

      dV = Pᵀ dO,   dP = dO Vᵀ,   dS = P ∘ (dP − rowsum(dP ∘ P)),
      dQ = scale · dS K,   dK = scale · dSᵀ Q.

* **Tiled attention** (FlashAttention) never stores S or P. The forward walks
  the K/V blocks with an online softmax: each row keeps a running max ``m`` and
  sum ``ℓ``; a new block rescales both ``ℓ`` and the unnormalised output by
  ``exp(m_old − m_new)``; the output is divided by ``ℓ`` once at the end, and the
  log-sum-exp ``L = m + log ℓ`` is kept per row. The backward recomputes each
  block ``P_ij = exp(S_ij − L_i)`` from ``L`` and uses ``D_i = rowsum(dO_i ∘ O_i)``,
  which equals ``rowsum(dP ∘ P)``. Extra memory is O(N).

The tiled functions double as flashtile's CPU path: they batch over batch and
heads, so each block is one matmul.

Conventions (shared with the kernels):
* layout (batch, nheads, seqlen, headdim), as ``scaled_dot_product_attention``;
* GQA/MQA: query head ``h`` reads key/value head ``h // (nheads_q // nheads_k)``;
* the log-sum-exp is in natural log, float32 (float64 for float64 inputs);
* causal masking is aligned to the bottom-right corner: query ``i`` sees key
  ``j`` iff ``j ≤ i + seqlen_k − seqlen_q`` (flash-attn ≥ 2.1);
* a row that sees no key has output 0 and log-sum-exp −inf.
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "causal_mask",
    "visible_key_end",
    "online_softmax",
    "merge_softmax_states",
    "attention_forward",
    "attention_backward",
    "tiled_attention_forward",
    "tiled_attention_backward",
]


def causal_mask(seqlen_q: int, seqlen_k: int, device=None) -> torch.Tensor:
    """Boolean [seqlen_q, seqlen_k], True where query i may attend key j (bottom-right aligned)."""
    rows = torch.arange(seqlen_q, device=device)[:, None]
    cols = torch.arange(seqlen_k, device=device)[None, :]
    return cols <= rows + (seqlen_k - seqlen_q)


def visible_key_end(query_end: int, seqlen_q: int, seqlen_k: int, causal: bool) -> int:
    """One past the last key that queries ``[.., query_end)`` can see; ≤ 0 means none."""
    if not causal:
        return seqlen_k
    return min(seqlen_k, query_end + seqlen_k - seqlen_q)


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


def _default_scale(head_dim: int, softmax_scale: float | None) -> float:
    return 1.0 / math.sqrt(head_dim) if softmax_scale is None else softmax_scale


def _group_queries(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """View q [B, Hq, N, D] as [B, Hk, G, N, D] so that K/V broadcast over the group."""
    return q.unflatten(1, (k.shape[1], q.shape[1] // k.shape[1]))


def attention_forward(q, k, v, softmax_scale=None, causal=False):
    """Standard attention, in the dtype of the inputs. Differentiable by autograd.

    q [B, Hq, Nq, D], k and v [B, Hk, Nk, D]. Returns (out [B, Hq, Nq, D],
    lse [B, Hq, Nq], p [B, Hq, Nq, Nk]).
    """
    scale = _default_scale(q.shape[-1], softmax_scale)
    qg = _group_queries(q, k)  # [B, Hk, G, Nq, D]
    s = (qg @ k.unsqueeze(2).transpose(-1, -2)) * scale  # [B, Hk, G, Nq, Nk]
    if causal:
        s = s.masked_fill(~causal_mask(q.shape[2], k.shape[2], q.device), -math.inf)
    lse = torch.logsumexp(s, dim=-1)  # [B, Hk, G, Nq]
    # A row with no visible key has lse = -inf; its probabilities are 0, not NaN.
    lse_safe = torch.where(torch.isneginf(lse), torch.full_like(lse, math.inf), lse)
    p = torch.exp(s - lse_safe[..., None])
    out = p @ v.unsqueeze(2)  # [B, Hk, G, Nq, D]
    return out.flatten(1, 2), lse.flatten(1, 2), p.flatten(1, 2)


def attention_backward(q, k, v, dout, softmax_scale=None, causal=False):
    """Backward of standard attention with the formulas written out (P recomputed once)."""
    scale = _default_scale(q.shape[-1], softmax_scale)
    _, _, p = attention_forward(q, k, v, softmax_scale, causal)
    p = _group_queries(p, k)  # [B, Hk, G, Nq, Nk]
    do = _group_queries(dout, k)  # [B, Hk, G, Nq, D]
    qg = _group_queries(q, k)
    dv = (p.transpose(-1, -2) @ do).sum(2)  # dV = Pᵀ dO, summed over the query group
    dp = do @ v.unsqueeze(2).transpose(-1, -2)  # dP = dO Vᵀ
    ds = p * (dp - (dp * p).sum(-1, keepdim=True))  # dS = P ∘ (dP − rowsum(dP ∘ P))
    dq = scale * (ds @ k.unsqueeze(2))  # dQ = scale · dS K
    dk = scale * (ds.transpose(-1, -2) @ qg).sum(2)  # dK = scale · dSᵀ Q
    return dq.flatten(1, 2), dk, dv


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def tiled_attention_forward(q, k, v, softmax_scale=None, causal=False, block_m=256, block_n=256):
    """FlashAttention forward with online softmax; O(N) extra memory.

    Same shapes as :func:`attention_forward`; returns (out in q's dtype, lse).
    """
    scale = _default_scale(q.shape[-1], softmax_scale)
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
        for n0 in range(0, visible_key_end(m1, seqlen_q, seqlen_k, causal), block_n):
            n1 = min(n0 + block_n, seqlen_k)
            k_blk = k[:, :, None, n0:n1].to(cdt)  # [B, Hk, 1, BN, D]
            v_blk = v[:, :, None, n0:n1].to(cdt)
            s = (q_blk @ k_blk.transpose(-1, -2)) * scale  # [B, Hk, G, BM, BN]
            if causal:
                mask = causal_mask(seqlen_q, seqlen_k, q.device)[m0:m1, n0:n1]
                s = s.masked_fill(~mask, -math.inf)
            # -- online softmax: new running max, rescale factor for the old state
            m_new = torch.maximum(m_i, s.amax(-1))
            m_safe = torch.where(torch.isneginf(m_new), torch.zeros_like(m_new), m_new)
            p = torch.exp(s - m_safe[..., None])
            alpha = torch.exp(m_i - m_safe)
            l_i = l_i * alpha + p.sum(-1)
            acc = acc * alpha[..., None] + p @ v_blk
            m_i = m_new
        # -- normalise once; rows that saw no key keep output 0 and lse -inf
        seen = l_i > 0
        out[..., m0:m1, :] = (acc / torch.where(seen, l_i, 1.0)[..., None]).to(q.dtype)
        lse[..., m0:m1] = torch.where(seen, m_i + torch.log(l_i), -math.inf)
    return out.flatten(1, 2), lse.flatten(1, 2)


def tiled_attention_backward(
    q, k, v, out, lse, dout, softmax_scale=None, causal=False, block_m=256, block_n=256
):
    """FlashAttention backward: recompute P per block from the log-sum-exp.

    Outer loop over K/V blocks (dK, dV accumulate on chip), inner loop over Q
    blocks; dQ accumulates in an O(N) buffer. Returns (dq, dk, dv) in the
    input dtypes.
    """
    scale = _default_scale(q.shape[-1], softmax_scale)
    cdt = _compute_dtype(q.dtype)
    seqlen_q, seqlen_k = q.shape[2], k.shape[2]
    qg = _group_queries(q, k)  # [B, Hk, G, Nq, D]
    dog = _group_queries(dout, k)
    # D_i = rowsum(dO_i ∘ O_i), equal to rowsum(dP ∘ P)
    delta = (dog.to(cdt) * _group_queries(out, k).to(cdt)).sum(-1)  # [B, Hk, G, Nq]
    lse_g = _group_queries(lse.to(cdt), k)
    lse_safe = torch.where(torch.isneginf(lse_g), torch.full_like(lse_g, math.inf), lse_g)
    dq = torch.zeros(qg.shape, dtype=cdt, device=q.device)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    for n0 in range(0, seqlen_k, block_n):
        n1 = min(n0 + block_n, seqlen_k)
        k_blk = k[:, :, None, n0:n1].to(cdt)  # [B, Hk, 1, BN, D]
        v_blk = v[:, :, None, n0:n1].to(cdt)
        dk_acc = torch.zeros(k_blk.shape, dtype=cdt, device=q.device)
        dv_acc = torch.zeros_like(dk_acc)
        for m0 in range(0, seqlen_q, block_m):
            m1 = min(m0 + block_m, seqlen_q)
            if visible_key_end(m1, seqlen_q, seqlen_k, causal) <= n0:
                continue  # this Q block sees none of these keys
            q_blk = qg[..., m0:m1, :].to(cdt)  # [B, Hk, G, BM, D]
            do_blk = dog[..., m0:m1, :].to(cdt)
            s = (q_blk @ k_blk.transpose(-1, -2)) * scale  # [B, Hk, G, BM, BN]
            p = torch.exp(s - lse_safe[..., m0:m1, None])  # P_ij = exp(S_ij − L_i)
            if causal:
                p = p * causal_mask(seqlen_q, seqlen_k, q.device)[m0:m1, n0:n1]
            dv_acc += (p.transpose(-1, -2) @ do_blk).sum(2, keepdim=True)
            dp = do_blk @ v_blk.transpose(-1, -2)
            ds = p * (dp - delta[..., m0:m1, None])
            dq[..., m0:m1, :] += scale * (ds @ k_blk)
            dk_acc += scale * (ds.transpose(-1, -2) @ q_blk).sum(2, keepdim=True)
        dk[:, :, n0:n1] = dk_acc.squeeze(2).to(k.dtype)
        dv[:, :, n0:n1] = dv_acc.squeeze(2).to(v.dtype)
    return dq.flatten(1, 2).to(q.dtype), dk, dv
