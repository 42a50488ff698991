"""The Gluon kernels for sm_90 (flashtile.gluon.sm90_fwd, sm90_bwd) against the float64 reference, and the
rules that decide when the launcher takes them.

Gluon has no interpreter: the accuracy tests run on an sm_90 GPU only (the H200 here) and are
skipped elsewhere; the dispatch rule is tested everywhere.
"""

import pytest
import torch
from helpers import DEVICE, assert_accurate, check_flash_attn_func, make_inputs, references

import flashtile
from flashtile._options import AttentionOptions, AttentionTensors
from flashtile import gluon
from flashtile.gluon import sm90_bwd, sm90_fwd
from flashtile.triton import configs, launch

on_sm90 = pytest.mark.skipif(
    DEVICE != "cuda" or torch.cuda.get_device_capability() != (9, 0),
    reason="the Gluon kernel needs an sm_90 GPU (Gluon has no interpreter)",
)


@pytest.fixture
def gluon_calls(monkeypatch):
    """Send every shape the Gluon kernel supports to it (the launcher's own thresholds are
    performance policy, far beyond these shapes), and count the calls."""
    monkeypatch.setattr(configs, "GLUON_MIN_SEQLEN", {key: 1 for key in configs.GLUON_MIN_SEQLEN})
    calls = []
    forward = sm90_fwd.record_forward

    def counted(plan, q, *args, **kwargs):  # recordings: the tests' fixtures start each test without plans
        calls.append(q.shape)
        return forward(plan, q, *args, **kwargs)

    monkeypatch.setattr(sm90_fwd, "record_forward", counted)
    return calls


@pytest.fixture
def gluon_backward_calls(monkeypatch):
    """Count the calls of the fused Gluon backward (it has no seqlen threshold)."""
    calls = []
    backward = sm90_bwd.record_backward

    def counted(plan, dout, q, *args, **kwargs):  # recordings, as above
        calls.append(q.shape)
        return backward(plan, dout, q, *args, **kwargs)

    monkeypatch.setattr(sm90_bwd, "record_backward", counted)
    return calls


@pytest.fixture
def wide_backward_calls(monkeypatch, gluon_backward_calls):
    """Send head dims 192 and 256 to the fused backward's wide schedule too, which the launcher does not route
    until it has run on a GPU (``sm90_bwd.ROUTED_HEAD_DIMS``), and count the fused backward's calls."""
    monkeypatch.setattr(sm90_bwd, "ROUTED_HEAD_DIMS", (64, 128, 192, 256))
    return gluon_backward_calls


SEQLENS = [(1, 1), (1, 300), (17, 113), (113, 17), (203, 203), (300, 1000)]


@on_sm90
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seqlens", SEQLENS,
                         ids=lambda s: f"q{s[0]}-k{s[1]}")
@pytest.mark.parametrize("head_dim", [64, 128, 192, 256], ids=lambda d: f"d{d}")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_gluon_forward(gluon_calls, dtype, head_dim, seqlens, causal):
    check_flash_attn_func(*make_inputs(2, *seqlens, 4, 4, head_dim, dtype, seed=11), causal=causal)
    assert gluon_calls


@on_sm90
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seqlens", SEQLENS + [(64, 64), (128, 1000), (1000, 128)], ids=lambda s: f"q{s[0]}-k{s[1]}")
@pytest.mark.parametrize("head_dim", [64, 128], ids=lambda d: f"d{d}")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_gluon_backward(gluon_backward_calls, dtype, head_dim, seqlens, causal):
    # seqlens at and across the 64-row and 128-key block edges, and Nq ≠ Nk both ways
    check_flash_attn_func(*make_inputs(2, *seqlens, 4, 4, head_dim, dtype, seed=21), causal=causal)
    assert gluon_backward_calls


@on_sm90
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seqlens", SEQLENS + [(64, 64), (65, 65), (128, 1000), (1000, 128)],
                         ids=lambda s: f"q{s[0]}-k{s[1]}")
