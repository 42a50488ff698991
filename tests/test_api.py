"""The public API's contract: bad input gets a clear error naming the argument and the shapes, and
help() documents every argument."""

import inspect
import re

import pytest
import torch
import torch.utils._python_dispatch

import flashtile
from flashtile._options import AttentionOptions, AttentionTensors
from flashtile.triton import launch


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
        (lambda: qkv(kv_shape=(2, 16, 4, 64)), ValueError, "head dims of q and k differ"),
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


def varlen_inputs(total_q=10, total_k=12, nheads=4, nheads_k=2, head_dim=32):
    q = torch.randn(total_q, nheads, head_dim)
    k, v = torch.randn(total_k, nheads_k, head_dim), torch.randn(total_k, nheads_k, head_dim)
    cu_q = torch.tensor([0, 4, 10], dtype=torch.int32)
    cu_k = torch.tensor([0, 5, 12], dtype=torch.int32)
    return q, k, v, cu_q, cu_k, 6, 7


@pytest.mark.parametrize(
    "change, error, message",
    [
        (lambda a: (a[0].unsqueeze(0), *a[1:]), ValueError, r"q must be 3-D, got shape \(1, 10, 4, 32\)"),
        (lambda a: (*a[:3], a[3].long(), *a[4:]), TypeError, r"cu_seqlens_q must be a 1-D int32 tensor"),
        (lambda a: (*a[:4], torch.tensor([0, 12], dtype=torch.int32), *a[5:]), ValueError,
         "must have the same length"),
        (lambda a: (*a[:5], 6.0, 7), TypeError, "max_seqlen_q must be an int"),
    ],
    ids=["q-rank", "cu-dtype", "cu-lengths", "max-seqlen-float"],
)
def test_varlen_bad_inputs_raise_clear_errors(change, error, message):
    with pytest.raises(error, match=message):
        flashtile.flash_attn_varlen_func(*change(varlen_inputs()))


def test_packed_inputs_need_their_packing_dim():
    with pytest.raises(ValueError, match=r"qkv must have size 3 in dim -3, got shape \(2, 16, 2, 4, 32\)"):
        flashtile.flash_attn_qkvpacked_func(torch.randn(2, 16, 2, 4, 32))


def test_sdpa_api_refuses_mask_with_causal():
    q, k, v = (t.transpose(1, 2) for t in qkv())
    with pytest.raises(ValueError, match="attn_mask and is_causal"):
        flashtile.attention(q, k, v, attn_mask=torch.ones(16, 16, dtype=torch.bool), is_causal=True)
    with pytest.raises(TypeError, match="is_causal must be a bool, got 'yes'"):
        flashtile.attention(q, k, v, is_causal="yes")


def test_sdpa_api_requires_enable_gqa_for_fewer_kv_heads():
    q, k, v = (t.transpose(1, 2) for t in qkv(kv_shape=(2, 16, 2, 32)))
    with pytest.raises(ValueError, match="enable_gqa=True"):
        flashtile.attention(q, k, v)
    assert flashtile.attention(q, k, v, enable_gqa=True).shape == q.shape


def test_a_last_axis_beyond_32_bit_offsets_is_refused():
    # meta tensors: the shape of a q whose head dim alone spans 2^32 elements, without the memory; the
    # launcher refuses it before any kernel runs (tensors past 2^31 elements otherwise run with 64-bit
    # offsets: tests/test_large_offsets.py)
    q = torch.empty_strided((1, 4, 2, 3), (1, 1, 1, 2**31), device="meta", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"q of shape \(1, 4, 2, 3\) and strides .* its last axis alone"):
        launch.attention_forward(q, q, q, AttentionOptions(0.1), AttentionTensors())


def test_op_helpers_refuse_inputs_that_need_grad():
    # flashtile.ops' helpers have no autograd formula; PyTorch would otherwise leave q.grad None
    q = torch.randn(1, 5, 2, 16, requires_grad=True)
    with pytest.raises(RuntimeError, match="not differentiable"):
        flashtile.ops.attention_forward(q, q, q, 0.25, causal=True)
    with torch.no_grad():
        out, lse = flashtile.ops.attention_forward(q, q, q, 0.25, causal=True)
    with pytest.raises(RuntimeError, match="not differentiable"):
        flashtile.ops.attention_backward(torch.randn_like(q), q, q, q, out, lse, 0.25, causal=True)


