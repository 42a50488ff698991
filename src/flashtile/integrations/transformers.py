"""Hugging Face transformers integration: flashtile as an ``attn_implementation``.

Usage (the tests run this snippet verbatim; the README shows the same text)::

    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from flashtile.integrations.transformers import register

    register()  # adds attn_implementation="tile_attention" to transformers
    device = "cuda" if torch.cuda.is_available() else "cpu"
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=128)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="tile_attention").to(device)
    input_ids = torch.randint(0, 128, (2, 16), device=device)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, :5] = 0  # left padding: the batch runs as a variable-length one
    loss = model(input_ids, attention_mask=attention_mask, labels=input_ids).loss
    loss.backward()

A model already loaded switches with ``model.set_attn_implementation("tile_attention")``.

The name must not contain "flash": transformers ≥ 5 takes such names for the
flash-attn packages or Hub kernels and tries to load one.

How transformers' arguments map onto flashtile (the contract of its
``flash_attention_2`` integration, which this mirrors):

* no mask: ``flash_attn_func`` (causal unless the module or call says otherwise);
* a (batch, seqlen_k) padding mask: the tokens are gathered into a variable-length
  batch here (flashtile itself never copies padding), ``flash_attn_varlen_func``
  runs, and the outputs are scattered back; padded query positions get 0. The
  queries are the last seqlen_q positions of the mask (bottom-right, as a KV cache
  has them);
* packed sequences, from ``cu_seq_lens_q/k`` and ``max_length_q/k`` (as
  ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)`` gives) or from
  ``position_ids`` that restart (any batch size, as transformers' SDPA mask reads
  them: a sequence starts wherever a position does not follow the previous one):
  ``flash_attn_varlen_func``;
* a 4-D mask (boolean or additive float, passed by the user or built by the mask
  function below): ``flashtile.attention`` with ``attn_mask``; the mask already holds
  the causal and sliding-window pattern, as SDPA receives it;
* ``sliding_window=w``: ``window_size=(w − 1, w − 1)`` (a query sees w keys counting
  itself; causal makes the right side 0); ``softcap`` passed through; dropout only in
  training; GQA natively; attention sinks (``s_aux``, gpt-oss's one logit per head) as
  ``learnable_sink``, in float32, their gradient flowing back to the model's parameter.
  MLA's value head dim (DeepSeek-V3) passes through as it is. Returns ``(attn_output (batch,
  seqlen_q, nheads, headdim_v), None)``: attention weights are never formed
  (``output_attentions=True`` warns and returns none, as flash-attn's and SDPA's
  integrations do).

Not supported (refused with NotImplementedError): ``position_bias`` (T5-style), ``softcap``
together with a 4-D mask.
"""

from __future__ import annotations

import warnings

import torch

from .. import reference
from ..interface import attention, flash_attn_func, flash_attn_varlen_func
from ..ops import uses_triton

