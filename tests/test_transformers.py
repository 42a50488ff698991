"""flashtile inside Hugging Face transformers models, against the same models on SDPA.

A small randomly initialised model (no downloads) runs twice from one state_dict,
with attn_implementation="sdpa" and with flashtile's registered name: the logits and,
in training mode, the gradients of every parameter must agree, for a plain batch, a
padded one (left and right padding; only real tokens compared) and packed ones
(sequences concatenated with position_ids restarting, or with the flash kwargs of
DataCollatorWithFlattening), compared with each sequence run alone through the SDPA
model. A Mistral model covers the sliding window; a Gemma 2 model the softcap and a gpt-oss
model the attention sinks (``s_aux``), both against eager attention since SDPA has neither; a
DeepSeek-V3 model MLA's head dims (q/k 24, v 16).

Tolerance: both sides compute in float32 and differ only in the order of their
float32 sums (tiled online softmax vs one softmax), a few ulps per attention that two
layers and the backward amplify a little; TOLERANCE = 1e-5 of the largest reference
value (~80 float32 ulps) holds with a margin while a real bug (a wrong mask, window or
position) errs by 1e-2 or more.

Models are tiny (hidden 64, 2 layers, head dim 16) and sequences ≤ 24 tokens because
the kernels run under Triton's interpreter on the CPU: the whole file takes ~30 s on
2 cores.
"""

import copy
import inspect
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest
import torch
from helpers import DEVICE

transformers = pytest.importorskip("transformers")

from flashtile.integrations import transformers as integration  # noqa: E402

NAME = integration.register()
TOLERANCE = 1e-5
VOCAB = 128
SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=VOCAB)  # GQA 4:2, head dim 16
CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**SMALL),
    "mistral-window-5": lambda: transformers.MistralConfig(**SMALL, sliding_window=5),
    # layer 0 slides (window 5), layer 1 is global; a softcap of 1 bends most scores
    "gemma2-softcap": lambda: transformers.Gemma2Config(**SMALL, head_dim=16, query_pre_attn_scalar=16,
                                                        sliding_window=5, attn_logit_softcapping=1.0),
    # attention sinks; layer 0 slides (window 5), layer 1 is global; 4 experts, 2 per token
    "gpt-oss-sinks": lambda: transformers.GptOssConfig(**SMALL, head_dim=16, sliding_window=5, num_local_experts=4,
                                                       num_experts_per_tok=2,
                                                       layer_types=["sliding_attention", "full_attention"]),
    # MLA: q/k head dim 24 (16 + 8 rotary), v head dim 16; 4 experts, 2 per token from layer 1 on
    "deepseek-v3-mla": lambda: transformers.DeepseekV3Config(
        **dict(SMALL, num_key_value_heads=4), kv_lora_rank=32, q_lora_rank=48, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
        n_group=1, topk_group=1, first_k_dense_replace=1),
}
# SDPA has no softcap and no sinks; eager attention is transformers' reference for them
REFERENCE_IMPLEMENTATION = {"gemma2-softcap": "eager", "gpt-oss-sinks": "eager"}


def models(config_name):
    """(reference model, flashtile model) with the same random weights, float32, on DEVICE. The
    reference runs SDPA (eager where SDPA lacks a feature); it is called ``sdpa`` below."""
    torch.manual_seed(0)
    config = CONFIGS[config_name]()
    reference = REFERENCE_IMPLEMENTATION.get(config_name, "sdpa")
    sdpa = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=reference)
    for name, parameter in sdpa.named_parameters():
        if name.endswith(".sinks"):  # initialised near 0; spread them so that a lost sink shows
            parameter.data.normal_(0.0, 2.0)
    tile = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=NAME)
    tile.load_state_dict(sdpa.state_dict())
    assert tile.config._attn_implementation == NAME
    return sdpa.to(DEVICE), tile.to(DEVICE)


def run(model, train, weights, **inputs):
    """Logits, and in training mode the gradients of sum(logits · weights) for every parameter."""
    model.train(train)
    model.zero_grad()
    with torch.set_grad_enabled(train):
        logits = model(**inputs).logits
        if train:
            (logits * weights).sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()} if train else {}
    return logits.detach(), grads


