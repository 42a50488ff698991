"""Forward and backward of one attention call as plain functions (no autograd).

For code that composes attention calls itself, such as ring attention, which runs
the backward of each block against the global output and log-sum-exp.
Layout (batch, seqlen, nheads, headdim); the log-sum-exp is (batch, nheads, seqlen),
natural log, float32.
"""

from __future__ import annotations

from .autograd import _backward, _forward


def attention_forward(q, k, v, softmax_scale: float, causal: bool):
    """→ (out, lse)."""
    return _forward(q, k, v, softmax_scale, causal)


def attention_backward(dout, q, k, v, out, lse, softmax_scale: float, causal: bool):
    """→ (dq, dk, dv), with P rebuilt from ``lse`` and D = rowsum(dout ∘ out)."""
    return _backward(dout, q, k, v, out, lse, softmax_scale, causal)
