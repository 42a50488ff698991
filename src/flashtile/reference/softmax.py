"""Online softmax and the merge of partial softmax states.

A softmax over a key set split into disjoint parts is recovered exactly from the parts'
states: unnormalised ``(m, ℓ, Õ)`` (:func:`merge_softmax_states`, as the tiled forward
walks key blocks), or normalised outputs and their log-sum-exps
(:func:`merge_split_states`, as split-KV decoding and ring attention combine them).
"""

from __future__ import annotations

import math

import torch

__all__ = ["online_softmax", "merge_softmax_states", "merge_split_states", "output_delta", "sink_gradient"]


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


def merge_split_states(outs: torch.Tensor, lses: torch.Tensor, out_dtype: torch.dtype | None = None):
    """Merge P normalised partial outputs through their log-sum-exps.

    outs [P, ..., S, H, D], lses [P, ..., H, S] → (out [..., S, H, D] in ``out_dtype``, default outs'
    dtype, lse [..., H, S] float32), with ``L = log Σ_p exp(L_p)`` and ``O = Σ_p exp(L_p − L) · O_p``;
    the weights and the sum are formed in float32 and rounded once, to ``out_dtype``. A part with
    ``L_p = −inf`` contributes nothing; if every part is −inf the result is output 0 and log-sum-exp
    −inf. ``L_p = +inf`` (flash-attn 2's mark of an empty row) is an empty part too.
    """
    lses = lses.float().masked_fill(torch.isposinf(lses), -math.inf)
    m = lses.amax(0)  # [..., H, S]
    m_safe = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    scales = torch.exp(lses - m_safe)  # [P, ..., H, S]; 0 for an empty part
    total = scales.sum(0)
    seen = total > 0
    lse = torch.where(seen, m_safe + torch.log(total), torch.full_like(m, -math.inf))
    weights = scales / torch.where(seen, total, torch.ones_like(total))  # [P, ..., H, S]
    out = (weights.transpose(-1, -2)[..., None] * outs.float()).sum(0)  # [..., S, H, D]
    return out.to(out_dtype or outs.dtype), lse


def output_delta(dout: torch.Tensor, out: torch.Tensor, varlen: bool) -> torch.Tensor:
    """D = rowsum(dO ∘ O) in float32, in the log-sum-exp's layout: [B, H, N] from [B, N, H, D], or
    [H, total] from packed [total, H, D]. The backward kernels form the same D themselves."""
    delta = (dout.float() * out.float()).sum(-1)  # [B, N, H] or [total, H]
    return delta.t() if varlen else delta.transpose(1, 2)


def sink_gradient(delta: torch.Tensor, lse: torch.Tensor, learnable_sink: torch.Tensor, varlen: bool) -> torch.Tensor:
    """d loss / d sink_h = −Σ_{b,i} exp(sink_h − L_i) · D_i, with D_i = rowsum(dO_i ∘ O_i) (``delta``, in
    ``lse``'s layout: [B, H, N], or [H, total] when ``varlen``): the sink's probability exp(sink − L)
    times the gradient of a score whose value is 0. Rows with L = −inf (tokens outside every packed
    sequence, whose D the kernels never write) add nothing."""
    sink = learnable_sink.view(-1, 1) if varlen else learnable_sink.view(1, -1, 1)
    contribution = torch.where(torch.isneginf(lse), 0.0, torch.exp(sink - lse) * delta)
    heads = 0 if varlen else 1
    return -contribution.sum(dim=[d for d in range(lse.dim()) if d != heads])
