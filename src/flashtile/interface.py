"""Public functions: thin and documented. Arguments are checked by ``flashtile._validate``;
the work happens in ``flashtile.autograd``, but for ``attention`` on the CPU path where PyTorch's own
``scaled_dot_product_attention`` computes the call exactly (``cpu.sdpa_attention``): that call is PyTorch's.

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
* ``deterministic``: on an sm_90 GPU the fused backward sums dQ with atomic adds, so
  its last bits vary run to run (flash-attn's default too); ``deterministic=True``,
  or ``torch.use_deterministic_algorithms(True)``, takes the backward without atomics,
  bitwise identical run to run. Every other path is deterministic anyway.
"""

from __future__ import annotations

import torch

from . import _validate, cpu, ops, reference
from ._options import AttentionOptions, AttentionTensors
from .autograd import KV_PACKED, QKV_PACKED, SEPARATE, attend

__all__ = [
    "attention",
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
]

# The arguments every flash-attn function shares, written once and placed into each docstring
# (``{options}``) so that ``help()`` shows every argument a function takes.
_OPTIONS_DOC = """dropout_p: float in [0, 1): dropout on the attention probabilities (Philox, seeded
            from PyTorch's generator on the inputs' device: ``torch.manual_seed`` reproduces a
            call; the backward regenerates the mask). Pass 0.0 in evaluation.
        softmax_scale: float, the scale of q kᵀ before the softmax; default 1 / sqrt(headdim).
        causal: bool, causal mask aligned to the bottom-right corner (query i sees key j iff
            j ≤ i + seqlen_k − seqlen_q); with seqlen_q > seqlen_k the first rows see no key.
        window_size: (left, right) ints ≥ −1, a sliding window: query i sees key j iff
            i + Nk − Nq − left ≤ j ≤ i + Nk − Nq + right; −1 is unbounded; causal sets right = 0.
        softcap: float ≥ 0; if > 0, scores become softcap · tanh(scores / softcap) (Gemma 2).
        alibi_slopes: None, or float32 (nheads,) or (batch, nheads): adds
            −slope · |i + Nk − Nq − j| to the scores.
        deterministic: bool; True (or ``torch.use_deterministic_algorithms(True)``) makes the
            backward bitwise identical run to run. Only the fused sm_90 backward needs it (it
            sums dQ with atomic adds); it then takes the two-kernel backward, which is slower.
        return_attn_probs: bool; also return the log-sum-exp and, with dropout_p > 0, the
            probabilities with dropped entries negated (flash-attn's S_dmask, for testing; O(N²)
            memory), else None.
        learnable_sink: None, or float32 (nheads,): one logit per query head that joins every
            row's softmax denominator and adds no value (gpt-oss's attention sinks; FA4's name):
            lse = log(exp(sink) + Σ_j exp(s_j)) over the final scores, the sink not multiplied by
            softmax_scale nor dropped by dropout; a row with no visible key gives 0 and
            lse = sink. Differentiable: d sink = −Σ exp(sink − lse) · rowsum(dO ∘ O)."""


def _with_options_doc(function):
    function.__doc__ = function.__doc__.replace("{options}", _OPTIONS_DOC)
    return function


def _attend(layout, a, b, c, q, k, *, softmax_scale, causal, window_size, softcap, alibi_slopes, dropout_p,
            deterministic=False, learnable_sink=None, attn_bias=None, cu_seqlens_q=None, cu_seqlens_k=None,
            max_seqlen_q=0, max_seqlen_k=0, return_attn_probs=False, v=None):
    """Shared tail of every public function; q, k and ``v`` are the inputs (a, b, c) unpacked by ``layout``
    (views, heads on dim −2), unpacked once a call by the public function that checked them: a packed
    layout passes its v, a separate one's is c."""
    v = c if v is None else v
    options = _validate.attention_options(q.shape[-1], softmax_scale, causal, window_size, softcap, dropout_p,
                                          max_seqlen_q, max_seqlen_k, deterministic_asked=deterministic,
                                          returns_lse=return_attn_probs)
    # an absent optional tensor costs no call: this runs on every call
    if alibi_slopes is not None:
        batch = cu_seqlens_q.numel() - 1 if cu_seqlens_q is not None else q.shape[0]
        alibi_slopes = _validate.check_alibi(alibi_slopes, batch, q.shape[-2], q.device)
    if learnable_sink is not None:
        learnable_sink = _validate.check_learnable_sink(learnable_sink, q.shape[-2], q.device)
    dropout_seed = None
    if options.dropout_p > 0:
        dropout_seed = torch.randint(0, 2**63 - 1, (1,), dtype=torch.int64, device=q.device)
    tensors = AttentionTensors(alibi_slopes, attn_bias, dropout_seed, cu_seqlens_q, cu_seqlens_k, learnable_sink)
    out, lse = attend(layout, a, b, c, q, k, v, tensors, options)
    if not return_attn_probs:
        return out
    probs = None
    if options.dropout_p > 0:
        if cu_seqlens_q is not None:
            probs = _varlen_dropout_probs(q, k, v, options, alibi_slopes, learnable_sink, dropout_seed, cu_seqlens_q,
                                          cu_seqlens_k)
        else:
            probs = _dropout_probs(q, k, v, options, alibi_slopes, learnable_sink, attn_bias, dropout_seed)
    return out, lse, probs


