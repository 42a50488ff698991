"""Launch plans (``flashtile.triton.plans``): a call whose key was seen replays the launches recorded
on the first call, filled with its own tensors.

A replay must be indistinguishable from deciding afresh: each case below calls once to record, then
on new inputs of the same key, counting the replays, and compares that output bit for bit with a
call that records on those same inputs. Under the interpreter a replay goes through ``kernel[grid]``
with the filled arguments, so the slot filling is checked on the CPU as on the GPU (where the compiled
kernel's launcher is called directly).
"""

import pytest
import torch
import triton
import triton.language as tl
from helpers import DEVICE, make_inputs, packed_inputs

import flashtile
from flashtile.triton import configs, plans


@pytest.fixture
def replays(monkeypatch):
    """The number of plan replays so far (a list, appended to at each)."""
    counted = []
    replay = plans.LaunchPlan.replay

    def counting(self, call):
        replayed = replay(self, call)
        counted.append(replayed)
        return replayed

    monkeypatch.setattr(plans.LaunchPlan, "replay", counting)
    return counted


def _grads(outputs, inputs):
    out = outputs[0] if isinstance(outputs, tuple) else outputs
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(out.device, out.dtype)
    return (out, *torch.autograd.grad(out, inputs, grad_out))


def _forward_backward(**options):
    def run(q, k, v):
        q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
        return _grads(flashtile.flash_attn_func(q, k, v, **options), (q, k, v))
    return run


def _inputs(seed, dtype=torch.bfloat16):
    return [t.detach() for t in make_inputs(2, 33, 40, 4, 2, 64, dtype, seed=seed)[:3]]


def _with_bias(seed):
    q, k, v = _inputs(seed)
    return q, k, v, torch.randn(1, 4, 33, 40, device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(seed))


def _biased(q, k, v, bias):
    # SDPA's layout (batch, nheads, seqlen, headdim); the mask broadcasts over the batch
    q, k, v = (t.transpose(1, 2).clone().requires_grad_() for t in (q, k, v))
    bias = bias.detach().clone().requires_grad_()
    return _grads(flashtile.attention(q, k, v, attn_mask=bias, enable_gqa=True), (q, k, v, bias))


def _dropout(q, k, v):
    torch.manual_seed(11)  # the same seed tensor for the recording and the replay being compared
    return _forward_backward(dropout_p=0.2, causal=True)(q, k, v)


def _varlen(same_bounds: bool):
    def make(seed):
        (q, k, v), _, cu_q, cu_k = packed_inputs([5, 17, 1], [5, 17, 1] if same_bounds else [9, 3, 20], 4, 2, 64,
                                                 torch.bfloat16, seed)
        return q.detach(), k.detach(), v.detach(), cu_q, cu_k, 17, 20

    def run(q, k, v, cu_q, cu_k, max_q, max_k):
        q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
        cu_k = cu_q if same_bounds else cu_k  # one tensor for both: FlashAttnFunction's "the same"
        out = flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=True)
        return _grads(out, (q, k, v))
    return make, run


def _kvcache(num_splits: int, paged: bool, rotary: bool):
    def make(seed):
        g = torch.Generator(DEVICE).manual_seed(seed)
        rand = lambda *shape: torch.randn(*shape, device=DEVICE, generator=g, dtype=torch.bfloat16)  # noqa: E731
        cache_shape = (6, 16, 2, 64) if paged else (3, 96, 2, 64)
        k_cache, v_cache = rand(*cache_shape), rand(*cache_shape)
        table = torch.tensor([[0, 3, 5, 1], [2, 4, 0, 0], [1, 0, 0, 0]], dtype=torch.int32, device=DEVICE)
        seqlens = torch.tensor([40, 20, 3], dtype=torch.int32, device=DEVICE)
        cos = sin = None
        if rotary:
            angles = torch.rand(96, 16, device=DEVICE, generator=g) * 6
            cos, sin = angles.cos(), angles.sin()
        return rand(3, 2, 4, 64), k_cache, v_cache, rand(3, 2, 2, 64), rand(3, 2, 2, 64), seqlens, \
            (table if paged else None), cos, sin

    def run(q, k_cache, v_cache, k, v, seqlens, table, cos, sin):
        k_cache, v_cache = k_cache.clone(), v_cache.clone()
        out, lse = flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens,
                                                     block_table=table, causal=True, num_splits=num_splits,
                                                     return_softmax_lse=True, rotary_cos=cos, rotary_sin=sin)
        return out, lse, k_cache, v_cache
    return make, run


