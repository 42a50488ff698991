"""torch.compile sees through flashtile: the ops are custom ops with fake implementations.

``fullgraph=True`` turns any graph break into an error, so these tests fail on a break.
One small model per entry point; compiling takes seconds on the CPU, so the grid is small.
"""

import pytest
import torch
from helpers import DEVICE

import flashtile
from flashtile._options import AttentionOptions, AttentionTensors


class TinyAttention(torch.nn.Module):
    """A projection, flashtile attention (GQA 4:2, causal) and an output projection."""

    def __init__(self, dim=64, nheads=4, nheads_k=2, varlen=False):
        super().__init__()
        self.nheads, self.nheads_k, self.head_dim = nheads, nheads_k, dim // nheads
        self.qkv = torch.nn.Linear(dim, (nheads + 2 * nheads_k) * self.head_dim)
        self.out = torch.nn.Linear(dim, dim)
        self.varlen = varlen

    def forward(self, x, cu_seqlens=None, max_seqlen=0):
        shape = x.shape[:-1]
        q, k, v = self.qkv(x).split(
            [self.nheads * self.head_dim, self.nheads_k * self.head_dim, self.nheads_k * self.head_dim], dim=-1)
        q = q.unflatten(-1, (self.nheads, self.head_dim))  # [..., seqlen, nheads, head_dim]
        k = k.unflatten(-1, (self.nheads_k, self.head_dim))
        v = v.unflatten(-1, (self.nheads_k, self.head_dim))
        if self.varlen:
            o = flashtile.flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                                 causal=True)
        else:
            o = flashtile.flash_attn_func(q, k, v, causal=True, window_size=(8, 0), softcap=5.0)
        return self.out(o.reshape(*shape, -1))


def run_step(model, x, *args):
    loss = model(x, *args).square().mean()
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("varlen", [False, True], ids=["batched", "varlen"])
def test_compile_fullgraph_forward_backward(backend, varlen):
    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = TinyAttention(varlen=varlen).to(DEVICE)
    compiled = TinyAttention(varlen=varlen).to(DEVICE)
    compiled.load_state_dict(eager.state_dict())
    if varlen:
        x = torch.randn(37, 64, device=DEVICE)
        args = (torch.tensor([0, 5, 5, 30, 37], dtype=torch.int32, device=DEVICE), 25)
    else:
        x = torch.randn(2, 37, 64, device=DEVICE)
        args = ()
    loss, grads = run_step(eager, x, *args)
    compiled_model = torch.compile(compiled, fullgraph=True, backend=backend)
    # the strict check: every operator in the graph must be tagged PT2-compliant, as custom ops are
    with torch._dynamo.config.patch(only_allow_pt2_compliant_ops=True):
        compiled_loss, compiled_grads = run_step(compiled_model, x, *args)
    torch.testing.assert_close(compiled_loss, loss, rtol=1e-5, atol=1e-6)
    for got, expected in zip(compiled_grads, grads):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-6)


@pytest.mark.skipif(DEVICE != "cpu", reason="the CPU path")
@pytest.mark.parametrize("heads, causal", [((4, 2), False), ((4, 4), True)], ids=["gqa-full", "mha-causal"])
def test_compile_fullgraph_on_the_cpu_path(monkeypatch, heads, causal):
    # calls that PyTorch's fused CPU kernel computes (the suite's other compile tests run the Triton kernels in
    # the interpreter): its results keep the strides that the operators' fake implementations declare, which
    # inductor asserts (the GQA fold's output and the kernel's log-sum-exp were strided views)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 9, heads[0], 16, generator=g).requires_grad_()
    k, v = (torch.randn(2, 9, heads[1], 16, generator=g).requires_grad_() for _ in range(2))

    def attention(q, k, v):
        return flashtile.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)[:2]

    results = []
    for run in (torch.compile(attention, fullgraph=True), attention):
        out, lse = run(q, k, v)
        results.append((out, lse, *torch.autograd.grad(out.square().sum(), (q, k, v))))
    for got, expected in zip(*results):
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)


def test_compile_fullgraph_with_one_tensor_as_q_k_and_v():
    # self-attention on one tensor: Dynamo refuses an autograd.Function given one tensor twice
    torch._dynamo.reset()
    x = torch.randn(2, 9, 4, 16, device=DEVICE, requires_grad=True)

    def attention(x):
        return flashtile.flash_attn_func(x, x, x, softcap=3.0)

    results = []
    for run in (torch.compile(attention, fullgraph=True, backend="aot_eager"), attention):
        out = run(x)
        results.append((out, torch.autograd.grad(out.square().sum(), x)[0]))
    for got, expected in zip(*results):
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)