@pytest.mark.parametrize("head_dim", [192, 256], ids=lambda d: f"d{d}")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_gluon_backward_wide(wide_backward_calls, dtype, head_dim, seqlens, causal):
    # the wide schedule: 64-key CTAs whose warpgroups split the keys for S and dP (32 each) and the head dim for dK,
    # dV and dQ; seqlens at and across the 64-row and 64-key block edges, Nq ≠ Nk both ways, one key (dq and dk
    # exactly 0 only if its D and dP round alike), and 192 in 256-wide tiles whose last 64 columns are zeros
    check_flash_attn_func(*make_inputs(2, *seqlens, 4, 4, head_dim, dtype, seed=24), causal=causal)
    assert wide_backward_calls


@on_sm90
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("heads", [(6, 2), (4, 1), (8, 1)], ids=["gqa-6:2", "mqa-4:1", "mqa-8:1"])
@pytest.mark.parametrize("head_dim", [64, 128, 192, 256], ids=lambda d: f"d{d}")
def test_gluon_backward_gqa(wide_backward_calls, head_dim, heads, causal):
    # dK/dV summed over the group inside one CTA
    check_flash_attn_func(*make_inputs(2, 130, 257, *heads, head_dim, torch.bfloat16, seed=22), causal=causal)
    assert wide_backward_calls


@on_sm90
@pytest.mark.parametrize("head_dim", [128, 256], ids=lambda d: f"d{d}")
def test_gluon_backward_fully_masked_rows(wide_backward_calls, head_dim):
    # causal with seqlen_q > seqlen_k: the first 170 rows see no key (LSE −inf), so their dQ is 0
    q, k, v, do = make_inputs(1, 200, 30, 2, 2, head_dim, torch.bfloat16, seed=23)
    out = flashtile.flash_attn_func(q, k, v, causal=True)
    dq, _, _ = torch.autograd.grad(out, (q, k, v), do)
    assert wide_backward_calls
    assert (dq[:, :170] == 0).all()
    check_flash_attn_func(q, k, v, do, causal=True)


@on_sm90
def test_gluon_backward_strided_inputs(gluon_backward_calls):
    # q, k, v as views into one (batch, seqlen, 3, nheads, headdim) tensor, and their gradient too
    g = torch.Generator().manual_seed(24)
    qkv = torch.randn(2, 150, 3, 4, 64, generator=g).to(DEVICE, torch.bfloat16).requires_grad_()
    do = torch.randn(2, 150, 4, 64, generator=g).to(DEVICE, torch.bfloat16)
    out = flashtile.flash_attn_qkvpacked_func(qkv, causal=True)
    (dqkv, ) = torch.autograd.grad(out, (qkv, ), do)
    assert gluon_backward_calls
    q, k, v = (t.detach().requires_grad_() for t in qkv.detach().unbind(2))
    reference = torch.autograd.grad(flashtile.flash_attn_func(q, k, v, causal=True, deterministic=True), (q, k, v), do)
    for got, expected in zip(dqkv.unbind(2), reference):
        torch.testing.assert_close(got, expected, atol=2e-2, rtol=0)  # two summation orders of the same bf16 terms


@on_sm90
def test_deterministic_takes_the_backward_without_atomics(gluon_backward_calls):
    q, k, v, do = make_inputs(2, 300, 300, 4, 2, 128, torch.bfloat16, seed=25)
    runs = [torch.autograd.grad(flashtile.flash_attn_func(q, k, v, causal=True, deterministic=True), (q, k, v), do)
            for _ in range(3)]
    assert not gluon_backward_calls
    for again in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], again))
    torch.use_deterministic_algorithms(True)
    try:
        torch.autograd.grad(flashtile.flash_attn_func(q, k, v, causal=True), (q, k, v), do)
    finally:
        torch.use_deterministic_algorithms(False)
    assert not gluon_backward_calls
    torch.autograd.grad(flashtile.flash_attn_func(q, k, v, causal=True), (q, k, v), do)
    assert gluon_backward_calls