def _dropout_probs(q, k, v, options: AttentionOptions, alibi_slopes, learnable_sink, attn_bias, dropout_seed):
    """flash-attn's S_dmask, for testing: the undropped probabilities (batch, nheads, Nq, Nk) that the
    output was computed with (a learnable sink's share of each row taken out), the entries that dropout
    removed negated. O(N²) memory, formed by the reference."""
    with torch.no_grad():
        qt, kt, vt = (t.transpose(1, 2).float() for t in (q, k, v))  # float32: P exact to its rounding
        _, _, p = reference.attention_forward(
            qt, kt, vt, options.softmax_scale, window_size=options.window, softcap=options.softcap,
            alibi_slopes=alibi_slopes, attn_bias=attn_bias, learnable_sink=learnable_sink,
        )
        keep = reference.dropout_keep_mask(dropout_seed, q.shape[0], q.shape[2], q.shape[1], k.shape[1],
                                           options.dropout_p, device=q.device)
        return torch.where(keep, p, -p).to(q.dtype)


def _varlen_dropout_probs(q, k, v, options: AttentionOptions, alibi_slopes, learnable_sink, dropout_seed,
                          cu_seqlens_q, cu_seqlens_k):
    """S_dmask of a packed batch, as flash-attn 2's varlen functions return it: (batch, nheads,
    max_seqlen_q, max_seqlen_k), each sequence's probabilities (dropped entries negated) in its top
    left corner and 0 elsewhere. The dropout counter of sequence b is that of batch entry b, at
    positions within the sequence, as the kernels draw it. Reads cu_seqlens (a sync on a GPU):
    this output is for testing, and O(N²) in memory anyway."""
    nheads = q.shape[1]
    batch = cu_seqlens_q.numel() - 1
    probs = q.new_zeros((batch, nheads, options.max_seqlen_q, options.max_seqlen_k))
    with torch.no_grad():
        for b, rows_q, rows_k in reference.sequence_slices(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0]):
            seqlen_q, seqlen_k = rows_q.stop - rows_q.start, rows_k.stop - rows_k.start
            if seqlen_q == 0 or seqlen_k == 0:
                continue
            qt, kt, vt = (t[rows].transpose(0, 1)[None].float() for t, rows in ((q, rows_q), (k, rows_k), (v, rows_k)))
            slopes = alibi_slopes[b] if alibi_slopes is not None and alibi_slopes.dim() == 2 else alibi_slopes
            _, _, p = reference.attention_forward(qt, kt, vt, options.softmax_scale, window_size=options.window,
                                                  softcap=options.softcap, alibi_slopes=slopes,
                                                  learnable_sink=learnable_sink)
            seq_head = (b * nheads + torch.arange(nheads, device=q.device)).view(1, nheads, 1, 1)
            keep = reference.dropout.keep_mask_block(dropout_seed, seq_head, torch.arange(seqlen_q, device=q.device),
                                                     torch.arange(seqlen_k, device=q.device), options.dropout_p)
            probs[b, :, :seqlen_q, :seqlen_k] = torch.where(keep, p, -p)[0].to(q.dtype)
    return probs


@_with_options_doc
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
    learnable_sink: torch.Tensor | None = None,
):
    """Exact attention ``softmax(q kᵀ · softmax_scale) v``, argument-compatible with flash-attn 2.

    Arguments:
        q: (batch, seqlen_q, nheads, headdim), float16 / bfloat16 / float32.
        k, v: (batch, seqlen_k, nheads_k, headdim) and (…, headdim_v), q's dtype; nheads a multiple
            of nheads_k (GQA/MQA: query head h uses KV head h // (nheads // nheads_k)); head dims
            ≤ 256; v's may differ from q's and k's (MLA: 192 and 128).
        {options}

    Returns:
        out (batch, seqlen_q, nheads, headdim_v) in q's dtype; with return_attn_probs,
        ``(out, softmax_lse, S_dmask)`` where softmax_lse is (batch, nheads, seqlen_q),
        float32, natural log.
    """
    _validate.check_qkv(q, k, v, heads_axis=2)
    return _attend(SEPARATE, q, k, v, q, k, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                   softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p,
                   deterministic=deterministic, learnable_sink=learnable_sink,
                   return_attn_probs=return_attn_probs)


