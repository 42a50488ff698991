"""Host time of the two ways to give an operator its autograd (a measurement behind flashtile.autograd).

Issue 20 asked whether ``torch.library.register_autograd`` on the forward operator beats a Python
``torch.autograd.Function`` around the operators. This defines stand-in operators with flashtile's
shapes and kernels that only allocate their outputs, so that what is timed is PyTorch's machinery:
a forward through each, and a forward + ``autograd.grad`` (median of 5 rounds of 3000 calls, CPU).

    python benchmarks/autograd_layer.py
"""

import torch, time
lib = torch.library.Library("ratest", "DEF")  # flashtile::fwd/bwd without their work
lib.define("fwd(Tensor q, Tensor k, Tensor v, float scale) -> (Tensor, Tensor)")
lib.define("bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse) -> (Tensor, Tensor, Tensor)")


def fwd(q, k, v, scale):
    return torch.empty_like(q), q.new_empty(q.shape[:-1])


def bwd(dout, q, k, v, out, lse):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


lib.impl("fwd", fwd, "CompositeExplicitAutograd"); lib.impl("bwd", bwd, "CompositeExplicitAutograd")
torch.library.register_fake("ratest::fwd", fwd, lib=lib); torch.library.register_fake("ratest::bwd", bwd, lib=lib)
lib2 = torch.library.Library("ratest2", "DEF")  # the same forward, its autograd registered on it
lib2.define("fwd(Tensor q, Tensor k, Tensor v, float scale) -> (Tensor, Tensor)")
lib2.impl("fwd", fwd, "CompositeExplicitAutograd"); torch.library.register_fake("ratest2::fwd", fwd, lib=lib2)


def setup(ctx, inputs, output):
    q, k, v, scale = inputs; out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)


def backward(ctx, dout, dlse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = torch.ops.ratest.bwd(dout, q, k, v, out, lse)
    return dq, dk, dv, None


torch.library.register_autograd("ratest2::fwd", backward, setup_context=setup, lib=lib2)


class F(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale):
        out, lse = torch.ops.ratest.fwd(q, k, v, scale)
        ctx.save_for_backward(q, k, v, out, lse); ctx.mark_non_differentiable(lse)
        return out, lse
    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        return (*torch.ops.ratest.bwd(dout, q, k, v, out, lse), None)


q, k, v = [torch.randn(1, 128, 8, 64, requires_grad=True) for _ in range(3)]
do = torch.randn(1, 128, 8, 64)


def t(f, n=3000):
    for _ in range(300): f()
    best = []
    for _ in range(5):
        s = time.perf_counter()
        for _ in range(n): f()
        best.append((time.perf_counter() - s) / n * 1e6)
    return sorted(best)[2]


print("Function fwd", t(lambda: F.apply(q, k, v, 0.1)))
print("register_autograd fwd", t(lambda: torch.ops.ratest2.fwd(q, k, v, 0.1)))
print("Function fwd+bwd", t(lambda: torch.autograd.grad(F.apply(q, k, v, 0.1)[0], (q, k, v), do)))
print("register_autograd fwd+bwd", t(lambda: torch.autograd.grad(torch.ops.ratest2.fwd(q, k, v, 0.1)[0], (q, k, v), do)))