DEFAULT_NAME = "tile_attention"
_INSTALL_HINT = "install it with: pip install 'transformers>=4.53'"
_UNSUPPORTED_KWARGS = ("position_bias",)
_PACKED_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def register(name: str = DEFAULT_NAME) -> str:
    """Register flashtile in transformers under ``name`` and return the name.

    Adds :func:`attention_forward` to transformers' ``AttentionInterface`` and
    :func:`build_attention_mask` to its ``AttentionMaskInterface`` (transformers ≥ 4.53).
    Imports transformers; raises ImportError if it is missing or older.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty str, got {name!r}")
    if "flash" in name.lower():
        raise ValueError(f"name {name!r} contains 'flash': transformers ≥ 5 takes such names for flash-attn "
                         f"kernels and tries to load one; choose another, e.g. {DEFAULT_NAME!r}")
    try:
        import transformers
    except ImportError as error:
        raise ImportError(f"flashtile.integrations.transformers needs Hugging Face transformers ≥ 4.53; "
                          f"{_INSTALL_HINT}") from error
    if not hasattr(transformers, "AttentionMaskInterface"):
        raise ImportError(f"flashtile.integrations.transformers needs transformers ≥ 4.53 (AttentionMaskInterface), "
                          f"found {transformers.__version__}; {_INSTALL_HINT}")
    transformers.AttentionInterface.register(name, attention_forward)
    transformers.AttentionMaskInterface.register(name, build_attention_mask)
    return name


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      sliding_window: int | None = None, softcap: float | None = None,
                      is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract, computed by flashtile (see the module docstring).

    query: (batch, nheads, seqlen_q, headdim); key, value: (batch, nheads_k, seqlen_k,
    headdim or headdim_v); attention_mask: None, (batch, seqlen_k) padding (1 = token) or 4-D.
    Returns (attn_output (batch, seqlen_q, nheads, headdim_v), None).
    """
    for name in _UNSUPPORTED_KWARGS:
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"flashtile's transformers integration does not support {name}; "
                                      f"use attn_implementation='eager' for this model")
    if kwargs.get("output_attentions"):
        # as flash-attn's and SDPA's integrations do: the call goes on, without weights
        warnings.warn("flashtile never forms the attention weights: output_attentions=True returns none "
                      "(model outputs' attentions stay empty); use attn_implementation='eager' to get them",
                      UserWarning, stacklevel=2)
    options = dict(
        dropout_p=dropout if module.training else 0.0,
        softmax_scale=scaling,
        causal=bool(getattr(module, "is_causal", True) if is_causal is None else is_causal),
        window_size=(-1, -1) if sliding_window is None else (sliding_window - 1, sliding_window - 1),
        softcap=softcap or 0.0,
        learnable_sink=None if kwargs.get("s_aux") is None else kwargs["s_aux"].float(),
    )
    if attention_mask is not None and attention_mask.dim() == 4:
        return _with_4d_mask(query, key, value, attention_mask, options), None
    if attention_mask is not None and attention_mask.dim() != 2:
        raise ValueError(f"attention_mask must be 2-D (batch, seqlen_k) or 4-D, "
                         f"got shape {tuple(attention_mask.shape)}")
    if attention_mask is not None and _masked_on_the_cpu(query, attention_mask, options):
        return _masked(query, key, value, attention_mask, options), None
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # (batch, seqlen, nheads, headdim)
    if attention_mask is not None:
        return _unpadded(q, k, v, attention_mask, options), None
    packed = _packed_from_kwargs(kwargs)
    if packed is None and q.shape[1] == k.shape[1] > 1:
        packed = _packed_from_position_ids(kwargs.get("position_ids"), *q.shape[:2])
    if packed is None:
        return flash_attn_func(q, k, v, **options), None
    cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k = packed
    out = flash_attn_varlen_func(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu_seqlens_q, cu_seqlens_k,
                                 max_seqlen_q, max_seqlen_k, **options)
    return out.view(*q.shape[:-1], v.shape[-1]), None


def build_attention_mask(*args, **kwargs):
    """transformers' mask-interface contract: builds what :func:`attention_forward` receives.

    flash-attention's mask, a (batch, seqlen_k) padding mask or None when nothing is
    padded, since the kernels apply causality, sliding windows and packing themselves.
    Two patterns they cannot express get SDPA's explicit 4-D boolean mask instead,
    applied exactly by ``flashtile.attention``: chunked attention (a config with
    ``attention_chunk_size``, Llama 4) and mask functions a model overlays on the causal
    one (transformers ≥ 5 flags them with ``use_vmap``; e.g. image tokens that attend
    bidirectionally).
    """
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    explicit = kwargs.get("use_vmap") or getattr(kwargs.get("config"), "attention_chunk_size", None)
    return ALL_MASK_ATTENTION_FUNCTIONS["sdpa" if explicit else "flash_attention_2"](*args, **kwargs)


def _with_4d_mask(query, key, value, mask, options):
    if options["softcap"]:
        raise NotImplementedError("softcap with a 4-D attention mask is not supported by flashtile.attention")
    out = attention(query, key, value, attn_mask=mask, dropout_p=options["dropout_p"],
                    scale=options["softmax_scale"], enable_gqa=True, learnable_sink=options["learnable_sink"])
    return out.transpose(1, 2)


def _masked_on_the_cpu(query, padding_mask, options) -> bool:
    """Whether a padded batch (``query`` in transformers' layout (batch, nheads, seqlen, headdim)) runs as
    one masked call (:func:`_masked`) rather than unpadded: on the
    "cpu" path, where one call of PyTorch's fused kernel with the padding as a mask beats gathering
    the batch (and the whole KV cache, at every decoding step) into a packed one; for plain
    attention, and under causality only with left padding (each row's tokens last), where the
    padded positions give each real token the same keys as the packed sequence does."""
    if uses_triton(query) or options["window_size"] != (-1, -1) or options["softcap"] \
            or options["dropout_p"]:
        return False
    if not options["causal"] or query.shape[2] == 1:  # a decoding step's one query sees every real key
        return True
    keep = padding_mask.bool()
    positions = torch.arange(keep.shape[1], device=keep.device)
    return bool((keep == (positions >= keep.shape[1] - keep.sum(1, keepdim=True))).all())


