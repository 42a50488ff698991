"""What the tests share: the device, inputs, the float64 standard-attention reference and the
assertion of flash-attn's accuracy rule (``flashtile.accuracy`` states the rule).

Tensors here are in flash-attn's layout (batch, seqlen, nheads, headdim); the reference
(``flashtile.reference``) takes SDPA's (batch, nheads, seqlen, headdim), and the helpers
transpose between the two.
"""

import pytest
import torch

from flashtile import flash_attn_func
from flashtile import reference as ref
from flashtile.accuracy import error_bound, max_error

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
# The CPU tiled path exists only off the GPU; "triton" is the interpreter there.
BACKENDS = ["triton"] if DEVICE == "cuda" else ["triton", "torch"]
# the conftest's backend fixture, plus the forward's tensor-descriptor loads ("triton-tma")
with_descriptor_loads = pytest.mark.parametrize("backend", [*BACKENDS, "triton-tma"], indirect=True)


def assert_accurate(name, actual, ref64, ref_lowp, factor):
    assert not torch.isnan(actual).any(), f"{name}: NaN in result"
    err, bound = max_error(actual, ref64), error_bound(ref64, ref_lowp, factor)
    assert err <= bound, (f"{name}: error {err:.3e} > bound {bound:.3e} "
                          f"({factor} x torch's {max_error(ref_lowp, ref64):.3e} + float32-ulp floor)")


def make_inputs(batch, seqlen_q, seqlen_k, nheads_q, nheads_k, head_dim, dtype, seed=0, head_dim_v=None):
    """q, k, v (requiring grad) and dO, random normal, from a fixed seed; v and dO with ``head_dim_v``
    channels where given (MLA), else ``head_dim``."""
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(device=DEVICE, dtype=dtype).requires_grad_()

    q = rand(batch, seqlen_q, nheads_q, head_dim)
    k = rand(batch, seqlen_k, nheads_k, head_dim)
    v = rand(batch, seqlen_k, nheads_k, head_dim_v)
    do = torch.randn(batch, seqlen_q, nheads_q, head_dim_v, generator=g).to(device=DEVICE, dtype=dtype)
    return q, k, v, do


def packed_inputs(seqlens_q, seqlens_k, nheads, nheads_k, head_dim, dtype, seed):
    """[q, k, v] (total, nheads, headdim), requiring grad; dO; int32 cu_seqlens_q and cu_seqlens_k."""
    g = torch.Generator().manual_seed(seed)

    def rand(total, heads):
        return torch.randn(total, heads, head_dim, generator=g).to(DEVICE, dtype)

    q, k, v = rand(sum(seqlens_q), nheads), rand(sum(seqlens_k), nheads_k), rand(sum(seqlens_k), nheads_k)
    do = rand(sum(seqlens_q), nheads)
    cu_q = torch.tensor([0] + seqlens_q, device=DEVICE).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + seqlens_k, device=DEVICE).cumsum(0).to(torch.int32)
    return [t.requires_grad_() for t in (q, k, v)], do, cu_q, cu_k


def to_reference(t, dtype):
    """(batch, seqlen, nheads, headdim) → the reference's (batch, nheads, seqlen, headdim), detached."""
    return t.detach().transpose(1, 2).to(dtype)


def references(q, k, v, do, keep=None, dropout_p=0.0, learnable_sink=None, **options):
    """(float64, input-dtype) results of standard attention: [out, lse, dq, dk, dv], and dsink
    last with ``learnable_sink``.

    ``options`` are the reference's (causal, softmax_scale, window_size, ...); ``keep``
    [B, H, Nq, Nk]: a dropout mask to apply to the reference's probabilities.
    """
    results = []
    for dtype in (torch.float64, q.dtype):
        inputs = [to_reference(t, dtype).requires_grad_() for t in (q, k, v)]
        if learnable_sink is not None:
            inputs.append(learnable_sink.detach().to(dtype).requires_grad_())
        qr, kr, vr = inputs[:3]
        out, lse, p = ref.attention_forward(qr, kr, vr, learnable_sink=inputs[3] if len(inputs) > 3 else None,
                                            **options)
        if keep is not None:
            group = qr.shape[1] // kr.shape[1]
            out = (p * keep.to(dtype) / (1 - dropout_p)) @ vr.repeat_interleave(group, dim=1)
        grads = torch.autograd.grad(out, inputs, do.transpose(1, 2).to(dtype))
        results.append([out.transpose(1, 2), lse] + [g.transpose(1, 2) for g in grads[:3]] + list(grads[3:]))
    return results


def check_outputs(out, lse, grads, ref64, ref_lowp):
    """out, lse and gradients against the reference, by flash-attn's rule."""
    assert_accurate("out", out, ref64[0], ref_lowp[0], factor=2)
    # LSE is float32 in both: judged against float64 directly, -inf where a row sees nothing
    seen = torch.isfinite(ref64[1])
    assert torch.equal(torch.isneginf(lse.cpu()), ~seen.cpu())
    torch.testing.assert_close(lse[seen].double(), ref64[1][seen], rtol=0, atol=1e-5)
    for name, got, r64, rlow in zip(("dq", "dk", "dv"), grads, ref64[2:], ref_lowp[2:]):
        assert got.shape == r64.shape and got.dtype == rlow.dtype, name
        assert_accurate(name, got, r64, rlow, factor=3)


def check_flash_attn_func(q, k, v, do, **options):
    """flash_attn_func(**options) against the reference with the same options → (out, lse)."""
    out, lse, probs = flash_attn_func(q, k, v, return_attn_probs=True, **options)
    assert out.shape == (*q.shape[:-1], v.shape[-1]) and out.dtype == q.dtype
    assert lse.shape == (q.shape[0], q.shape[2], q.shape[1]) and lse.dtype == torch.float32
    assert probs is None  # probabilities are only formed with dropout, for testing
    grads = torch.autograd.grad(out, (q, k, v), do)
    ref_options = {key: value for key, value in options.items() if key != "dropout_p"}
    check_outputs(out, lse, grads, *references(q, k, v, do, **ref_options))
    return out, lse