def assert_close(name, actual, expected):
    bound = TOLERANCE * max(expected.abs().max().item(), 1e-30)
    error = (actual - expected).abs().max().item()
    assert error <= bound, f"{name}: error {error:.3e} > {bound:.3e} ({TOLERANCE} x max |reference|)"


def assert_grads_close(actual, expected):
    assert actual.keys() == expected.keys()
    for name in expected:
        assert_close(f"grad {name}", actual[name], expected[name])


def random_ids(*shape, seed=1):
    return torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE)


def random_weights(*shape, seed=2):
    return torch.randn(*shape, VOCAB, generator=torch.Generator().manual_seed(seed)).to(DEVICE)


MODES = {"eval": False, "train": True}


@pytest.mark.parametrize("train", MODES.values(), ids=MODES.keys())
@pytest.mark.parametrize("config_name", CONFIGS)
def test_plain_batch_matches_sdpa(config_name, train):
    sdpa, tile = models(config_name)
    ids, weights = random_ids(2, 13), random_weights(2, 13)
    expected, expected_grads = run(sdpa, train, weights, input_ids=ids)
    actual, actual_grads = run(tile, train, weights, input_ids=ids)
    assert_close("logits", actual, expected)
    assert_grads_close(actual_grads, expected_grads)


@pytest.mark.parametrize("train", MODES.values(), ids=MODES.keys())
@pytest.mark.parametrize("config_name", CONFIGS)
def test_padded_batch_matches_sdpa_on_real_tokens(config_name, train):
    sdpa, tile = models(config_name)
    ids = random_ids(3, 12)
    mask = torch.ones_like(ids)
    mask[0, :5] = 0  # left padding
    mask[1, 9:] = 0  # right padding
    real = mask.bool()
    weights = random_weights(3, 12) * real[..., None]  # padded positions take no part in the loss
    expected, expected_grads = run(sdpa, train, weights, input_ids=ids, attention_mask=mask)
    actual, actual_grads = run(tile, train, weights, input_ids=ids, attention_mask=mask)
    assert_close("logits", actual[real], expected[real])
    assert (actual[~real] == actual[~real]).all(), "NaN at padded positions"
    assert_grads_close(actual_grads, expected_grads)


@pytest.mark.skipif(DEVICE != "cpu", reason="the CPU path")
@pytest.mark.parametrize("train", MODES.values(), ids=MODES.keys())
def test_cpu_path_runs_left_padded_batches_as_one_masked_call(monkeypatch, train):
    # on the "cpu" path a left-padded batch is one call of PyTorch's fused kernel with the padding as a
    # key mask (integration._masked), prefill and each decoding step, instead of an unpadded varlen call
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    masked_calls = []
    masked = integration._masked
    monkeypatch.setattr(integration, "_masked", lambda *arguments: masked_calls.append(1) or masked(*arguments))
    sdpa, tile = models("llama")
    ids = random_ids(3, 12)
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    mask[2, :2] = 0
    real = mask.bool()
    weights = random_weights(3, 12) * real[..., None]
    expected, expected_grads = run(sdpa, train, weights, input_ids=ids, attention_mask=mask)
    actual, actual_grads = run(tile, train, weights, input_ids=ids, attention_mask=mask)
    assert len(masked_calls) == 2  # one per layer
    assert_close("logits", actual[real], expected[real])
    assert_grads_close(actual_grads, expected_grads)
    if not train:
        generated = [model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
                     for model in (sdpa, tile)]
        assert len(masked_calls) == 2 + 2 * 4  # the prefill and three decoding steps, each layer
        assert torch.equal(*generated)


