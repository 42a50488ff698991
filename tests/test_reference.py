"""The identities the algorithm rests on, proved on the references in float64.

Also the reference's own building blocks: the window rule and the block ranges that
skip invisible blocks, the dropout RNG (bit-exact against Triton's Philox), the
written-out backward (against autograd) and the tiled algorithm (against standard
attention) for every variant. Float64 on the CPU, ~7 s on 2 cores (the Philox check
runs one small Triton kernel, under the interpreter off the GPU).
"""

import math

import pytest
import torch
import triton
import triton.language as tl
from helpers import DEVICE

from flashtile import reference as ref
from flashtile.triton.scores import dropout_keep


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


# ----------------------------------------------------------------------------------------------
# Visibility and block ranges


def _visible_by_definition(seqlen_q, seqlen_k, left, right):
    """The window rule written as a double loop: i + Nk − Nq − left ≤ j ≤ i + Nk − Nq + right."""
    mask = torch.zeros(seqlen_q, seqlen_k, dtype=torch.bool)
    for i in range(seqlen_q):
        for j in range(seqlen_k):
            centre = i + seqlen_k - seqlen_q
            mask[i, j] = (left < 0 or j >= centre - left) and (right < 0 or j <= centre + right)
    return mask


WINDOWS = [(-1, -1), (0, 0), (3, -1), (-1, 2), (5, 1), (0, 7), (40, 40)]


@pytest.mark.parametrize("seqlens", [(9, 9), (5, 13), (13, 5)], ids=lambda s: f"q{s[0]}-k{s[1]}")
@pytest.mark.parametrize("window", WINDOWS, ids=lambda w: f"w{w[0]}_{w[1]}")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_visible_mask_follows_the_window_rule(causal, window, seqlens):
    left, right = window
    expected = _visible_by_definition(*seqlens, left, 0 if causal else right)  # causal is right = 0
    assert torch.equal(ref.visible_mask(*seqlens, causal=causal, window_size=window), expected)
    if window == (-1, -1) and causal:
        assert torch.equal(ref.causal_mask(*seqlens), expected)