CASES = {
    "causal-gqa": (_inputs, _forward_backward(causal=True)),
    "window-softcap": (_inputs, _forward_backward(window_size=(7, 3), softcap=20.0)),
    "float32": (lambda seed: _inputs(seed, dtype=torch.float32), _forward_backward()),
    "k-is-v": (lambda seed: (lambda q, k, v: (q, k, k))(*_inputs(seed)),
               lambda q, k, v: (flashtile.flash_attn_func(q, k, v),)),
    "bias": (_with_bias, _biased),
    "dropout": (_inputs, _dropout),
    "varlen-one-bounds": _varlen(same_bounds=True),
    "varlen-two-bounds": _varlen(same_bounds=False),
    "kvcache-split3": _kvcache(num_splits=3, paged=False, rotary=False),
    "kvcache-paged-rotary": _kvcache(num_splits=1, paged=True, rotary=True),
    # on an sm_90 GPU the Gluon forward and fused backward, recorded and replayed like the Triton kernels;
    # 40 keys are one of the fused backward's key blocks, so its dQ sums are in one order and bitwise
    "head-dim-128": (lambda seed: [t.detach() for t in make_inputs(2, 33, 40, 4, 4, 128, torch.bfloat16,
                                                                   seed=seed)[:3]], _forward_backward()),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_replay_is_the_recording(case, replays):
    make, run = CASES[case]
    run(*make(seed=1))  # records
    assert not replays
    inputs = make(seed=2)
    replayed = run(*inputs)
    assert replays and all(replays), "the second call of a key should replay its plan"
    plans.clear()
    recorded = run(*inputs)
    for got, expected in zip(replayed, recorded, strict=True):
        assert torch.equal(got, expected)


def test_a_replay_needs_the_recording_s_aliases(replays):
    # recorded with k passed as v: the launches read v from k's slot, so a call with a v of its own
    # must not replay them, and records anew
    q, k, _ = _inputs(seed=1)
    flashtile.flash_attn_func(q, k, k)
    q, k, v = _inputs(seed=2)
    out = flashtile.flash_attn_func(q, k, v)
    assert replays == [False]
    plans.clear()
    assert torch.equal(out, flashtile.flash_attn_func(q, k, v))
    flashtile.flash_attn_func(q, k, v)
    assert replays == [False, True]


def test_tma_descriptors_are_rebuilt_on_replay(monkeypatch, replays):
    monkeypatch.setattr(configs, "TMA_MIN_SEQLEN", 1)
    make, run = _inputs, _forward_backward(causal=True)
    run(*make(seed=1))
    replayed = run(*make(seed=2))
    assert replays and all(replays)
    plans.clear()
    for got, expected in zip(replayed, run(*make(seed=2)), strict=True):
        assert torch.equal(got, expected)


def test_descriptors_of_either_kind_are_rebuilt_whole():
    # a replay rebuilds Triton's and Gluon's descriptors (the latter carry a shared-memory layout) over
    # the call's tensor with every other field as recorded
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor
    from triton.tools.tensor_descriptor import TensorDescriptor

    recorded, now = torch.zeros(2, 64, 4, 32, dtype=torch.bfloat16), torch.ones(2, 64, 4, 32, dtype=torch.bfloat16)
    layout = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=16, rank=4)
    for d in (TensorDescriptor(recorded, list(recorded.shape), list(recorded.stride()), [1, 16, 1, 32]),
              GluonDescriptor(recorded, list(recorded.shape), list(recorded.stride()), [1, 16, 1, 32], layout)):
        assert plans._is_descriptor(d) and not plans._is_descriptor(recorded)
        rebuilt = plans._rebuilt(plans._descriptor_box(d), now)
        assert type(rebuilt) is type(d) and rebuilt.base is now
        assert rebuilt == type(d)(now, *[getattr(d, f) for f in ("shape", "strides", "block_shape")],
                                  *([layout] if type(d) is GluonDescriptor else []), d.padding)


@triton.jit
def _copy_kernel(X, Y, n, BLOCK: tl.constexpr):
    offsets = tl.arange(0, BLOCK)
    tl.store(Y + offsets, tl.load(X + offsets, mask=offsets < n), mask=offsets < n)


