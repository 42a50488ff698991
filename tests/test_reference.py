"""The identities the algorithm rests on, proved on the references in float64."""

import math

import pytest
import torch

from flashtile import reference as ref


def test_online_softmax_worked_example():
    # x = [1, 3, 2, 5]: m = 5, ℓ = e⁻⁴ + e⁻² + e⁻³ + e⁰ ≈ 1.2034 (the seeds' example)
    m, ell = ref.online_softmax(torch.tensor([1.0, 3.0, 2.0, 5.0], dtype=torch.float64))
    assert m.item() == 5.0
    assert ell.item() == pytest.approx(1.2034, abs=5e-5)
    assert ell.item() == pytest.approx(math.exp(-4) + math.exp(-2) + math.exp(-3) + 1.0, rel=1e-15)


def _partial_state(s, v):
    """(m, ℓ, Õ) of scores s [R, C] over values v [C, D], computed in one shot."""
    m = s.amax(-1)
    p = torch.exp(s - m[:, None])
    return m, p.sum(-1), p @ v


def _states_close(a, b):
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=1e-13, atol=1e-13)


def test_merge_is_exact_associative_and_order_free():
    g = torch.Generator().manual_seed(0)
    s = torch.randn(5, 30, generator=g, dtype=torch.float64) * 4
    v = torch.randn(30, 7, generator=g, dtype=torch.float64)
    parts = [_partial_state(s[:, a:b], v[a:b]) for a, b in ((0, 7), (7, 19), (19, 30))]
    whole = _partial_state(s, v)
    x, y, z = parts
    left = ref.merge_softmax_states(ref.merge_softmax_states(x, y), z)
    right = ref.merge_softmax_states(x, ref.merge_softmax_states(y, z))
    shuffled = ref.merge_softmax_states(ref.merge_softmax_states(z, x), y)
    for merged in (left, right, shuffled):
        _states_close(merged, whole)


def test_merge_with_empty_state_is_neutral():
    g = torch.Generator().manual_seed(1)
    s = torch.randn(3, 9, generator=g, dtype=torch.float64)
    v = torch.randn(9, 4, generator=g, dtype=torch.float64)
    state = _partial_state(s, v)
    empty = (torch.full((3,), -math.inf, dtype=torch.float64), torch.zeros(3, dtype=torch.float64),
             torch.zeros(3, 4, dtype=torch.float64))
    _states_close(ref.merge_softmax_states(empty, state), state)
    m, ell, acc = ref.merge_softmax_states(empty, empty)
    assert torch.isneginf(m).all() and (ell == 0).all() and (acc == 0).all()


def _inputs(seed, b=2, hq=4, hk=2, nq=37, nk=53, d=24):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, nq, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, hk, nk, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, hk, nk, d, generator=g, dtype=torch.float64)
    do = torch.randn(b, hq, nq, d, generator=g, dtype=torch.float64)
    return q, k, v, do


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_rowsum_dp_p_equals_rowsum_do_o(causal):
    q, k, v, do = _inputs(2)
    out, _, p = ref.attention_forward(q, k, v, causal=causal)
    dp = do @ v.repeat_interleave(2, dim=1).transpose(-1, -2)
    torch.testing.assert_close((dp * p).sum(-1), (do * out).sum(-1), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_standard_backward_formulas_match_autograd(causal):
    q, k, v, do = _inputs(3)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out, _, _ = ref.attention_forward(q, k, v, causal=causal)
    expected = torch.autograd.grad(out, (q, k, v), do)
    got = ref.attention_backward(q.detach(), k.detach(), v.detach(), do, causal=causal)
    for name, e, g in zip("qkv", expected, got):
        torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-12, msg=f"d{name}")


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seqlens", [(37, 53), (53, 37), (1, 16)], ids=lambda s: f"q{s[0]}-k{s[1]}")
def test_tiled_equals_standard_in_float64(causal, seqlens):
    q, k, v, do = _inputs(4, nq=seqlens[0], nk=seqlens[1])
    out, lse, _ = ref.attention_forward(q, k, v, causal=causal)
    grads = ref.attention_backward(q, k, v, do, causal=causal)
    # small blocks so that every loop runs several ragged iterations
    t_out, t_lse = ref.tiled_attention_forward(q, k, v, causal=causal, block_m=8, block_n=16)
    t_grads = ref.tiled_attention_backward(q, k, v, t_out, t_lse, do, causal=causal, block_m=8, block_n=16)
    torch.testing.assert_close(t_out, out, rtol=0, atol=1e-12)
    torch.testing.assert_close(t_lse, lse, rtol=0, atol=1e-12)
    for name, e, g in zip("qkv", grads, t_grads):
        torch.testing.assert_close(g, e, rtol=0, atol=1e-12, msg=f"d{name}")


def test_fully_masked_rows_give_zero_and_neg_inf():
    q, k, v, _ = _inputs(5, nq=6, nk=3)  # causal, bottom-right: rows 0..2 see no key
    for out, lse in (ref.attention_forward(q, k, v, causal=True)[:2],
                     ref.tiled_attention_forward(q, k, v, causal=True, block_m=4, block_n=2)):
        assert (out[:, :, :3] == 0).all() and torch.isneginf(lse[:, :, :3]).all()
        assert torch.isfinite(out).all() and torch.isfinite(lse[:, :, 3:]).all()
