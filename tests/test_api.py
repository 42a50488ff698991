"""Input validation: bad input gets a clear error naming the argument and the shapes."""

import pytest
import torch

import flashtile


def qkv(q_shape=(2, 16, 4, 32), kv_shape=(2, 16, 4, 32), dtype=torch.float16):
    return torch.randn(q_shape).to(dtype), torch.randn(kv_shape).to(dtype), torch.randn(kv_shape).to(dtype)


@pytest.mark.parametrize(
    "make, error, message",
    [
        (lambda: qkv(q_shape=(16, 4, 32)), ValueError, r"q must be 4-D, got shape \(16, 4, 32\)"),
        (lambda: qkv(dtype=torch.int32), TypeError, "q must be float16, bfloat16 or float32"),
        (lambda: qkv(dtype=torch.float64), TypeError, "torch.float64"),
        (lambda: (qkv()[0].float(), *qkv()[1:]), TypeError, "must share a dtype"),
        (lambda: qkv(kv_shape=(3, 16, 4, 32)), ValueError, r"batch sizes differ: q \(2, 16, 4, 32\), k \(3, 16, 4, 32\)"),
        (lambda: qkv(kv_shape=(2, 16, 4, 64)), ValueError, "head dims differ"),
        (lambda: qkv(kv_shape=(2, 16, 3, 32)), ValueError, r"nheads of q \(4\) must be a multiple of nheads of k/v \(3\)"),
        (lambda: qkv((1, 8, 2, 264), (1, 8, 2, 264)), ValueError, "head dim must be in 1..256, got 264"),
        (lambda: (*qkv()[:2], torch.randn(2, 17, 4, 32).half()), ValueError, "k and v must have the same shape"),
        (lambda: ([1.0], *qkv()[1:]), TypeError, "q must be a torch.Tensor, got list"),
    ],
    ids=["rank", "int-dtype", "float64", "mixed-dtypes", "batch", "head-dim-mismatch", "heads-not-multiple",
         "head-dim-too-large", "kv-shape", "not-a-tensor"],
)
def test_bad_inputs_raise_clear_errors(make, error, message):
    with pytest.raises(error, match=message):
        flashtile.flash_attn_func(*make())


@pytest.mark.parametrize(
    "kwargs",
    [dict(dropout_p=0.1), dict(window_size=(4, 0)), dict(softcap=30.0), dict(alibi_slopes=torch.ones(4))],
    ids=["dropout", "window", "softcap", "alibi"],
)
def test_features_of_later_issues_are_refused(kwargs):
    with pytest.raises(NotImplementedError, match=next(iter(kwargs))):
        flashtile.flash_attn_func(*qkv(), **kwargs)


def test_sdpa_api_requires_enable_gqa_for_fewer_kv_heads():
    q, k, v = (t.transpose(1, 2) for t in qkv(kv_shape=(2, 16, 2, 32)))
    with pytest.raises(ValueError, match="enable_gqa=True"):
        flashtile.attention(q, k, v)
    assert flashtile.attention(q, k, v, enable_gqa=True).shape == q.shape