def _blocks_with_visible_keys(mask, rows, block):
    cols = mask[rows].any(0).nonzero().flatten()
    return sorted({int(c) // block for c in cols})


@pytest.mark.parametrize("seqlens", [(37, 53), (53, 37), (16, 16), (1, 40), (40, 1)],
                         ids=lambda s: f"q{s[0]}-k{s[1]}")
@pytest.mark.parametrize("window", WINDOWS + [(2, 30), (60, 0)], ids=lambda w: f"w{w[0]}_{w[1]}")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_block_ranges_visit_exactly_the_blocks_with_visible_entries(causal, window, seqlens):
    seqlen_q, seqlen_k = seqlens
    mask = ref.visible_mask(seqlen_q, seqlen_k, causal, window)
    normalised = ref.normalize_window(causal, window)
    for block_m, block_n in ((8, 16), (16, 4), (64, 64)):
        for m0 in range(0, seqlen_q, block_m):
            m1 = min(m0 + block_m, seqlen_q)
            lo, hi = ref.key_range(m0, m1, seqlen_q, seqlen_k, normalised, block_n)
            assert lo % block_n == 0
            visited = [n0 // block_n for n0 in range(lo, hi, block_n)]
            assert visited == _blocks_with_visible_keys(mask, slice(m0, m1), block_n), (m0, block_m, block_n)
        for n0 in range(0, seqlen_k, block_n):
            n1 = min(n0 + block_n, seqlen_k)
            lo, hi = ref.query_range(n0, n1, seqlen_q, seqlen_k, normalised, block_m)
            assert lo % block_m == 0
            visited = [m0 // block_m for m0 in range(lo, hi, block_m)]
            assert visited == _blocks_with_visible_keys(mask.T, slice(n0, n1), block_m), (n0, block_m, block_n)


# ----------------------------------------------------------------------------------------------
# Dropout RNG: bit-identical to the kernels' Philox


@triton.jit
def _dropout_draw_kernel(Uniform, Keep, seed, dropout_p, row_start, col_start, nheads,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One program per (batch, head): Triton's own Philox uniforms and the kernels' keep mask."""
    i_bh = tl.program_id(0)
    rows = row_start + tl.arange(0, BLOCK_M)
    cols = col_start + tl.arange(0, BLOCK_N)
    zeros = rows[:, None] * 0 + cols[None, :] * 0  # [BLOCK_M, BLOCK_N]
    word, _, _, _ = tl.random.philox(seed, (zeros + cols[None, :]).to(tl.uint32),
                                     (zeros + rows[:, None]).to(tl.uint32), (zeros + i_bh).to(tl.uint32),
                                     zeros.to(tl.uint32))
    keep = dropout_keep(seed, rows[:, None], cols[None, :], i_bh, dropout_p)  # [BLOCK_M, BLOCK_N]
    o = i_bh * BLOCK_M * BLOCK_N + tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    tl.store(Uniform + o, tl.random.uint_to_uniform_float(word))
    tl.store(Keep + o, keep.to(tl.int8))


# seeds below and above 2^31 and 2^32 (the key's second word), each with its own dropout_p
SEEDS = [(0, 0.5), (12345, 0.1), (2**31 + 5, 0.83), (2**32 + 7, 0.3), (2**62 + 3, 0.5)]


@pytest.mark.parametrize("seed, dropout_p", SEEDS, ids=lambda s: f"{s}")
def test_dropout_mask_is_bit_identical_to_triton_philox(seed, dropout_p):
    batch, nheads, row_start, col_start, block_m, block_n = 2, 2, 37, 100, 16, 32
    uniform = torch.empty(batch, nheads, block_m, block_n, device=DEVICE)
    keep = torch.empty(batch, nheads, block_m, block_n, dtype=torch.int8, device=DEVICE)
    _dropout_draw_kernel[(batch * nheads,)](uniform, keep, seed, dropout_p, row_start, col_start, nheads,
                                            BLOCK_M=block_m, BLOCK_N=block_n)
    rows = torch.arange(row_start, row_start + block_m)
    cols = torch.arange(col_start, col_start + block_n)
    seq_head = torch.arange(batch * nheads).view(batch, nheads, 1, 1)
    assert torch.equal(ref.philox_uniform(seed, seq_head, rows, cols), uniform.cpu())
    whole = ref.dropout_keep_mask(seed, batch, nheads, row_start + block_m, col_start + block_n, dropout_p)
    assert torch.equal(whole[..., row_start:, col_start:], keep.cpu().bool())


@pytest.mark.parametrize("dropout_p", [0.1, 0.5, 0.9])
def test_dropout_keeps_a_fraction_one_minus_p(dropout_p):
    keep = ref.dropout_keep_mask(7, 1, 2, 64, 256, dropout_p)
    n = keep.numel()
    # binomial: |kept/n − (1 − p)| ≤ 6 standard deviations
    assert abs(keep.float().mean().item() - (1 - dropout_p)) <= 6 * math.sqrt(dropout_p * (1 - dropout_p) / n)
    other = ref.dropout_keep_mask(8, 1, 2, 64, 256, dropout_p)
    assert not torch.equal(keep, other)  # another seed, another mask


# ----------------------------------------------------------------------------------------------
# Standard attention: the written-out backward and the tiled algorithm


def _inputs(seed, b=2, hq=4, hk=2, nq=37, nk=53, d=24):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, nq, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, hk, nk, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, hk, nk, d, generator=g, dtype=torch.float64)
    do = torch.randn(b, hq, nq, d, generator=g, dtype=torch.float64)
    return q, k, v, do


def _variant(name, q, k):
    """Keyword options of one variant for q [B, Hq, Nq, D], k [B, Hk, Nk, D]."""
    batch, nheads, seqlen_q = q.shape[:3]
    seqlen_k = k.shape[2]
    g = torch.Generator().manual_seed(11)
    if name == "plain":
        return {}
    if name == "window":
        return dict(window_size=(9, 4))
    if name == "window-left":
        return dict(window_size=(5, -1))
    if name == "softcap":
        return dict(softcap=2.5, softmax_scale=0.6)  # scores large enough that tanh bends
    if name == "alibi":
        return dict(alibi_slopes=torch.rand(nheads, generator=g).float())
    if name == "alibi-per-batch":
        return dict(alibi_slopes=torch.rand(batch, nheads, generator=g).float())
    if name == "bias":
        return dict(attn_bias=torch.randn(batch, nheads, seqlen_q, seqlen_k, generator=g, dtype=torch.float64))
    if name == "bias-broadcast":  # per batch entry and key, broadcast over heads and queries
        return dict(attn_bias=torch.randn(batch, 1, 1, seqlen_k, generator=g, dtype=torch.float64))
    if name == "bias-2d":
        return dict(attn_bias=torch.randn(seqlen_q, seqlen_k, generator=g, dtype=torch.float64))
    if name == "bool-mask":
        return dict(attn_bias=torch.rand(batch, 1, seqlen_q, seqlen_k, generator=g) > 0.3)
    if name == "dropout":
        return dict(dropout_p=0.3, dropout_seed=2**33 + 5)
    if name == "all":
        return dict(window_size=(20, 3), softcap=3.0, alibi_slopes=torch.rand(nheads, generator=g).float(),
                    attn_bias=torch.randn(nheads, seqlen_q, seqlen_k, generator=g, dtype=torch.float64),
                    dropout_p=0.2, dropout_seed=99)
    raise ValueError(name)


VARIANTS = ["plain", "window", "window-left", "softcap", "alibi", "alibi-per-batch", "bias", "bias-broadcast",
            "bias-2d", "bool-mask", "dropout", "all"]


def _autograd_reference(q, k, v, do, causal, options):
    """(out, lse, dq, dk, dv, dbias) by autograd through attention_forward."""
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    bias = options.get("attn_bias")
    inputs = [q, k, v]
    if bias is not None and bias.dtype != torch.bool:
        bias = bias.clone().requires_grad_()
        options = {**options, "attn_bias": bias}
        inputs.append(bias)
    out, lse, _ = ref.attention_forward(q, k, v, causal=causal, **options)
    grads = torch.autograd.grad(out, inputs, do)
    return out.detach(), lse.detach(), *grads[:3], grads[3] if len(grads) == 4 else None


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_standard_backward_formulas_match_autograd(variant, causal):
    q, k, v, do = _inputs(3)
    options = _variant(variant, q, k)
    *_, dq, dk, dv, dbias = _autograd_reference(q, k, v, do, causal, options)
    got = ref.attention_backward(q, k, v, do, causal=causal, **options)
    for name, e, g in zip(("dq", "dk", "dv", "dbias"), (dq, dk, dv, dbias), got):
        if e is None:
            assert g is None, name
            continue
        assert g.shape == e.shape, name
        torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-12, msg=name)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_rowsum_dp_p_equals_rowsum_do_o(causal):
    q, k, v, do = _inputs(2)
    out, _, p = ref.attention_forward(q, k, v, causal=causal)
    dp = do @ v.repeat_interleave(2, dim=1).transpose(-1, -2)
    torch.testing.assert_close((dp * p).sum(-1), (do * out).sum(-1), rtol=1e-12, atol=1e-12)


def _assert_tiled_equals_standard(q, k, v, do, causal, options, block_m, block_n):
    out, lse, dq, dk, dv, dbias = _autograd_reference(q, k, v, do, causal, options)
    t_out, t_lse = ref.tiled_attention_forward(q, k, v, causal=causal, block_m=block_m, block_n=block_n, **options)
    t_grads = ref.tiled_attention_backward(q, k, v, t_out, t_lse, do, causal=causal, block_m=block_m,
                                           block_n=block_n, **options)
    torch.testing.assert_close(t_out, out, rtol=0, atol=1e-12)
    assert torch.equal(torch.isneginf(t_lse), torch.isneginf(lse))
    torch.testing.assert_close(t_lse, lse, rtol=0, atol=1e-12)
    for name, e, g in zip(("dq", "dk", "dv", "dbias"), (dq, dk, dv, dbias), t_grads):
        if e is None:
            assert g is None, name
            continue
        assert g.shape == e.shape and g.dtype == e.dtype, name
        torch.testing.assert_close(g, e, rtol=0, atol=1e-12, msg=name)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seqlens", [(37, 53), (53, 37), (1, 16)], ids=lambda s: f"q{s[0]}-k{s[1]}")
@pytest.mark.parametrize("variant", VARIANTS)
def test_tiled_equals_standard_in_float64(variant, seqlens, causal):
    # GQA 4:2 throughout; small blocks so that every loop runs several ragged iterations
    q, k, v, do = _inputs(4, nq=seqlens[0], nk=seqlens[1])
    _assert_tiled_equals_standard(q, k, v, do, causal, _variant(variant, q, k), block_m=8, block_n=16)


@pytest.mark.parametrize("window", [(0, 0), (2, 1), (100, 100), (3, 0), (0, 40)], ids=lambda w: f"w{w[0]}_{w[1]}")
def test_tiled_window_edge_cases(window):
    # windows narrower than a block, wider than the sequence, and ones that leave rows empty (Nq > Nk)
    q, k, v, do = _inputs(5, nq=45, nk=20)
    for causal in (False, True):
        _assert_tiled_equals_standard(q, k, v, do, causal, dict(window_size=window), block_m=16, block_n=8)


def test_dropout_leaves_lse_and_p_undropped_and_scales_kept_entries():
    q, k, v, _ = _inputs(6)
    seed, dropout_p = 2**40 + 1, 0.25
    out, lse, p = ref.attention_forward(q, k, v, dropout_p=dropout_p, dropout_seed=seed)
    out0, lse0, p0 = ref.attention_forward(q, k, v)
    assert torch.equal(lse, lse0) and torch.equal(p, p0)
    keep = ref.dropout_keep_mask(seed, *q.shape[:3], k.shape[2], dropout_p)
    expected = (p0 * keep / (1 - dropout_p)) @ v.repeat_interleave(2, dim=1)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)


def test_fully_masked_rows_give_zero_and_neg_inf():
    q, k, v, _ = _inputs(5, nq=6, nk=3)  # causal, bottom-right: rows 0..2 see no key
    for out, lse in (ref.attention_forward(q, k, v, causal=True)[:2],
                     ref.tiled_attention_forward(q, k, v, causal=True, block_m=4, block_n=2)):
        assert (out[:, :, :3] == 0).all() and torch.isneginf(lse[:, :, :3]).all()
        assert torch.isfinite(out).all() and torch.isfinite(lse[:, :, 3:]).all()


def test_rows_masked_by_the_bias_have_finite_gradients():
    # a float bias of -inf on a whole row (an SDPA padding mask) and a bool mask with an empty row
    q, k, v, do = _inputs(7, nq=10, nk=12)
    bias = torch.zeros(10, 12, dtype=torch.float64)
    bias[3] = -math.inf
    mask = torch.ones(10, 12, dtype=torch.bool)
    mask[5] = False
    for attn_bias, empty_row in ((bias, 3), (mask, 5)):
        out, lse, dq, dk, dv, dbias = _autograd_reference(q, k, v, do, False, dict(attn_bias=attn_bias))
        assert (out[:, :, empty_row] == 0).all() and torch.isneginf(lse[:, :, empty_row]).all()
        for grad in (dq, dk, dv) + ((dbias,) if dbias is not None else ()):
            assert torch.isfinite(grad).all()
        _assert_tiled_equals_standard(q, k, v, do, False, dict(attn_bias=attn_bias), block_m=4, block_n=8)


def test_reference_refuses_bad_options():
    q, k, v, _ = _inputs(8, nq=4, nk=4)
    with pytest.raises(ValueError, match="dropout_p must be in"):
        ref.attention_forward(q, k, v, dropout_p=1.0, dropout_seed=0)
    with pytest.raises(ValueError, match="dropout_seed"):
        ref.tiled_attention_forward(q, k, v, dropout_p=0.5)
    with pytest.raises(ValueError, match="softcap"):
        ref.attention_forward(q, k, v, softcap=-1.0)


# ----------------------------------------------------------------------------------------------
# Variable-length batches


def _packed(seed, seqlens_q, seqlens_k, hq=4, hk=2, d=16):
    g = torch.Generator().manual_seed(seed)
    total_q, total_k = sum(seqlens_q), sum(seqlens_k)
    q = torch.randn(total_q, hq, d, generator=g, dtype=torch.float64)
    k = torch.randn(total_k, hk, d, generator=g, dtype=torch.float64)
    v = torch.randn(total_k, hk, d, generator=g, dtype=torch.float64)
    do = torch.randn(total_q, hq, d, generator=g, dtype=torch.float64)
    cu_q = torch.tensor([0] + seqlens_q, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    cu_k = torch.tensor([0] + seqlens_k, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return q, k, v, do, cu_q, cu_k


SEQLENS_Q = [5, 0, 1, 40, 3]
SEQLENS_K = [7, 4, 1, 33, 0]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_varlen_is_attention_on_the_packed_sequence_with_a_block_diagonal_mask(causal):
    q, k, v, _, cu_q, cu_k = _packed(9, SEQLENS_Q, SEQLENS_K)
    window = (6, 2)
    out, lse = ref.varlen_attention_forward(q, k, v, cu_q, cu_k, causal=causal, window_size=window)
    # the same as one sequence of all tokens in which query i may attend key j iff both are in one
    # sequence and j is visible from i by the rule applied within that sequence
    mask = torch.zeros(len(q), len(k), dtype=torch.bool)
    for i in range(len(SEQLENS_Q)):
        rows, cols = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
        mask[rows, cols] = ref.visible_mask(SEQLENS_Q[i], SEQLENS_K[i], causal, window)
    whole_out, whole_lse, _ = ref.attention_forward(*(t.transpose(0, 1)[None] for t in (q, k, v)), attn_bias=mask)
    torch.testing.assert_close(out, whole_out[0].transpose(0, 1), rtol=0, atol=1e-12)
    torch.testing.assert_close(lse, whole_lse[0], rtol=0, atol=1e-12)
    assert lse.shape == (q.shape[1], len(q))


def test_varlen_dropout_counts_the_sequence_as_the_batch_index():
    seqlens = [6, 9, 4]
    q, k, v, _, cu_q, cu_k = _packed(10, seqlens, seqlens)
    seed, dropout_p = 1234, 0.4
    out, _ = ref.varlen_attention_forward(q, k, v, cu_q, cu_k, dropout_p=dropout_p, dropout_seed=seed)
    keep = ref.dropout_keep_mask(seed, len(seqlens), q.shape[1], max(seqlens), max(seqlens), dropout_p)
    for i, n in enumerate(seqlens):
        q_i, k_i, v_i = (t[cu_q[i]:cu_q[i + 1]].transpose(0, 1)[None] for t in (q, k, v))
        _, _, p = ref.attention_forward(q_i, k_i, v_i)
        expected = (p * keep[i, :, :n, :n] / (1 - dropout_p)) @ v_i.repeat_interleave(2, dim=1)
        torch.testing.assert_close(out[cu_q[i]:cu_q[i + 1]], expected[0].transpose(0, 1), rtol=0, atol=1e-12)


VARLEN_VARIANTS = {
    "plain": {},
    "window": dict(window_size=(4, 1)),
    "softcap-alibi": dict(softcap=2.0, softmax_scale=0.7, alibi_slopes=torch.tensor([0.5, 0.25, 0.125, 0.0625])),
    "alibi-per-sequence": dict(alibi_slopes=torch.rand(5, 4, generator=torch.Generator().manual_seed(0))),
    "dropout": dict(dropout_p=0.3, dropout_seed=77),
}


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("variant", VARLEN_VARIANTS)
def test_tiled_varlen_equals_standard_varlen(variant, causal):
    q, k, v, do, cu_q, cu_k = _packed(11, SEQLENS_Q, SEQLENS_K)
    options = VARLEN_VARIANTS[variant]
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    out, lse = ref.varlen_attention_forward(qr, kr, vr, cu_q, cu_k, causal=causal, **options)
    grads = torch.autograd.grad(out, (qr, kr, vr), do)
    t_out, t_lse = ref.tiled_varlen_attention_forward(q, k, v, cu_q, cu_k, causal=causal, block_m=16, block_n=8,
                                                      **options)
    t_grads = ref.tiled_varlen_attention_backward(q, k, v, t_out, t_lse, do, cu_q, cu_k, causal=causal,
                                                  block_m=16, block_n=8, **options)
    torch.testing.assert_close(t_out, out, rtol=0, atol=1e-12)
    torch.testing.assert_close(t_lse, lse, rtol=0, atol=1e-12)
    for name, e, g in zip(("dq", "dk", "dv"), grads, t_grads):
        torch.testing.assert_close(g, e, rtol=0, atol=1e-12, msg=name)