@_with_options_doc
def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                              softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False,
                             learnable_sink=None):
    """:func:`flash_attn_func` on packed inputs; the gradient comes packed the same way, written in
    place with no concatenation.

    Arguments:
        qkv: (batch, seqlen, 3, nheads, headdim), q, k and v stacked on dim −3.
        {options}

    Returns:
        out (batch, seqlen, nheads, headdim); with return_attn_probs, ``(out, softmax_lse, S_dmask)``
        as :func:`flash_attn_func`.
    """
    _validate.check_packed("qkv", qkv, 5, 3)
    q, k, v = qkv.unbind(-3)
    _validate.check_qkv(q, k, v, heads_axis=2)
    return _attend(QKV_PACKED, qkv, None, None, q, k, softmax_scale=softmax_scale, causal=causal,
                   window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p,
                   deterministic=deterministic, learnable_sink=learnable_sink,
                   return_attn_probs=return_attn_probs, v=v)


@_with_options_doc
def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                             softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False,
                             learnable_sink=None):
    """:func:`flash_attn_func` on q and packed k, v; kv's gradient comes packed the same way.

    Arguments:
        q: (batch, seqlen_q, nheads, headdim).
        kv: (batch, seqlen_k, 2, nheads_k, headdim), k and v stacked on dim −3.
        {options}

    Returns:
        out (batch, seqlen_q, nheads, headdim); with return_attn_probs, ``(out, softmax_lse, S_dmask)``
        as :func:`flash_attn_func`.
    """
    _validate.check_packed("kv", kv, 5, 2)
    k, v = kv.unbind(-3)
    _validate.check_qkv(q, k, v, heads_axis=2)
    return _attend(KV_PACKED, q, kv, None, q, k, softmax_scale=softmax_scale, causal=causal,
                   window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p,
                   deterministic=deterministic, learnable_sink=learnable_sink,
                   return_attn_probs=return_attn_probs, v=v)


@_with_options_doc
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
    learnable_sink: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    seqused_k: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
):
    """Attention over a batch of sequences packed without padding, as flash-attn 2's; with a paged
    KV cache (``block_table``), the call vLLM makes for every step of a mixed batch.

    Arguments:
        q: (total_q, nheads, headdim), the sequences' queries one after another.
        k, v: (total_k, nheads_k, headdim) and (total_k, nheads_k, headdim_v); with block_table,
            paged caches (num_pages, page_size, nheads_k, headdim or headdim_v), any page size.
        cu_seqlens_q, cu_seqlens_k: int32 (batch + 1,), the cumulative sequence
            lengths: sequence b is tokens [cu[b], cu[b + 1]). Each sequence attends only
            within itself; causal and windows are aligned per sequence (bottom-right).
            Lengths may be 0. With block_table, cu_seqlens_k gives the keys' counts (or is
            None when seqused_k does).
        max_seqlen_q, max_seqlen_k: ints, the longest sequence lengths (they size the
            grid; no host sync reads cu_seqlens).
        block_table: optional (batch, max_pages) int32: sequence b's keys are the first
            seqused_k[b] slots of its pages, in order (a chunk of new queries sees the whole
            cached prefix under causal). Inference only: no backward, no dropout.
        seqused_k: optional (batch,) int32, with block_table: the keys each sequence uses.
        k_descale, v_descale: optional (batch, nheads_k) float32, with block_table: the scales of a
            float8 cache, as in :func:`flash_attn_with_kvcache`.
        out: optional, with block_table: a (total_q, nheads, headdim_v) tensor in q's dtype that the
            kernel writes the result into (vLLM's preallocated output).
        {options}

    Returns:
        out (total_q, nheads, headdim_v); with return_attn_probs, ``(out, softmax_lse, S_dmask)``
        with softmax_lse (nheads, total_q), float32, natural log, and with dropout_p > 0 S_dmask
        (batch, nheads, max_seqlen_q, max_seqlen_k): each sequence's probabilities, dropped entries
        negated, 0 outside the sequence (for testing; O(N²) memory), else None.
    """
    if block_table is not None:
        return _paged_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, seqused_k, block_table,
                             softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
                             alibi_slopes=alibi_slopes, dropout_p=dropout_p, learnable_sink=learnable_sink,
                             return_attn_probs=return_attn_probs, k_descale=k_descale, v_descale=v_descale, out=out)
    for name, t in (("seqused_k", seqused_k), ("k_descale", k_descale), ("v_descale", v_descale), ("out", out)):
        if t is not None:
            raise NotImplementedError(f"{name} is supported with block_table (a paged KV cache) only")
    _validate.check_qkv(q, k, v, heads_axis=1, packed=True)
    _validate.check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q.device, q.shape[0],
                                k.shape[0])
    return _attend(SEPARATE, q, k, v, q, k, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                   softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p, cu_seqlens_q=cu_seqlens_q,
                   cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                   deterministic=deterministic, learnable_sink=learnable_sink,
                   return_attn_probs=return_attn_probs)


