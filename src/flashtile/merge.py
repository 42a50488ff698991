"""Merging partial attention results through their log-sum-exps.

Attention over a key set split into disjoint parts ``K = K_1 ∪ … ∪ K_P`` is
recovered exactly from the parts' normalised outputs ``O_p`` and natural-log
log-sum-exps ``L_p``::

    L = log Σ_p exp(L_p),        O = Σ_p exp(L_p − L) · O_p.

This is the online-softmax merge (``reference.merge_softmax_states``) written
for normalised outputs; it is what split-KV decoding, ring attention and prefix
caching use. It is associative and order-free; a part with ``L_p = −inf`` (no
visible key) contributes nothing, and if every part is −inf the result is
output 0 and log-sum-exp −inf.

Layout (flash-attn's): outputs ``[..., seqlen, nheads, headdim]`` and
log-sum-exps ``[..., nheads, seqlen]``, float32. The weights are formed in
float32; the merged output has the dtype of the inputs' outputs.
"""

from __future__ import annotations

import torch

__all__ = ["merge_attention_states", "merge_split_attention_states"]


def merge_split_attention_states(outs: torch.Tensor, lses: torch.Tensor):
    """Merge P partial results stacked on a leading split dimension.

    outs [P, ..., S, H, D], lses [P, ..., H, S] → (out [..., S, H, D], lse [..., H, S]).
    """
    lses = lses.float()
    m = lses.amax(0)  # [..., H, S]
    m_safe = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    scales = torch.exp(lses - m_safe)  # [P, ..., H, S]; 0 for an empty part
    total = scales.sum(0)
    seen = total > 0
    lse = torch.where(seen, m_safe + torch.log(total), torch.full_like(m, float("-inf")))
    weights = scales / torch.where(seen, total, torch.ones_like(total))  # [P, ..., H, S]
    out = (weights.transpose(-1, -2)[..., None] * outs.float()).sum(0)  # [..., S, H, D]
    return out.to(outs.dtype), lse


def merge_attention_states(out_a, lse_a, out_b, lse_b):
    """Merge two partial results over disjoint key sets; see the module docstring.

    out_* [..., S, H, D], lse_* [..., H, S] float32 → (out, lse) of the same shapes.
    """
    return merge_split_attention_states(torch.stack((out_a, out_b)), torch.stack((lse_a, lse_b)))