class _OperatorLog(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the name of every operator that reaches the dispatcher."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def test_modes_and_the_profiler_see_the_operators(device):
    # eager calls skip the dispatcher (ops.direct); a dispatch mode, the profiler or a traced
    # call must still meet flashtile::fwd and flashtile::bwd, with the same results
    q, k, v = (torch.randn(1, 9, 2, 16, device=device, requires_grad=True) for _ in range(3))
    expected = flashtile.flash_attn_func(q, k, v, causal=True)
    expected.sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    with _OperatorLog() as log:
        out = flashtile.flash_attn_func(q, k, v, causal=True)
        out.sum().backward()
    assert "flashtile.fwd.default" in log.names and "flashtile.bwd.default" in log.names
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    for t, grad in zip((q, k, v), grads):
        torch.testing.assert_close(t.grad, grad, rtol=0, atol=0)
    with torch.profiler.profile() as profile, torch.no_grad():
        flashtile.flash_attn_func(q, k, v, causal=True)
    assert "flashtile::fwd" in {event.name for event in profile.events()}


def test_meta_tensors_get_shapes_from_the_fake_kernels():
    # meta tensors hold no data: the operators' fake implementations give the outputs' shapes
    q = torch.empty(1, 8, 2, 16, device="meta")
    assert flashtile.flash_attn_func(q, q, q).shape == (1, 8, 2, 16)
    packed, cu_seqlens = torch.empty(16, 2, 16, device="meta"), torch.tensor([0, 8, 16], dtype=torch.int32)
    out = flashtile.flash_attn_varlen_func(packed, packed, packed, cu_seqlens.to("meta"), cu_seqlens.to("meta"), 8, 8)
    assert out.shape == (16, 2, 16) and out.is_meta


def test_jit_trace_records_the_operator():
    # a trace must hold flashtile::fwd, not the aten calls of the path one call took (a packed batch's
    # bounds read on the host would be frozen into it)
    q, k, v = (torch.randn(12, 2, 16) for _ in range(3))
    bounds, other_bounds = (torch.tensor(b, dtype=torch.int32) for b in ([0, 4, 12], [0, 9, 12]))

    def attend(q, k, v, cu_seqlens):
        return flashtile.flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, 12, 12, causal=True)

    with torch.no_grad():
        traced = torch.jit.trace(attend, (q, k, v, bounds), check_trace=False)
        assert "flashtile::fwd" in str(traced.graph)
        torch.testing.assert_close(traced(q, k, v, other_bounds), attend(q, k, v, other_bounds), rtol=0, atol=0)


@pytest.mark.parametrize("name", [name for name in flashtile.__all__ if callable(getattr(flashtile, name))])
def test_help_names_every_argument(name):
    # flash-attn's docstrings are complete per function: help() shows what each argument means
    function = getattr(flashtile, name)
    doc = inspect.getdoc(function)
    for argument in inspect.signature(function).parameters:
        assert re.search(rf"(^|\s|, ){argument}[:,]", doc, flags=re.M), f"{name}: {argument} is not documented"