@on_sm90
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seqlens", [(17, 113), (203, 203), (300, 100)], ids=lambda s: f"q{s[0]}-k{s[1]}")
@pytest.mark.parametrize("head_dim", [64, 128, 192, 256], ids=lambda d: f"d{d}")
def test_gluon_forward_with_sink(gluon_calls, gluon_backward_calls, head_dim, seqlens, causal):
    # logits that dominate a row (8), vanish (−30) or sit among the scores; causal q300-k100: rows that
    # see no key give 0 and LSE = sink. The fused backward (head dims 64 and 128; the Triton one beyond) takes the
    # LSE, sink included.
    q, k, v, do = make_inputs(2, *seqlens, 4, 2, head_dim, torch.bfloat16, seed=9)
    sink = torch.tensor([8.0, -30.0, 0.5, -1.0], device=DEVICE, requires_grad=True)
    out, lse, _ = flashtile.flash_attn_func(q, k, v, causal=causal, learnable_sink=sink, return_attn_probs=True)
    grads = torch.autograd.grad(out, (q, k, v, sink), do)
    assert gluon_calls and bool(gluon_backward_calls) == (head_dim <= 128)
    ref64, ref_lowp = references(q, k, v, do, causal=causal, learnable_sink=sink)
    assert_accurate("out", out, ref64[0], ref_lowp[0], factor=2)
    torch.testing.assert_close(lse.double(), ref64[1], rtol=0, atol=1e-5)
    for name, got, r64, rlow in zip(("dq", "dk", "dv", "dsink"), grads, ref64[2:], ref_lowp[2:]):
        assert_accurate(name, got, r64, rlow, factor=3)


@on_sm90
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("heads", [(6, 2), (4, 1)], ids=["gqa-6:2", "mqa-4:1"])
@pytest.mark.parametrize("head_dim", [128, 192], ids=lambda d: f"d{d}")
def test_gluon_forward_gqa(gluon_calls, head_dim, heads, causal):
    check_flash_attn_func(*make_inputs(2, 130, 257, *heads, head_dim, torch.bfloat16, seed=12), causal=causal)
    assert gluon_calls


@on_sm90
def test_gluon_forward_fully_masked_rows(gluon_calls):
    # causal with seqlen_q > seqlen_k: the first 170 rows see no key, across a 128-row block edge
    q, k, v, do = make_inputs(1, 200, 30, 2, 2, 64, torch.bfloat16, seed=13)
    out, lse, _ = flashtile.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert gluon_calls
    assert (out[:, :170] == 0).all() and torch.isneginf(lse[:, :, :170]).all()
    check_flash_attn_func(q, k, v, do, causal=True)


@on_sm90
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seqlens", [(1000, 1000), (1000, 300), (300, 1000)], ids=lambda s: f"q{s[0]}-k{s[1]}")
@pytest.mark.parametrize("head_dim", [64, 128], ids=lambda d: f"d{d}")
@pytest.mark.parametrize("sink", [False, True], ids=["no-sink", "sink"])
def test_gluon_forward_runs_many_tiles_per_cta(monkeypatch, gluon_calls, head_dim, seqlens, causal, sink):
    # a persistent grid of 3 CTAs, causal ones included: each walks tens of tiles of every length (causal
    # q1000-k300: tiles that see no key between ones that do), its K/V ring, Q and O buffers and barriers'
    # phases running on across them; the backward takes the forward's LSE
    monkeypatch.setattr(sm90_fwd, "persistent", lambda seqlen_k, head_dim: True)
    monkeypatch.setattr(sm90_fwd, "programs", lambda tiles, device: min(tiles, 3))
    q, k, v, do = make_inputs(3, *seqlens, 16, 4, head_dim, torch.bfloat16, seed=16)
    learnable_sink = torch.linspace(-4.0, 4.0, 16, device=DEVICE).requires_grad_() if sink else None
    out, lse, _ = flashtile.flash_attn_func(q, k, v, causal=causal, learnable_sink=learnable_sink,
                                            return_attn_probs=True)
    inputs = (q, k, v) if learnable_sink is None else (q, k, v, learnable_sink)
    grads = torch.autograd.grad(out, inputs, do)
    assert gluon_calls
    ref64, ref_lowp = references(q, k, v, do, causal=causal, learnable_sink=learnable_sink)
    assert_accurate("out", out, ref64[0], ref_lowp[0], factor=2)
    torch.testing.assert_close(lse.double(), ref64[1], rtol=0, atol=1e-5)
    for name, got, r64, rlow in zip(("dq", "dk", "dv", "dsink"), grads, ref64[2:], ref_lowp[2:]):
        assert_accurate(name, got, r64, rlow, factor=3)