def test_a_launch_outside_the_bound_tensors_is_not_kept():
    x, y, elsewhere = (torch.arange(8.0, device=DEVICE) * i for i in (1, 0, 2))
    complete = plans.LaunchPlan()
    complete.bind((x, y))
    complete.record(_copy_kernel, (1,), [x, y, 8, 8], {})
    plans.store(("copy",), complete)
    assert plans.lookup(("copy",)) is complete
    x2, y2 = torch.arange(8.0, device=DEVICE) + 5, torch.zeros(8, device=DEVICE)
    assert complete.replay((x2, y2)) and torch.equal(y2, x2)
    incomplete = plans.LaunchPlan()
    incomplete.bind((x, y))
    incomplete.record(_copy_kernel, (1,), [elsewhere, y, 8, 8], {})
    assert torch.equal(y, elsewhere)  # launched all the same
    plans.store(("copy", "elsewhere"), incomplete)
    assert not incomplete.complete and plans.lookup(("copy", "elsewhere")) is None
    assert all(t is None for launch in complete.launches for t in launch.template if isinstance(t, torch.Tensor))


def test_a_launch_hook_takes_the_hooked_path():
    # a profiler's launch hook must see replayed launches too: they then go through kernel[grid]
    from triton import knobs

    assert not plans._hooked()
    knobs.runtime.launch_enter_hook.add(print)
    try:
        assert plans._hooked()
    finally:
        knobs.runtime.launch_enter_hook.remove(print)


class _Recorder(list):
    """Stands in for the C function of Triton's launcher (a builtin: no Python code): keeps each call."""

    def __call__(self, *args):
        self.append(args)


class _FakeCompiled:
    """A compiled kernel as Triton 3.6's CUDA launcher presents it, its C function replaced by a
    recorder: ``run.launch`` is Triton's own Python wrapper (``wrap_handle_tensordesc``) around it."""

    def __init__(self, signature, recorder):
        from triton.backends.nvidia.driver import wrap_handle_tensordesc

        self.function, self.packed_metadata = 12345, (4, 1, 0)
        self.run = type("Launcher", (), {})()
        self.run.global_scratch_size = self.run.profile_scratch_size = 0
        self.run.launch_cooperative_grid, self.run.launch_pdl = False, True
        self.run.launch = wrap_handle_tensordesc(recorder, signature, None)


def test_a_direct_launch_passes_what_triton_s_wrapper_passes():
    # the replay's direct call of the C launcher against Triton's wrapper on the same call, here with
    # descriptors not lowered to encoded ones (base tensor, shapes, strides), which a CPU can build
    from triton.tools.tensor_descriptor import TensorDescriptor

    recorded, now = torch.zeros(2, 64, 4, 32), torch.ones(2, 64, 4, 32)
    other, other_now = torch.zeros(8), torch.ones(8)

    def descriptor(t):
        return TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 16, 1, 32])

    signature = {"X": "*fp32", "D": "tensordesc<fp32[1, 16, 1, 32]>", "n": "i32", "BLOCK": "constexpr"}
    plan = plans.LaunchPlan()
    plan.bind((recorded, other))
    arguments = [other, descriptor(recorded), 8, 16]
    fills = [(0, 1, None), (1, 0, plans._descriptor_box(arguments[1]))]
    calls = _Recorder()
    compiled = _FakeCompiled(signature, calls)
    direct = plans._Direct.of(compiled, compiled.function, arguments, fills)
    assert direct is not None
    direct((3, 1, 1), 77, (now, other_now))
    compiled.run.launch(3, 1, 1, 77, compiled.function, False, True, None, None, compiled.packed_metadata,
                        None, None, None, other_now, descriptor(now), 8, 16)
    assert len(calls) == 2 and len(calls[0]) == len(calls[1])
    for got, expected in zip(*calls, strict=True):
        assert got is expected or got == expected
    assert all(not isinstance(t, torch.Tensor) for t in direct.template)  # a plan holds no tensors


def test_a_direct_launch_is_not_made_where_scratch_is_allocated():
    compiled = _FakeCompiled({"X": "*fp32"}, _Recorder())
    compiled.run.global_scratch_size = 128
    assert plans._Direct.of(compiled, compiled.function, [torch.zeros(1)], [(0, 0, None)]) is None
