"""Pure-PyTorch references: the specification the Triton kernels are judged against.

Two algorithms, written so that each step of the derivation is visible
(both in :mod:`flashtile.reference.attention`):

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
the same helper, in the order of ``flashtile.triton.scores`` (the kernels' helpers):

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

Submodules:
* ``masks``: the visibility rule, the masks, and the block ranges that skip invisible blocks;
* ``dropout``: Philox and the dropout keep mask;
* ``softmax``: the online softmax and the merges of partial softmax states
  (:func:`merge_split_states`, the merge of split-KV decoding and ring attention);
* ``attention``: block scores, standard and tiled attention, forward and backward;
* ``varlen``: the same per sequence of a packed (variable-length) batch;
* ``kvcache``: attention of each sequence against its valid prefix of a KV cache;
* ``rotary``: rotary position embeddings, as the KV-cache call applies them.

Conventions (shared with the kernels):
* layout (batch, nheads, seqlen, headdim), as ``scaled_dot_product_attention``;
  the variable-length functions take flash-attn's packed (total, nheads, headdim),
  the KV-cache reference flash-attn's (batch, seqlen, nheads, headdim);
* GQA/MQA: query head ``h`` reads key/value head ``h // (nheads_q // nheads_k)``;
* the log-sum-exp is in natural log, float32 (float64 for float64 inputs);
* causal masking is aligned to the bottom-right corner: query ``i`` sees key
  ``j`` iff ``j ≤ i + seqlen_k − seqlen_q`` (flash-attn ≥ 2.1);
* a row that sees no key has output 0 and log-sum-exp −inf, and no NaN anywhere.
"""

from .attention import attention_backward, attention_forward, tiled_attention_backward, tiled_attention_forward
from .dropout import dropout_keep_mask, philox_uniform
from .kvcache import kvcache_append_reference, kvcache_attention_reference
from .masks import causal_mask, key_range, normalize_window, query_range, visible_mask
from .rotary import apply_rotary, packed_sequences, rotary_positions
from .softmax import merge_softmax_states, merge_split_states, online_softmax, output_delta, sink_gradient
from .varlen import (nondecreasing, packed_rows, sequence_slices, tiled_varlen_attention_backward,
                     tiled_varlen_attention_forward, varlen_attention_forward)

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
    "merge_split_states",
    "output_delta",
    "sink_gradient",
    "attention_forward",
    "attention_backward",
    "tiled_attention_forward",
    "tiled_attention_backward",
    "varlen_attention_forward",
    "tiled_varlen_attention_forward",
    "tiled_varlen_attention_backward",
    "kvcache_append_reference",
    "kvcache_attention_reference",
    "nondecreasing",
    "packed_rows",
    "sequence_slices",
    "apply_rotary",
    "packed_sequences",
    "rotary_positions",
]