@pytest.mark.skipif(DEVICE != "cpu", reason="the CPU path")
def test_cpu_path_generates_with_a_static_cache(monkeypatch):
    # a static cache hands every layer its whole length, past the padding mask: the masked call attends to
    # the mask's keys only (a dynamic cache's keys are the mask's, and are passed on unsliced)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    lengths = []
    masked = integration._masked
    monkeypatch.setattr(integration, "_masked", lambda query, key, value, mask, options: lengths.append(
        (key.shape[2], mask.shape[1])) or masked(query, key, value, mask, options))
    sdpa, tile = models("llama")
    ids = random_ids(3, 12)
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    generated = [model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False,
                                cache_implementation="static") for model in (sdpa, tile)]
    assert any(keys > mask_length for keys, mask_length in lengths)
    assert torch.equal(*generated)


def test_4d_boolean_mask_matches_sdpa():
    """A user's 4-D mask reaches the attention as is; flashtile.attention applies it."""
    sdpa, tile = models("llama")
    ids, weights = random_ids(2, 11), random_weights(2, 11)
    causal = torch.ones(11, 11, dtype=torch.bool, device=DEVICE).tril()
    mask = causal.expand(2, 1, 11, 11).clone()
    mask[1, :, :, 2] = False  # one key hidden from every query of the second sequence
    expected, expected_grads = run(sdpa, True, weights, input_ids=ids, attention_mask=mask)
    actual, actual_grads = run(tile, True, weights, input_ids=ids, attention_mask=mask)
    assert_close("logits", actual, expected)
    assert_grads_close(actual_grads, expected_grads)


SEQLENS = [5, 1, 11, 7]  # one of length 1; 24 tokens in all
ROWS_SEQLENS = [[4, 6], [7, 3]]  # two rows of a batch, each packing two sequences


def packed_batch(how):
    """(inputs, the sequence lengths of each row) of a packed batch. One row of SEQLENS as
    DataCollatorWithFlattening builds it, the packing read from the restarting position_ids or,
    for "flash-kwargs", given as cu_seq_lens/max_length; or "2-rows" of ROWS_SEQLENS."""
    if how == "2-rows":
        positions = [torch.cat([torch.arange(n) for n in row]) for row in ROWS_SEQLENS]
        return dict(input_ids=random_ids(2, 10), position_ids=torch.stack(positions).to(DEVICE)), ROWS_SEQLENS
    sequences = [random_ids(n, seed=10 + i).tolist() for i, n in enumerate(SEQLENS)]
    collate = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=how == "flash-kwargs")
    batch = collate([{"input_ids": s} for s in sequences])
    batch.pop("labels")
    return {name: t.to(DEVICE) if isinstance(t, torch.Tensor) else t for name, t in batch.items()}, [SEQLENS]


# Training mode compares the logits too. The window is independent of how the packing arrives.
# The reference is each sequence alone, not SDPA on the packed batch: transformers < 4.54 (and
# any version while a KV cache is in use) does not read packing from position_ids for SDPA.
@pytest.mark.parametrize("config_name, how", [("llama", "position-ids"), ("llama", "flash-kwargs"),
                                              ("llama", "2-rows"), ("mistral-window-5", "position-ids"),
                                              ("gpt-oss-sinks", "flash-kwargs"), ("deepseek-v3-mla", "position-ids")])
def test_packed_batch_matches_sequences_run_alone(config_name, how):
    sdpa, tile = models(config_name)
    inputs, rows_seqlens = packed_batch(how)
    weights = random_weights(*inputs["input_ids"].shape)
    actual, actual_grads = run(tile, True, weights, **inputs)
    expected, expected_grads = [], {}
    for ids_row, weights_row, seqlens in zip(inputs["input_ids"], weights, rows_seqlens):
        for ids, w in zip(ids_row.split(seqlens), weights_row.split(seqlens)):
            logits, grads = run(sdpa, True, w[None], input_ids=ids[None])
            expected.append(logits[0])
            expected_grads = {name: g + expected_grads.get(name, 0) for name, g in grads.items()}
    assert_close("logits", actual, torch.cat(expected).view(actual.shape))
    assert_grads_close(actual_grads, expected_grads)


@pytest.mark.skipif("use_vmap" not in inspect.signature(transformers.masking_utils.sdpa_mask).parameters,
                    reason="transformers < 5 does not flag overlaid mask functions (use_vmap)")