def test_ops_have_fake_implementations():
    q = torch.randn(2, 9, 4, 16, device="meta")
    k = torch.randn(2, 11, 2, 16, device="meta")
    out, lse = torch.ops.flashtile.fwd(q, k, k, *AttentionTensors(), *AttentionOptions(0.25, window_right=0))
    assert out.shape == q.shape and lse.shape == (2, 4, 9) and lse.dtype == torch.float32


def _op_args(causal: bool):
    """Arguments of flashtile::fwd and flashtile::bwd for one small GQA call (seqlen_q ≠ seqlen_k)."""
    torch.manual_seed(0)
    q = torch.randn(2, 9, 4, 40, device=DEVICE)
    k, v = torch.randn(2, 11, 2, 40, device=DEVICE), torch.randn(2, 11, 2, 40, device=DEVICE)
    call = (*AttentionTensors(), *AttentionOptions(0.25, window_right=0 if causal else -1))
    out, lse = torch.ops.flashtile.fwd(q, k, v, *call)
    grads = (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))
    return (q, k, v, *call), (torch.randn_like(out), q, k, v, out, lse, *grads, False, *call)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_ops_pass_opcheck(causal):
    # torch.library.opcheck: the schemas (dq/dk/dv mutated, nothing else), the fake implementations
    # against real outputs, and the ops under AOT dispatch with static and dynamic shapes
    fwd_args, bwd_args = _op_args(causal)
    torch.library.opcheck(torch.ops.flashtile.fwd.default, fwd_args)
    torch.library.opcheck(torch.ops.flashtile.bwd.default, bwd_args)


def _decode_step(q, k_cache, v_cache, k, v, cache_seqlens, block_table):
    return flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens,
                                             block_table=block_table, causal=True)


def test_compile_fullgraph_decode_step(backend):
    # a paged decoding step (append + attention, both registered operators) under torch.compile with
    # fullgraph: no graph break; the caches mutated as in eager; the same results for a changed
    # cache_seqlens without recompiling for it (its values are data)
    g = torch.Generator().manual_seed(3)
    k_cache, v_cache = (torch.randn(8, 16, 2, 32, generator=g).to(DEVICE) for _ in range(2))
    block_table = torch.arange(8, dtype=torch.int32, device=DEVICE).view(2, 4)
    q = torch.randn(2, 1, 4, 32, generator=g).to(DEVICE)
    k, v = (torch.randn(2, 1, 2, 32, generator=g).to(DEVICE) for _ in range(2))
    compiled = torch.compile(_decode_step, fullgraph=True, backend="aot_eager")
    for lengths in ([5, 40], [17, 2]):
        cache_seqlens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
        eager_caches = [t.clone() for t in (k_cache, v_cache)]
        expected = _decode_step(q, *eager_caches, k, v, cache_seqlens, block_table)
        out = compiled(q, k_cache, v_cache, k, v, cache_seqlens, block_table)
        torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)
        assert torch.equal(k_cache, eager_caches[0]) and torch.equal(v_cache, eager_caches[1])


def test_kvcache_ops_pass_opcheck():
    torch.manual_seed(0)
    q = torch.randn(2, 3, 4, 16, device=DEVICE)
    k_cache, v_cache = torch.randn(2, 20, 2, 16, device=DEVICE), torch.randn(2, 20, 2, 16, device=DEVICE)
    seqlens = torch.tensor([7, 20], dtype=torch.int32, device=DEVICE)
    cos, sin = torch.rand(32, 4, device=DEVICE), torch.rand(32, 4, device=DEVICE)  # rotary tables, rotary_dim 8
    call = (q, k_cache, v_cache, seqlens, None, None, 0.25, -1, 0, 0.0, None, 2, None, None, 0, None, None, None,
            cos, sin, seqlens - 1, True)
    torch.library.opcheck(torch.ops.flashtile.kvcache_fwd.default, call)
    torch.library.opcheck(torch.ops.flashtile.kvcache_fwd_out.default, (*call, torch.empty_like(q)))
    new = torch.randn(2, 1, 2, 16, device=DEVICE)
    torch.library.opcheck(torch.ops.flashtile.kvcache_append.default,
                          (k_cache, v_cache, new, new, seqlens - 1, None, None, None, 0, None, None, cos, sin, False))