@pytest.mark.parametrize("case", ["gqa-causal", "qkv-packed", "bias-grad", "sink-grad"])
def test_torch_func_grad_gives_autograd_s_gradients(backend, device, case):
    # torch.func's transforms (grad, vjp) take a Function whose context is set up apart from its
    # forward (setup_context); they unwrap the tensors at the operators, so the kernels see plain ones
    g = torch.Generator().manual_seed(31)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(device)

    if case == "gqa-causal":
        inputs = (rand(2, 17, 4, 32), rand(2, 23, 2, 32), rand(2, 23, 2, 32))
        fn = lambda q, k, v: flashtile.flash_attn_func(q, k, v, causal=True)  # noqa: E731
    elif case == "qkv-packed":
        inputs = (rand(2, 17, 3, 4, 32),)
        fn = lambda qkv: flashtile.flash_attn_qkvpacked_func(qkv, causal=True)  # noqa: E731
    elif case == "bias-grad":
        inputs = (rand(2, 4, 17, 32), rand(2, 4, 23, 32), rand(2, 4, 23, 32), rand(1, 4, 17, 23))
        fn = lambda q, k, v, bias: flashtile.attention(q, k, v, attn_mask=bias)  # noqa: E731
    else:
        inputs = (rand(2, 17, 4, 32), rand(2, 17, 4, 32), rand(2, 17, 4, 32), rand(4))
        fn = lambda q, k, v, sink: flashtile.flash_attn_func(q, k, v, learnable_sink=sink)  # noqa: E731

    def loss(*xs):
        return (fn(*xs) ** 2).sum()

    got = torch.func.grad(loss, argnums=tuple(range(len(inputs))))(*inputs)
    leaves = [t.clone().requires_grad_() for t in inputs]
    expected = torch.autograd.grad(loss(*leaves), leaves)
    # under a transform every call takes flashtile's Function, where plain autograd may take PyTorch's own
    # (the CPU path's fused kernel): the same exact gradients up to float32 rounding, bit for bit elsewhere
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b)


def _vmap_case(case, rand):
    """(the function, its vmapped inputs [3, ...], vmap's in_dims) of a case of the vmap tests."""
    if case == "gqa-causal":
        fn = lambda q, k, v: flashtile.flash_attn_func(q, k, v, causal=True)  # noqa: E731
        return fn, (rand(3, 2, 17, 4, 32), rand(3, 2, 23, 2, 32), rand(3, 2, 23, 2, 32)), 0
    if case == "shared-kv":  # only q vmapped: K and V repeat over the entries
        fn = lambda q, k, v: flashtile.flash_attn_func(q, k, v, window_size=(5, 0))  # noqa: E731
        return fn, (rand(3, 2, 17, 4, 32), rand(2, 17, 4, 32), rand(2, 17, 4, 32)), (0, None, None)
    if case == "qkv-packed-dim1":  # vmapped along dim 1
        fn = lambda qkv: flashtile.flash_attn_qkvpacked_func(qkv, causal=True)  # noqa: E731
        return fn, (rand(2, 3, 17, 3, 4, 32),), 1
    if case == "bias-per-entry":  # a bias per batch entry and vmapped: each entry runs on its own
        fn = lambda q, k, v, bias: flashtile.attention(q, k, v, attn_mask=bias)  # noqa: E731
        return fn, (rand(3, 2, 4, 17, 32), rand(3, 2, 4, 23, 32), rand(3, 2, 4, 23, 32), rand(3, 2, 4, 17, 23)), 0
    if case == "sink":
        fn = lambda q, k, v, sink: flashtile.flash_attn_func(q, k, v, learnable_sink=sink)  # noqa: E731
        return fn, (rand(3, 2, 17, 4, 32), rand(3, 2, 17, 4, 32), rand(3, 2, 17, 4, 32), rand(4)), (0, 0, 0, None)
    cu_seqlens = torch.tensor([0, 7, 23], dtype=torch.int32, device=rand(1).device)  # "varlen"
    fn = lambda q, k, v: flashtile.flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, 16, 16,  # noqa: E731
                                                           causal=True)
    return fn, (rand(3, 23, 4, 32), rand(3, 23, 2, 32), rand(3, 23, 2, 32)), 0


def _entries(inputs, in_dims, i):
    dims = in_dims if isinstance(in_dims, tuple) else (in_dims,) * len(inputs)
    return [t if d is None else t.select(d, i) for t, d in zip(inputs, dims)]


VMAP_CASES = ["gqa-causal", "shared-kv", "qkv-packed-dim1", "bias-per-entry", "sink", "varlen"]


@pytest.mark.parametrize("case", VMAP_CASES)
def test_vmap_gives_each_entry_s_call(backend, device, case):
    # torch.vmap, as over SDPA: one folded call where the entries can share a batch, entry by entry otherwise
    g = torch.Generator().manual_seed(37)
    fn, inputs, in_dims = _vmap_case(case, lambda *shape: torch.randn(*shape, generator=g).to(device))
    got = torch.vmap(fn, in_dims=in_dims)(*inputs)
    with torch.no_grad():
        expected = torch.stack([fn(*_entries(inputs, in_dims, i)) for i in range(3)])
    torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("case", VMAP_CASES)