@on_sm90
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seqlens", [(1000, 1000), (300, 1000), (1000, 300)], ids=lambda s: f"q{s[0]}-k{s[1]}")
@pytest.mark.parametrize("head_dim", [64, 128], ids=lambda d: f"d{d}")
def test_gluon_forward_one_tile_per_cta(monkeypatch, gluon_calls, head_dim, seqlens, causal):
    # the grid of long sequences (a CTA per tile; three consumers at head dim 64) on short ones, which
    # otherwise run the persistent grid with two
    monkeypatch.setattr(sm90_fwd, "persistent", lambda seqlen_k, head_dim: False)
    check_flash_attn_func(*make_inputs(2, *seqlens, 4, 4, head_dim, torch.bfloat16, seed=17), causal=causal)
    assert gluon_calls


@on_sm90
def test_gluon_forward_strided_inputs(gluon_calls):
    # q, k, v as views into one (batch, seqlen, 3, nheads, headdim) tensor
    g = torch.Generator().manual_seed(14)
    qkv = torch.randn(2, 150, 3, 4, 64, generator=g).to(DEVICE, torch.bfloat16)
    q, k, v = (t.requires_grad_() for t in qkv.unbind(2))
    do = torch.randn(2, 150, 4, 64, generator=g).to(DEVICE, torch.bfloat16)
    check_flash_attn_func(q, k, v, do, causal=True)
    assert gluon_calls


@on_sm90
@pytest.mark.parametrize("scale", [0.0, -0.2], ids=["scale0", "scale-neg"])
def test_non_positive_scale_stays_off_the_gluon_path(gluon_calls, scale):
    # masked scores are -inf before the scale: times 0 or a negative scale they would give NaN there
    check_flash_attn_func(*make_inputs(2, 113, 130, 4, 4, 128, torch.bfloat16, seed=15), causal=True,
                          softmax_scale=scale)
    assert not gluon_calls


def test_gluon_only_where_it_applies(monkeypatch):
    monkeypatch.setattr(launch, "_is_sm90", lambda device: True)
    long = 4096
    full, causal = AttentionOptions(0.1), AttentionOptions(0.1, window_right=0)

    def usable(head_dim=128, seqlen=long, dtype=torch.bfloat16, options=full, tensors=AttentionTensors(),
               k_seqlen=None):
        q = torch.randn(1, seqlen, 2, head_dim).to(dtype)
        k = torch.randn(1, k_seqlen or seqlen, 2, head_dim).to(dtype)
        return launch.gluon_usable(options, tensors, q, k, k)

    assert usable() and usable(dtype=torch.float16) and usable(head_dim=64)
    assert usable(options=causal) and usable(head_dim=64, seqlen=512, options=causal)
    assert not usable(head_dim=64, seqlen=512, k_seqlen=511, options=causal)  # below its threshold
    # at head dim 64 keys beyond the persistent grid take a CTA per tile, which has thresholds of its own
    assert usable(head_dim=64, seqlen=2048, k_seqlen=4096) and not usable(head_dim=64, seqlen=1024, k_seqlen=4096)
    assert usable(head_dim=64, seqlen=4096, k_seqlen=8192, options=causal)
    assert not usable(head_dim=64, seqlen=1024, k_seqlen=8192, options=causal)
    assert not usable(head_dim=96) and not usable(dtype=torch.float32)
    # 192 in 256-wide tiles, and 256, on a CTA per tile; other head dims past 128 keep the Triton forward
    assert usable(head_dim=192, seqlen=1024) and usable(head_dim=256, seqlen=1024, options=causal)
    assert not usable(head_dim=160) and not usable(head_dim=224)
    assert not sm90_fwd.persistent(1024, 192) and not sm90_fwd.persistent(1024, 256)
    assert sm90_fwd.persistent(1024, 128)
    # the kernel masks before it scales
    assert not usable(options=AttentionOptions(0.0)) and not usable(options=AttentionOptions(-0.1))
    for options in (AttentionOptions(0.1, 16, 0), AttentionOptions(0.1, softcap=30.0),
                    AttentionOptions(0.1, dropout_p=0.1)):
        assert not usable(options=options), options
    for tensors in (AttentionTensors(alibi_slopes=torch.ones(2)), AttentionTensors(attn_bias=torch.zeros(1, 1, 1, 1))):
        assert not usable(tensors=tensors), tensors
    assert usable(tensors=AttentionTensors(learnable_sink=torch.zeros(2)))  # folded in at the epilogue
    q = torch.randn(1, 8, 2, 128).to(torch.bfloat16)
    assert not launch.gluon_usable(full, AttentionTensors(), q, q[:, :, :1].expand(1, 8, 2, 128), q)  # head stride 0
    assert not launch.gluon_usable(full, AttentionTensors(), q, q, q[..., :64].contiguous())  # v's head dim (MLA)
    mla = torch.randn(1, 1024, 2, 192).to(torch.bfloat16)
    assert not launch.gluon_usable(full, AttentionTensors(), mla, mla, mla[..., :128].contiguous())
    monkeypatch.setattr(launch, "_is_sm90", lambda device: False)
    assert not usable()


