"""CUDA-graph capture: a decoding step (append + attention against a paged or contiguous cache) and
a training step (forward + backward) recorded once and replayed with new inputs, as inference
engines and training loops with captured graphs run them. A call that synchronised with the host,
allocated outside the graph's pool in a way capture forbids, or baked a value into the launch
would fail to capture or give the first step's answer on later replays.

Each replay is judged against eager calls on the same inputs: the decoding step bit for bit (the
same kernels with the same split plan), the training step against float64 by flash-attn's rule
(the fused sm_90 backward sums dQ with atomics, so its bits vary run to run).

CUDA only: graphs do not exist on the CPU.
"""

import pytest
import torch
from helpers import check_outputs, make_inputs, references

import flashtile

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")


def capture(step):
    """``step()`` warmed up on a side stream (compiling its kernels), then recorded → (graph, outputs)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = step()
    return graph, outputs


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_decode_step_replays(paged):
    batch, nheads, nheads_k, head_dim, capacity, page = 4, 8, 2, 64, 256, 32
    g = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to("cuda", torch.bfloat16)

    if paged:
        pages = batch * capacity // page
        k_cache, v_cache = rand(pages, page, nheads_k, head_dim), rand(pages, page, nheads_k, head_dim)
        block_table = torch.randperm(pages, generator=g).view(batch, -1).to("cuda", torch.int32)
    else:
        k_cache, v_cache = rand(batch, capacity, nheads_k, head_dim), rand(batch, capacity, nheads_k, head_dim)
        block_table = None
    seqlens = torch.tensor([5, 100, 0, 37], dtype=torch.int32, device="cuda")
    q, k, v = rand(batch, 1, nheads, head_dim), rand(batch, 1, nheads_k, head_dim), rand(batch, 1, nheads_k, head_dim)

    def step(k_cache=k_cache, v_cache=v_cache):
        return flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens,
                                                 block_table=block_table, causal=True, return_softmax_lse=True)

    graph, (out, lse) = capture(step)
    for _ in range(3):  # each replay: new token, caches one longer
        q.copy_(rand(*q.shape))
        k.copy_(rand(*k.shape))
        v.copy_(rand(*v.shape))
        k_eager, v_eager = k_cache.clone(), v_cache.clone()
        want_out, want_lse = step(k_eager, v_eager)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
        assert torch.equal(k_cache, k_eager) and torch.equal(v_cache, v_eager)
        seqlens += 1


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 128], ids=lambda d: f"d{d}")
def test_training_step_replays(causal, head_dim):
    q, k, v, do = make_inputs(2, 300, 300, 4, 2, head_dim, torch.bfloat16, seed=1)

    def step():
        out, lse, _ = flashtile.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
        return (out, lse, *torch.autograd.grad(out, (q, k, v), do))

    graph, (out, lse, *grads) = capture(step)
    for seed in (2, 3):
        fresh = make_inputs(2, 300, 300, 4, 2, head_dim, torch.bfloat16, seed=seed)
        with torch.no_grad():
            for static, new in zip((q, k, v, do), fresh):
                static.copy_(new)
        graph.replay()
        torch.cuda.synchronize()
        check_outputs(out, lse, grads, *references(q, k, v, do, causal=causal))