def test_vmap_of_grad_gives_per_entry_gradients(backend, device, case):
    # per-sample gradients (torch.func's recipe): the operators' vmap rules, forward and backward
    g = torch.Generator().manual_seed(41)
    fn, inputs, in_dims = _vmap_case(case, lambda *shape: torch.randn(*shape, generator=g).to(device))
    argnums = tuple(range(len(inputs)))

    def loss(*xs):
        return (fn(*xs) ** 2).sum()

    got = torch.vmap(torch.func.grad(loss, argnums=argnums), in_dims=in_dims)(*inputs)
    for i in range(3):
        leaves = [t.clone().requires_grad_() for t in _entries(inputs, in_dims, i)]
        expected = torch.autograd.grad(loss(*leaves), leaves)
        for a, b in zip(got, expected):
            # vmap stacks every gradient, those of unvmapped inputs included, on dim 0
            torch.testing.assert_close(a[i], b)


@pytest.mark.parametrize("case", ["grad-of-vmap", "vmap-of-vmap-of-grad", "vmap-of-vjp-shared-cotangent",
                                  "empty-vmap", "empty-vmap-varlen", "vmapped-cu-seqlens"])
def test_vmap_composes_with_the_other_transforms(backend, device, case):
    # what a review found broken: gradients through vmap (a BatchedTensor never requires grad), nested
    # vmap over the backward, a cotangent shared by the vmapped entries, and a vmap over no entries
    g = torch.Generator().manual_seed(47)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(device)

    k, v = rand(2, 7, 2, 8), rand(2, 7, 2, 8)
    fn = lambda q: flashtile.flash_attn_func(q, k, v, causal=True)  # noqa: E731
    if case == "grad-of-vmap":
        qs = rand(3, 2, 7, 2, 8)
        got = torch.func.grad(lambda q: (torch.vmap(fn)(q) ** 2).sum())(qs)
        leaf = qs.clone().requires_grad_()
        expected, = torch.autograd.grad(sum((fn(leaf[i]) ** 2).sum() for i in range(3)), leaf)
    elif case == "vmap-of-vmap-of-grad":
        qs = rand(2, 3, 2, 7, 2, 8)
        got = torch.vmap(torch.vmap(torch.func.grad(lambda q: (fn(q) ** 2).sum())))(qs)
        leaf = qs.clone().requires_grad_()
        expected, = torch.autograd.grad(sum((fn(leaf[i, j]) ** 2).sum() for i in range(2) for j in range(3)), leaf)
    elif case == "vmap-of-vjp-shared-cotangent":  # only q vmapped: the gradient buffers must be vmapped still
        qs, cotangent = rand(3, 2, 7, 2, 8), rand(2, 7, 2, 8)
        got = torch.vmap(lambda q: torch.func.vjp(fn, q)[1](cotangent)[0])(qs)
        leaf = qs.clone().requires_grad_()
        expected, = torch.autograd.grad(sum((fn(leaf[i]) * cotangent).sum() for i in range(3)), leaf)
    elif case == "empty-vmap":
        qs = rand(0, 2, 7, 2, 8)
        got, expected = torch.vmap(fn)(qs), qs.new_empty((0, 2, 7, 2, 8))
    elif case == "vmapped-cu-seqlens":  # each entry its own packing: its bounds are not read while vmapped
        bounds = torch.tensor([[0, 3, 7], [0, 5, 7], [0, 1, 7]], dtype=torch.int32, device=device)
        qs = rand(3, 7, 2, 8)
        packed = lambda q, cu: flashtile.flash_attn_varlen_func(q, q, q, cu, cu, 6, 6, causal=True)  # noqa: E731
        got = torch.vmap(torch.func.grad(lambda q, cu: (packed(q, cu) ** 2).sum()))(qs, bounds)
        leaf = qs.clone().requires_grad_()
        expected, = torch.autograd.grad(sum((packed(leaf[i], bounds[i]) ** 2).sum() for i in range(3)), leaf)
    else:
        cu_seqlens = torch.tensor([0, 3, 7], dtype=torch.int32, device=device)
        qs = rand(0, 7, 2, 8)
        got = torch.vmap(lambda q: flashtile.flash_attn_varlen_func(q, q, q, cu_seqlens, cu_seqlens, 4, 4))(qs)
        expected = qs.new_empty((0, 7, 2, 8))
    torch.testing.assert_close(got, expected)


