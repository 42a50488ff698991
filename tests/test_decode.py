"""flash_attn_with_kvcache against the float64 reference, by flash-attn's rule.

Every case checks three things: the cache after the in-place append equals one built
position by position here; the output is within 2× PyTorch's own low-precision error of
the float64 reference (``kvcache_attention_reference``, standard attention over each
sequence's gathered prefix); the log-sum-exp matches, with −inf exactly where a row sees
no key. Grids are small (a few hundred keys, 2-4 sequences) because the interpreter runs
each program in numpy; split counts are forced so that several splits run on the CPU.
"""

import importlib.util
import math
from pathlib import Path

import pytest
import torch
from helpers import DEVICE, DTYPES, assert_accurate

from flashtile.decode import flash_attn_with_kvcache
from flashtile.reference import kvcache_attention_reference
from flashtile.triton import configs
from flashtile.triton.launch import num_splits_heuristic

REFERENCE_OPTIONS = ("softmax_scale", "causal", "window_size", "softcap", "alibi_slopes", "learnable_sink")



class Case:
    """Random inputs for one call: a (possibly paged) cache, queries and optional new keys."""

    def __init__(self, batch=2, seqlen_q=1, nheads=(4, 2), head_dim=40, capacity=96, cache_seqlens=None,
                 seqlen_new=0, page_size=None, cache_batch=None, dtype=torch.float16, seed=0):
        g = torch.Generator().manual_seed(seed)
        nheads_q, nheads_k = nheads

        def rand(*shape):
            return torch.randn(*shape, generator=g).to(DEVICE, dtype)

        self.q = rand(batch, seqlen_q, nheads_q, head_dim)
        self.cache_seqlens = None if cache_seqlens is None else torch.tensor(cache_seqlens, dtype=torch.int32,
                                                                             device=DEVICE)
        self.k = self.v = self.block_table = self.cache_batch_idx = None
        if seqlen_new:
            self.k, self.v = rand(batch, seqlen_new, nheads_k, head_dim), rand(batch, seqlen_new, nheads_k, head_dim)
        if page_size is None:
            rows = cache_batch or batch
            self.k_cache, self.v_cache = (rand(rows, capacity, nheads_k, head_dim) for _ in range(2))
            if cache_batch:  # sequence b uses cache row rows-1-b
                self.cache_batch_idx = torch.arange(rows - 1, rows - 1 - batch, -1, dtype=torch.int32, device=DEVICE)
        else:
            # pages of all sequences shuffled in one pool, plus two pages nobody owns
            pages_per_seq = math.ceil(capacity / page_size)
            num_pages = batch * pages_per_seq + 2
            self.k_cache, self.v_cache = (rand(num_pages, page_size, nheads_k, head_dim) for _ in range(2))
            perm = torch.randperm(num_pages, generator=g)[: batch * pages_per_seq]
            self.block_table = perm.view(batch, pages_per_seq).to(DEVICE, torch.int32)

    def expected_caches(self):
        """The caches after the append, written one position at a time; and seqlens after it."""
        k_cache, v_cache = self.k_cache.clone(), self.v_cache.clone()
        if self.k is None:
            if self.cache_seqlens is not None:
                return k_cache, v_cache, self.cache_seqlens
            full = self.k_cache.shape[1] * (1 if self.block_table is None else self.block_table.shape[1])
            return k_cache, v_cache, torch.full((self.q.shape[0],), full, dtype=torch.int32, device=DEVICE)
        for b in range(self.k.shape[0]):
            for t in range(self.k.shape[1]):
                pos = int(self.cache_seqlens[b]) + t
                if self.block_table is not None:
                    page_size = k_cache.shape[1]
                    where = (int(self.block_table[b, pos // page_size]), pos % page_size)
                else:
                    where = (b if self.cache_batch_idx is None else int(self.cache_batch_idx[b]), pos)
                k_cache[where], v_cache[where] = self.k[b, t], self.v[b, t]
        return k_cache, v_cache, self.cache_seqlens + self.k.shape[1]

    def check(self, **options):
        k_expected, v_expected, seqlens_k = self.expected_caches()
        out, lse = flash_attn_with_kvcache(
            self.q, self.k_cache, self.v_cache, self.k, self.v, cache_seqlens=self.cache_seqlens,
            cache_batch_idx=self.cache_batch_idx, block_table=self.block_table, return_softmax_lse=True, **options,
        )
        assert torch.equal(self.k_cache, k_expected) and torch.equal(self.v_cache, v_expected)
        assert out.shape == self.q.shape and out.dtype == self.q.dtype
        assert lse.shape == (self.q.shape[0], self.q.shape[2], self.q.shape[1]) and lse.dtype == torch.float32
        ref_options = {name: options[name] for name in REFERENCE_OPTIONS if name in options}
        refs = [kvcache_attention_reference(self.q, k_expected, v_expected, seqlens_k, self.cache_batch_idx,
                                            self.block_table, compute_dtype=dtype, **ref_options)
                for dtype in (torch.float64, self.q.dtype)]
        assert_accurate("out", out, refs[0][0], refs[1][0], factor=2)
        seen = torch.isfinite(refs[0][1])
        assert torch.equal(torch.isneginf(lse), ~seen)
        assert (out.transpose(1, 2)[~seen] == 0).all()
        torch.testing.assert_close(lse[seen].double(), refs[0][1][seen], rtol=0, atol=1e-5)
        return out, lse


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_whole_cache_no_append(backend, dtype):
    Case(batch=2, capacity=113, dtype=dtype).check()


@pytest.mark.parametrize("num_splits", [1, 3, 0], ids=lambda s: f"splits{s}")
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_ragged_cache_seqlens_including_empty(backend, dtype, num_splits):
    # sequence 0 is empty: output 0, log-sum-exp -inf; sequence 3 fills the cache
    _, lse = Case(batch=4, capacity=130, cache_seqlens=[0, 1, 77, 130], dtype=dtype, seed=1).check(
        num_splits=num_splits)
    assert torch.isneginf(lse[0]).all() and torch.isfinite(lse[1:]).all()


@pytest.mark.parametrize("seqlen_new", [1, 5], ids=lambda n: f"new{n}")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_in_place_append(backend, causal, seqlen_new):
    # the new keys land at each sequence's own length, the first at position 0
    Case(batch=3, seqlen_q=seqlen_new, capacity=90, cache_seqlens=[0, 41, 85], seqlen_new=seqlen_new,
         dtype=torch.bfloat16, seed=2).check(causal=causal, num_splits=2)


def test_cache_batch_idx(backend):
    # 2 sequences in a cache of 5 rows: the other rows must stay untouched
    Case(batch=2, seqlen_q=2, capacity=70, cache_seqlens=[30, 3], seqlen_new=2, cache_batch=5,
         seed=3).check(causal=True)


@pytest.mark.parametrize("num_splits", [1, 4], ids=lambda s: f"splits{s}")
@pytest.mark.parametrize("page_size", [16, 48, 5, 64], ids=lambda p: f"page{p}")
def test_paged_cache(backend, page_size, num_splits):
    # ragged lengths that end mid-page and on a page boundary; causal chunk of 3 queries. The KV-cache kernel's
    # 64-key blocks read 4 pages of 16 by scalar ids, pages of 48 and 5 by a vector of ids, a page of 64 whole
    # (decode._paged_rows)
    Case(batch=3, seqlen_q=3, capacity=144, cache_seqlens=[0, 45, 141], seqlen_new=3, page_size=page_size,
         dtype=torch.float16, seed=4).check(causal=True, num_splits=num_splits)


@pytest.mark.parametrize("nheads", [(2, 2), (6, 2), (4, 1)], ids=["mha", "gqa-6:2", "mqa-4:1"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_gqa(backend, dtype, nheads):
    Case(batch=2, nheads=nheads, head_dim=64, capacity=100, cache_seqlens=[100, 60], dtype=dtype,
         seed=5).check(num_splits=2)


@pytest.mark.parametrize("seqlen_q", [1, 4, 37], ids=lambda n: f"q{n}")
def test_causal_alignment_per_sequence(backend, seqlen_q):
    # causal is aligned to each sequence's own length: with 2 keys and 4 queries the first two
    # rows see nothing; 37 queries × 4 heads span several row blocks
    Case(batch=3, seqlen_q=seqlen_q, nheads=(4, 1), head_dim=32, capacity=120, cache_seqlens=[2, 50, 120],
         dtype=torch.float16, seed=6).check(causal=True, num_splits=3)


@pytest.mark.parametrize(
    "options",
    [dict(window_size=(10, 0)), dict(window_size=(20, 5), causal=True), dict(window_size=(-1, 3)),
     dict(softcap=5.0, softmax_scale=0.5), dict(alibi_slopes="per-head", causal=True),
     dict(alibi_slopes="per-sequence", window_size=(30, -1), softcap=3.0)],
    ids=["window-left", "window-causal", "window-right", "softcap", "alibi-causal", "alibi-window-softcap"],
)
def test_window_softcap_alibi(backend, options):
    case = Case(batch=2, seqlen_q=3, nheads=(4, 2), capacity=120, cache_seqlens=[57, 110], seqlen_new=3,
                page_size=16, dtype=torch.bfloat16, seed=7)
    g = torch.Generator().manual_seed(8)
    if options.get("alibi_slopes") == "per-head":
        options["alibi_slopes"] = torch.rand(4, generator=g).to(DEVICE)
    elif options.get("alibi_slopes") == "per-sequence":
        options["alibi_slopes"] = torch.rand(2, 4, generator=g).to(DEVICE)
    case.check(num_splits=3, **options)


@pytest.mark.parametrize("num_splits", [1, 3], ids=lambda s: f"splits{s}")
def test_learnable_sink_counts_once(backend, num_splits):
    # split-KV merges partial results: the sink must join one of them only. Sequence 0 is empty
    # (0 and L = sink), sequence 1 ends mid-page; causal chunk of 3 queries, paged, with an append
    sink = torch.tensor([8.0, -1.5, 0.25, -30.0], device=DEVICE)
    case = Case(batch=3, seqlen_q=3, nheads=(4, 2), capacity=128, cache_seqlens=[0, 37, 120], seqlen_new=0,
                page_size=16, dtype=torch.bfloat16, seed=9)
    out, lse = case.check(causal=True, num_splits=num_splits, learnable_sink=sink)
    assert (out[0] == 0).all()
    torch.testing.assert_close(lse[0], sink[:, None].expand(4, 3), rtol=1e-6, atol=1e-6)  # sink · log2e · ln 2


def test_int_cache_seqlens_and_empty_batch(backend):
    Case(batch=2, capacity=64, seed=9).check()  # cache_seqlens None: the whole cache
    case = Case(batch=2, seqlen_q=2, capacity=64, cache_seqlens=[20, 20], seqlen_new=2, seed=10)
    expected = case.expected_caches()
    out = flash_attn_with_kvcache(case.q, case.k_cache, case.v_cache, case.k, case.v, cache_seqlens=20, causal=True)
    assert torch.equal(case.k_cache, expected[0])
    ref64, ref_lowp = (kvcache_attention_reference(case.q, expected[0], expected[1], expected[2], causal=True,
                                                   compute_dtype=dtype)[0] for dtype in (torch.float64, case.q.dtype))
    assert_accurate("out", out, ref64, ref_lowp, factor=2)
    empty = Case(batch=2, seqlen_q=0, capacity=64)
    out, lse = flash_attn_with_kvcache(empty.q, empty.k_cache, empty.v_cache, return_softmax_lse=True)
    assert out.shape == empty.q.shape and lse.shape == (2, 4, 0)


def test_num_splits_heuristic_fills_the_gpu():
    # H200: 132 SMs, two programs each
    assert num_splits_heuristic(64 * 8, 132, 2048) == 1  # batch 64 × 8 KV heads already fill it
    splits = num_splits_heuristic(1 * 8, 132, 2048)  # batch 1, 128k keys in blocks of 64
    assert 0.85 * 264 <= 8 * splits <= 264
    assert num_splits_heuristic(8, 132, 3) <= 3  # never more splits than key blocks
    assert num_splits_heuristic(8, 1, 100) == 1
    # a float8 cache aims for four programs per SM: batch 16 × 8 KV heads splits 4 ways, not 2
    assert num_splits_heuristic(16 * 8, 132, 128) == 2
    float8 = configs.decode_programs_per_sm(torch.float8_e4m3fn)
    assert num_splits_heuristic(16 * 8, 132, 128, programs_per_sm=float8) == 4


@pytest.mark.parametrize(
    "change, error, message",
    [
        (dict(q=torch.randn(2, 1, 4, 40)), TypeError, "k_cache must have q's dtype"),
        (dict(k_cache=torch.randn(2, 96, 3, 40).half(), v_cache=torch.randn(2, 96, 3, 40).half()), ValueError,
         r"nheads of q \(4\) must be a multiple of nheads of the cache \(3\)"),
        (dict(k=torch.randn(2, 1, 2, 40).half()), ValueError, "k and v must be given together"),
        (dict(k=torch.randn(2, 1, 2, 40).half(), v=torch.randn(2, 1, 2, 40).half()), ValueError,
         "cache_seqlens is required"),
        (dict(cache_seqlens=torch.tensor([1, 2])), TypeError, "cache_seqlens must be int32"),
        (dict(cache_seqlens=torch.tensor([1, 2, 3], dtype=torch.int32)), ValueError,
         r"cache_seqlens must have shape \(2,\)"),
        (dict(cache_seqlens=97), ValueError, "does not fit a cache of 96 positions"),
        (dict(k_cache=torch.randn(3, 96, 2, 40).half(), v_cache=torch.randn(3, 96, 2, 40).half()), ValueError,
         "pass cache_batch_idx"),
        (dict(block_table=torch.zeros(2, 4, dtype=torch.int32), cache_batch_idx=torch.zeros(2, dtype=torch.int32)),
         NotImplementedError, "cache_batch_idx cannot be combined with block_table"),
        (dict(window_size=4), ValueError, "window_size must be a pair of ints"),
        (dict(window_size=(-2, -1)), ValueError, "window_size must be a pair of ints ≥ -1"),
        (dict(softcap=-1.0), ValueError, "softcap must be a number"),
        (dict(alibi_slopes=torch.ones(3)), ValueError, r"alibi_slopes must have shape \(4,\) or \(2, 4\)"),
        (dict(num_splits=-1), ValueError, "num_splits must be an int"),
        (dict(num_splits=True), ValueError, "num_splits must be an int"),
        (dict(cache_seqlens=True), TypeError, "cache_seqlens must be an int or an int32 tensor, got bool"),
        (dict(out=torch.zeros(1, 1, 1, 40).half().expand(2, 1, 4, 40)), ValueError, "out must not overlap itself"),
        (dict(q=torch.randn(32768, 1, 4, 16).half(), k_cache=torch.randn(32768, 2, 2, 16).half(),
              v_cache=torch.randn(32768, 2, 2, 16).half()), ValueError, r"batch · nheads of the cache \(32768 · 2\)"),
    ],
    ids=["dtype", "heads", "k-without-v", "append-without-seqlens", "seqlens-int64", "seqlens-shape", "overflow",
         "cache-batch", "paged-with-batch-idx", "window-type", "window-below-minus-one", "softcap", "alibi-shape",
         "num-splits", "num-splits-bool", "seqlens-bool", "out-expanded", "grid"],
)
def test_bad_inputs_raise_clear_errors(change, error, message):
    args = dict(q=torch.randn(2, 1, 4, 40).half(), k_cache=torch.randn(2, 96, 2, 40).half(),
                v_cache=torch.randn(2, 96, 2, 40).half())
    args.update(change)
    with pytest.raises(error, match=message):
        flash_attn_with_kvcache(**args)


def test_generate_paged_example_runs():
    # the streaming-generation example, briefly: it raises if any step's logits differ from
    # recomputing the whole sequence; tiny sizes because both paths run in the interpreter
    path = Path(__file__).parents[1] / "examples" / "generate_paged.py"
    spec = importlib.util.spec_from_file_location("generate_paged", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    result = example.main(["--device", DEVICE, "--dtype", "float32", "--batch", "2", "--prompt-lens", "5", "17",
                           "--steps", "3", "--dim", "32", "--layers", "1", "--heads", "4", "2", "--vocab", "64"])
    assert [len(seq) for seq in result["sequences"]] == [8, 20]
    assert result["max_error"] <= result["tolerance"]