def test_gluon_only_with_the_triton_it_is_written_for(monkeypatch):
    # Gluon's API changes between Triton releases: another series runs the Triton kernels
    assert gluon.written_for("3.6.0") and gluon.written_for("3.6.1")
    assert not gluon.written_for("3.5.1") and not gluon.written_for("3.7.0")
    monkeypatch.setattr(launch, "_is_sm90", lambda device: True)
    monkeypatch.setattr(launch, "sm90_fwd", None)  # what the launcher holds under another series
    q = torch.randn(1, 4096, 2, 128).to(torch.bfloat16)
    assert not launch.gluon_usable(AttentionOptions(0.1), AttentionTensors(), q, q, q)


def test_gluon_backward_only_where_it_applies(monkeypatch):
    monkeypatch.setattr(launch, "_is_sm90", lambda device: True)
    full, causal = AttentionOptions(0.1), AttentionOptions(0.1, window_right=0)

    def usable(head_dim=128, dtype=torch.bfloat16, options=full, tensors=AttentionTensors(), seqlens=(70, 70)):
        q = torch.randn(1, seqlens[0], 2, head_dim).to(dtype)
        k = torch.randn(1, seqlens[1], 2, head_dim).to(dtype)
        return launch.gluon_backward_usable(options, tensors, q, k, k, q, q, q, k, k)

    assert usable() and usable(dtype=torch.float16) and usable(head_dim=64) and usable(options=causal)
    assert usable(seqlens=(1, 1)) and usable(seqlens=(300, 7))  # no seqlen threshold
    assert not usable(options=AttentionOptions(0.1, deterministic=True))
    assert not usable(head_dim=96) and not usable(head_dim=256) and not usable(dtype=torch.float32)
    with monkeypatch.context() as routed:  # the wide schedule, once routed: 192 and 256, nothing between
        routed.setattr(sm90_bwd, "ROUTED_HEAD_DIMS", (64, 128, 192, 256))
        assert usable(head_dim=192) and usable(head_dim=256, options=causal)
        assert not usable(head_dim=96) and not usable(head_dim=160) and not usable(head_dim=224)
    for options in (AttentionOptions(0.1, 16, 0), AttentionOptions(0.1, softcap=30.0),
                    AttentionOptions(0.1, dropout_p=0.1)):
        assert not usable(options=options), options
    for tensors in (AttentionTensors(alibi_slopes=torch.ones(2)), AttentionTensors(attn_bias=torch.zeros(1, 1, 1, 1))):
        assert not usable(tensors=tensors), tensors
    q = torch.randn(1, 8, 2, 128).to(torch.bfloat16)
    every_other = torch.empty(1, 8, 2, 256, dtype=torch.bfloat16)[..., ::2]
    assert not launch.gluon_backward_usable(full, AttentionTensors(), q, q, q, q, q, q, every_other, q)  # dk's head dim
    v64 = q[..., :64].contiguous()  # v's head dim unlike q's (MLA)
    assert not launch.gluon_backward_usable(full, AttentionTensors(), q, q, v64, v64, v64, q, q, v64)
    monkeypatch.setattr(launch, "sm90_bwd", None)  # what the launcher holds under another Triton series
    assert not usable()
    monkeypatch.undo()
    assert not usable()  # not an sm_90 GPU