def test_overlaid_mask_function_gets_an_explicit_mask():
    """A model's or_mask_function (here: a bidirectional prefix of 4 tokens) cannot be expressed by
    the kernels; the mask function hands flashtile SDPA's explicit mask, and the results agree."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import create_causal_mask

    sdpa, tile = models("llama")
    embeds = torch.zeros(2, 9, 64, device=DEVICE)  # only its shape and dtype matter
    prefix = lambda batch_idx, head_idx, q_idx, kv_idx: kv_idx < 4  # noqa: E731
    masks = [create_causal_mask(model.config, embeds, None, None, or_mask_function=prefix) for model in (sdpa, tile)]
    assert masks[1].dim() == 4 and torch.equal(masks[0], masks[1])
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, h, 9, 16, generator=g).to(DEVICE) for h in (4, 2, 2))
    module = sdpa.model.layers[0].self_attn
    expected, _ = sdpa_attention_forward(module, q, k, v, masks[0], scaling=0.25)
    actual, _ = integration.attention_forward(module, q, k, v, masks[1], scaling=0.25)
    assert_close("attention output", actual, expected)


def test_dropout_only_in_training():
    _, tile = models("llama")
    module = tile.model.layers[0].self_attn
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, h, 7, 16, generator=g).to(DEVICE) for h in (4, 2, 2))

    def attend(train, dropout, seed=5):
        module.train(train)
        torch.manual_seed(seed)
        return integration.attention_forward(module, q, k, v, None, dropout=dropout)[0]

    assert torch.equal(attend(False, 0.5), attend(False, 0.0))
    assert not torch.equal(attend(True, 0.5), attend(True, 0.0))
    assert torch.equal(attend(True, 0.5), attend(True, 0.5))  # the seed reproduces the mask


def usage_snippet():
    """The code block of the integration module's docstring, the README's transformers example."""
    block = re.search(r"Usage.*?::\n\n(.*?)\n\n(?! )", integration.__doc__, re.S).group(1)
    return textwrap.dedent(block)


def test_usage_snippet_runs():
    namespace = {}
    exec(compile(usage_snippet(), "usage snippet", "exec"), namespace)
    assert namespace["model"].config._attn_implementation == integration.DEFAULT_NAME
    assert all(p.grad is not None for p in namespace["model"].parameters())


def test_readme_shows_the_usage_snippet():
    readme = (pathlib.Path(__file__).parents[1] / "README.md").read_text()
    assert usage_snippet() in readme, "README.md's transformers section must show integration's usage snippet"


def test_names_containing_flash_are_refused():
    with pytest.raises(ValueError, match="contains 'flash'"):
        integration.register("flashtile")


def test_unsupported_arguments_are_refused():
    _, tile = models("llama")
    q = torch.randn(1, 4, 3, 16, device=DEVICE)
    k = torch.randn(1, 2, 3, 16, device=DEVICE)
    with pytest.raises(NotImplementedError, match="position_bias"):
        integration.attention_forward(tile.model.layers[0].self_attn, q, k, k, None, position_bias=torch.zeros(4))


def test_output_attentions_warns_that_no_weights_are_formed():
    _, tile = models("llama")
    with pytest.warns(UserWarning, match="never forms the attention weights"):
        outputs = tile(random_ids(1, 8), output_attentions=True)
    assert outputs.attentions == ()  # what the model returns: no weights, now said out loud


def _python(code):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_flashtile_does_not_import_transformers():
    result = _python("import sys, flashtile, flashtile.integrations.transformers; "
                     "assert 'transformers' not in sys.modules, 'imported transformers'")
    assert result.returncode == 0, result.stderr


def test_missing_transformers_raises_a_clear_import_error():
    result = _python("import sys; sys.modules['transformers'] = None\n"
                     "from flashtile.integrations.transformers import register\n"
                     "try:\n    register()\nexcept ImportError as e:\n    print(e)")
    assert result.returncode == 0, result.stderr
    assert "pip install 'transformers>=4.53'" in result.stdout