def _masked(query, key, value, padding_mask, options):
    """Attention of a padded batch, given in transformers' layout (batch, nheads, seqlen, headdim), with
    the padding as a key mask (and causality, bottom-right, in the padded positions):
    ``flashtile.attention``, whose "cpu" path is PyTorch's fused kernel → (batch, seqlen_q, nheads, headdim_v)."""
    batch, seqlen_k = padding_mask.shape
    keep = padding_mask.bool().reshape(batch, 1, 1, seqlen_k)
    seqlen_q = query.shape[2]
    if key.shape[2] != seqlen_k:  # a static KV cache has unused slots past the mask (a dynamic one has none)
        key, value = key[:, :, :seqlen_k], value[:, :, :seqlen_k]
    if options["causal"] and seqlen_q > 1:
        keep = keep & reference.visible_mask(seqlen_q, seqlen_k, causal=True, device=query.device)
    out = attention(query, key, value, attn_mask=keep, scale=options["softmax_scale"], enable_gqa=True,
                    learnable_sink=options["learnable_sink"])
    return out.transpose(1, 2)


def _unpadded(q, k, v, padding_mask, options):
    """Attention of a padded batch as a variable-length one: gather the tokens, attend, scatter back."""
    batch, seqlen_q = q.shape[:2]
    if padding_mask.shape[0] != batch or not seqlen_q <= padding_mask.shape[1] <= k.shape[1]:
        raise ValueError(f"padding mask of shape {tuple(padding_mask.shape)} does not fit queries "
                         f"{tuple(q.shape)} and keys {tuple(k.shape)} (batch, seqlen, nheads, headdim)")
    keep_k = padding_mask.bool()
    k, v = k[:, :keep_k.shape[1]], v[:, :keep_k.shape[1]]  # a static KV cache has unused slots past the mask
    index_k, cu_seqlens_k, max_seqlen_k = _ragged(keep_k)
    if seqlen_q == keep_k.shape[1]:
        index_q, cu_seqlens_q, max_seqlen_q = index_k, cu_seqlens_k, max_seqlen_k
    else:
        index_q, cu_seqlens_q, max_seqlen_q = _ragged(keep_k[:, -seqlen_q:])
    out = flash_attn_varlen_func(q.flatten(0, 1)[index_q], k.flatten(0, 1)[index_k], v.flatten(0, 1)[index_k],
                                 cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **options)
    padded = out.new_zeros(batch * seqlen_q, *out.shape[1:])  # [batch * seqlen_q, nheads, headdim]
    padded[index_q] = out
    return padded.view(batch, seqlen_q, *out.shape[1:])


def _ragged(keep: torch.Tensor):
    """(flat indices of the kept tokens, int32 cu_seqlens, longest length) of a (batch, seqlen) bool mask."""
    lengths = keep.sum(dim=1, dtype=torch.int32)
    cu_seqlens = torch.nn.functional.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))
    return keep.flatten().nonzero().flatten(), cu_seqlens, int(lengths.max())


def _packed_from_kwargs(kwargs):
    """(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) from transformers' flash kwargs, if all given."""
    if any(kwargs.get(name) is None for name in _PACKED_KWARGS):
        return None
    cu_seqlens_q, cu_seqlens_k, max_length_q, max_length_k = (kwargs[name] for name in _PACKED_KWARGS)
    return cu_seqlens_q.to(torch.int32), cu_seqlens_k.to(torch.int32), int(max_length_q), int(max_length_k)


def _packed_from_position_ids(position_ids, batch: int, seqlen: int):
    """Packing read from position_ids (batch or 1, seqlen), as transformers' SDPA mask reads it: a
    sequence starts at each row's start and wherever a position does not follow the previous one.
    None when every row holds one sequence (or position_ids are absent or not of that shape)."""
    if not isinstance(position_ids, torch.Tensor) or position_ids.dim() != 2 \
            or position_ids.shape[1] != seqlen or position_ids.shape[0] not in (1, batch):
        return None
    positions = position_ids.expand(batch, seqlen)
    starts = torch.ones(batch, seqlen, dtype=torch.bool, device=positions.device)
    starts[:, 1:] = positions[:, 1:] != positions[:, :-1] + 1
    first_tokens = starts.flatten().nonzero().flatten()
    if first_tokens.numel() == batch:
        return None
    total = torch.tensor([batch * seqlen], device=first_tokens.device)
    cu_seqlens = torch.cat([first_tokens, total]).to(torch.int32)
    max_seqlen = int(cu_seqlens.diff().max())
    return cu_seqlens, cu_seqlens, max_seqlen, max_seqlen