def test_compiled_grad_transform_is_never_silently_wrong(device):
    # torch.compile over torch.func.grad traced the bare operator and returned zero gradients; with an autograd
    # formula on the operator it raises instead (PyTorch's Function for an operator's formula is not one that
    # torch.func takes). Either an error or the eager gradients: never other numbers
    g = torch.Generator().manual_seed(53)
    q, k, v = (torch.randn(2, 7, 2, 8, generator=g).to(device) for _ in range(3))

    def loss(q):
        return (flashtile.flash_attn_func(q, k, v, causal=True) ** 2).sum()

    expected = torch.func.grad(loss)(q)
    torch._dynamo.reset()
    try:
        got = torch.compile(torch.func.grad(loss), fullgraph=True)(q)
    except Exception:  # noqa: BLE001 - Dynamo wraps the operator's refusal in its own exception types
        return
    torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("layout", ["batch", "varlen"])
@pytest.mark.parametrize("randomness", ["different", "same"])
def test_vmap_returns_each_entry_s_dropout_mask(backend, device, randomness, layout):
    # return_attn_probs with dropout under vmap: each entry's S_dmask is the mask its output was computed
    # with, one mask per entry or one for all as vmap's randomness flag asks (its seed is never read on the host)
    g = torch.Generator().manual_seed(53)
    q, k, v = (torch.randn(3, 1, 17, 2, 16, generator=g).to(device) for _ in range(3))
    dropout_p = 0.3
    if layout == "batch":
        fn = lambda q, k, v: flashtile.flash_attn_func(q, k, v, dropout_p=dropout_p,  # noqa: E731
                                                       return_attn_probs=True)
    else:  # one packed sequence of 17 tokens: its S_dmask is the batch layout's
        cu_seqlens = torch.tensor([0, 17], dtype=torch.int32, device=device)
        fn = lambda q, k, v: flashtile.flash_attn_varlen_func(  # noqa: E731
            q[0], k[0], v[0], cu_seqlens, cu_seqlens, 17, 17, dropout_p=dropout_p, return_attn_probs=True)
    out, _, probs = torch.vmap(fn, randomness=randomness)(q, k, v)
    assert probs.shape == (3, 1, 2, 17, 17)
    keep = ~torch.signbit(probs)
    kept = torch.where(keep, probs.abs(), 0.0) / (1 - dropout_p)
    torch.testing.assert_close(out.reshape(q.shape), torch.einsum("ebhqk,ebkhd->ebqhd", kept, v))
    assert all(torch.equal(keep[0], keep[i]) == (randomness == "same") for i in (1, 2))


def test_jacrev_matches_autograd_row_by_row(backend, device):
    # jacrev is vmap over vjp: only the incoming gradient is vmapped
    g = torch.Generator().manual_seed(43)
    q, k, v = (torch.randn(1, 5, 2, 8, generator=g).to(device) for _ in range(3))
    fn = lambda q, k, v: flashtile.flash_attn_func(q, k, v, causal=True)  # noqa: E731
    jacobians = torch.func.jacrev(fn, argnums=(0, 2))(q, k, v)
    leaves = [q.clone().requires_grad_(), v.clone().requires_grad_()]
    out = fn(leaves[0], k, leaves[1]).reshape(-1)
    for j in range(out.numel()):
        rows = torch.autograd.grad(out[j], leaves, retain_graph=True)
        for jacobian, row in zip(jacobians, rows):
            torch.testing.assert_close(jacobian.reshape(out.numel(), -1)[j], row.reshape(-1))