def _paged_varlen(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, seqused_k, block_table, *,
                  softmax_scale, causal, window_size, softcap, alibi_slopes, dropout_p, learnable_sink,
                  return_attn_probs, k_descale, v_descale, out):
    """flash_attn_varlen_func over a paged cache: the KV-cache kernel with packed queries (forward only)."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k_cache, v_cache)):
        raise NotImplementedError("flash_attn_varlen_func with block_table (a paged KV cache) has no backward: "
                                  "call it under torch.no_grad() or torch.inference_mode()")
    if _validate.check_dropout(dropout_p) > 0:
        raise NotImplementedError("dropout is not supported with block_table (a paged KV cache is for inference)")
    seqlens_name = "seqused_k"
    if seqused_k is None:
        if cu_seqlens_k is None:
            raise ValueError("with block_table, give seqused_k or cu_seqlens_k: the keys each sequence uses")
        _validate.check_paged_cu_seqlens_k(cu_seqlens_k, cu_seqlens_q, q.device)
        cu_seqlens_k = reference.nondecreasing(cu_seqlens_k)  # the packed rule where unchecked (reference.packed_rows)
        seqused_k = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).to(torch.int32)
        seqlens_name = "the key count of cu_seqlens_k"  # what the checks below call seqused_k's values
    batch = _validate.check_kvcache_inputs(q, k_cache, v_cache, None, None, seqused_k, None, block_table,
                                           cu_seqlens_q, max_seqlen_q, seqlens_name=seqlens_name)
    options = _validate.attention_options(q.shape[-1], softmax_scale, causal, window_size, softcap)
    alibi_slopes = _validate.check_alibi(alibi_slopes, batch, q.shape[1], q.device)
    learnable_sink = _validate.check_learnable_sink(learnable_sink, q.shape[1], q.device)
    k_descale, v_descale = _validate.check_descale(k_descale, v_descale, k_cache, batch, q.device)
    out = _validate.check_out(out, ops.out_shape(q, v_cache), q.dtype, q.device)
    if q.numel() == 0 or batch == 0:
        out = q.new_zeros(ops.out_shape(q, v_cache)) if out is None else out.zero_()
        lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float32, device=q.device)
    else:
        out, lse = ops.kvcache_attention(q, k_cache, v_cache, seqused_k, None, block_table, options, alibi_slopes,
                                         learnable_sink=learnable_sink,
                                         cu_seqlens_q=reference.nondecreasing(cu_seqlens_q),
                                         max_seqlen_q=max_seqlen_q, k_descale=k_descale, v_descale=v_descale, out=out)
    return (out, lse, None) if return_attn_probs else out


@_with_options_doc
def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None,
                                     causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                                     deterministic=False, return_attn_probs=False, learnable_sink=None):
    """:func:`flash_attn_varlen_func` on packed inputs, with one set of sequence lengths.

    Arguments:
        qkv: (total, 3, nheads, headdim), q, k and v stacked on dim −2.
        cu_seqlens: int32 (batch + 1,), the cumulative sequence lengths of queries and keys.
        max_seqlen: int, the longest sequence length.
        {options}

    Returns:
        out (total, nheads, headdim); with return_attn_probs, ``(out, softmax_lse, S_dmask)``
        as :func:`flash_attn_varlen_func`.
    """
    _validate.check_packed("qkv", qkv, 4, 3)
    q, k, v = qkv.unbind(-3)
    _validate.check_qkv(q, k, v, heads_axis=1, packed=True)
    _validate.check_cu_seqlens(cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, q.device, q.shape[0], k.shape[0])
    return _attend(QKV_PACKED, qkv, None, None, q, k, softmax_scale=softmax_scale, causal=causal,
                   window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p,
                   cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens, max_seqlen_q=max_seqlen,
                   max_seqlen_k=max_seqlen, deterministic=deterministic, learnable_sink=learnable_sink,
                   return_attn_probs=return_attn_probs, v=v)


@_with_options_doc
def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False, return_attn_probs=False,
                                    learnable_sink=None):
    """:func:`flash_attn_varlen_func` on q and packed k, v.

    Arguments:
        q: (total_q, nheads, headdim).
        kv: (total_k, 2, nheads_k, headdim), k and v stacked on dim −2.
        cu_seqlens_q, cu_seqlens_k: int32 (batch + 1,), cumulative sequence lengths.
        max_seqlen_q, max_seqlen_k: ints, the longest sequence lengths.
        {options}

    Returns:
        out (total_q, nheads, headdim); with return_attn_probs, ``(out, softmax_lse, S_dmask)``
        as :func:`flash_attn_varlen_func`.
    """
    _validate.check_packed("kv", kv, 4, 2)
    k, v = kv.unbind(-3)
    _validate.check_qkv(q, k, v, heads_axis=1, packed=True)
    _validate.check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q.device, q.shape[0],
                                k.shape[0])
    return _attend(KV_PACKED, q, kv, None, q, k, softmax_scale=softmax_scale, causal=causal,
                   window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p,
                   cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                   max_seqlen_k=max_seqlen_k, deterministic=deterministic,
                   learnable_sink=learnable_sink, return_attn_probs=return_attn_probs, v=v)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    learnable_sink: torch.Tensor | None = None,
) -> torch.Tensor:
    """Drop-in for ``torch.nn.functional.scaled_dot_product_attention``.

    Arguments:
        q: (batch, nheads, seqlen_q, headdim), float16 / bfloat16 / float32.
        k, v: (batch, nheads_k, seqlen_k, headdim) and (…, headdim_v), q's dtype.
        attn_mask: None, bool (True = may attend) or float (added to the scaled scores),
            broadcastable to (batch, nheads, seqlen_q, seqlen_k); a float mask that requires
            grad gets its gradient (reduced over broadcast dims). Cannot be combined with
            is_causal, as in SDPA.
        dropout_p: float in [0, 1), applied as given, as SDPA does (pass 0 in evaluation).
        is_causal: bool, aligned to the bottom-right corner as in flash-attn (SDPA aligns it
            top-left; the two agree when seqlen_q = seqlen_k).
        scale: float, default 1 / sqrt(headdim).
        enable_gqa: bool, required when nheads_k < nheads, as in SDPA.
        learnable_sink: keyword only, None or float32 (nheads,): attention sinks, as in
            :func:`flash_attn_func` (not an SDPA argument).

    Returns:
        (batch, nheads, seqlen_q, headdim_v) in q's dtype.

    On the CPU path ("cpu", :func:`flashtile.backend`) a call that SDPA computes exactly as flashtile
    would (no dropout or sink; causal only with seqlen_q = seqlen_k or 1; see ``cpu.sdpa_attention``)
    is SDPA's own call: the same fused kernel, without flashtile's Python around it.
    """
    _validate.check_qkv(q, k, v, heads_axis=1)
    if q.shape[1] != k.shape[1] and not enable_gqa:
        raise ValueError(
            f"nheads of q ({q.shape[1]}) and k ({k.shape[1]}) differ; pass enable_gqa=True for GQA/MQA"
        )
    is_causal = _validate.flag("is_causal", is_causal)
    if attn_mask is not None and is_causal:
        raise ValueError("attn_mask and is_causal cannot both be set (as in SDPA)")
    _validate.check_attn_mask(attn_mask, q, k)
    if not ops.uses_triton(q):  # the CPU path: PyTorch's own SDPA where it computes the call exactly
        options = _validate.attention_options(q.shape[-1], scale, is_causal, (-1, -1), 0.0, dropout_p,
                                              returns_lse=False)
        out = cpu.sdpa_attention(q, k, v, attn_mask, options, learnable_sink)
        if out is not None:
            return out
    bias = _validate.attn_mask_to_bias(attn_mask, q)
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    out = _attend(SEPARATE, qt, kt, vt, qt, kt, softmax_scale=scale, causal=is_causal, window_size=(-1, -1),
                  softcap=0.0, alibi_slopes=None, dropout_p=dropout_p, learnable_sink=learnable_sink, attn_bias=bias)
    return out.transpose(1, 2)
