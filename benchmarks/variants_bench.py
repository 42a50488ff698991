"""Speed of flashtile's attention variants and of varlen packing, next to SDPA (issues 4 and 5).

    PYTHONPATH=src python3 benchmarks/variants_bench.py --out variants_h200.md --json variants_h200.json

Three tables, bf16, head dim 128, random normal inputs (fixed seeds):

1. **Sliding window**, seqlen 16384, batch 1, 16 heads, causal: windows (512, 0) and
   (4096, 0) against plain causal. Blocks outside the window are skipped, so the time
   should follow the visible pairs (shown as a fraction of plain causal's), not seqlen.
   SDPA has no window argument: its plain causal is the reference row.
2. **Each variant**, seqlen 4096, batch 4, 16 heads, non-causal and causal: plain,
   softcap 30, ALiBi (slopes (nheads,)), dropout 0.1, window (256, 256), and an additive
   float bias (1, H, N, N) through ``flashtile.attention``, without and with
   requires_grad. SDPA runs what it expresses: plain, dropout, the bias as a float
   ``attn_mask``, ALiBi as an explicit float ``attn_mask`` holding −slope·|i − j|.
   ``attention`` and SDPA both refuse ``attn_mask`` with ``is_causal``, so in the causal
   bias and ALiBi cases the causal mask is folded into the bias (−inf above the
   diagonal) for both: neither can skip the masked blocks then.
3. **Varlen**: 64 sequences, lengths uniform in 1..4096 (seed 0), 16 heads, causal.
   ``flash_attn_varlen_func`` on the packed batch against the padded batch
   (64, max length): SDPA with ``is_causal`` (valid for the real rows with right
   padding; it computes the padding too, as a padded pipeline does), SDPA with a
   key-padding + causal boolean mask, and ``flash_attn_func`` on the padded batch.

Times are ``triton.testing.do_bench`` medians (``--warmup``/``--rep`` ms, L2 flushed between
calls), flashtile and SDPA in the same run. The backward is not timed alone: bwd =
(fwd+bwd) − fwd, as ``python -m flashtile bench`` does. TFLOP/s count the useful work:
forward 4·B·H·D·(visible query-key pairs) — causal, window and, for varlen, each real
sequence's own pairs; the padding is not counted, so in table 3 every row shares one
numerator and the rates compare directly; backward 2.5× the forward. SDPA backends tried
(``sdpa_kernel``, one forward+backward first; a refusal is recorded with SDPA's reason):
cuDNN and flash for plain and ``is_causal``; cuDNN, flash and memory-efficient for
dropout; memory-efficient and cuDNN for a float or boolean ``attn_mask``. The fastest by
forward+backward is reported (every timing in the JSON); none accepting, the row says why. The largest output difference from SDPA is a sanity check (bf16;
the ALiBi mask is rounded to bf16 for SDPA); dropout outputs differ by design.

``--smoke`` shrinks every shape so that the code paths run on a CPU in a few minutes (the
Triton kernels under ``TRITON_INTERPRET=1``, SDPA's math backend added to every case).
Meant to run in about three minutes on an H200.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import sys
import warnings
from pathlib import Path
from typing import Callable

import torch

if "--smoke" in sys.argv and not torch.cuda.is_available():
    # before triton is first imported, as in tests/conftest.py: the real kernels, interpreted
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

import flashtile  # noqa: E402
from flashtile import reference  # noqa: E402
from flashtile.cli.bench import BWD_FLOPS_FACTOR, BWD_METHOD, environment, failure_reason, make_timer  # noqa: E402

HEAD_DIM, DTYPE = 128, torch.bfloat16
SOFTCAP, DROPOUT_P = 30.0, 0.1
SDPA_PLAIN = (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION)
SDPA_DROPOUT = (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION)
SDPA_MASK = (SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION)
NO_WINDOW = (-1, -1)


@dataclasses.dataclass(frozen=True)
class Sizes:
    window_seqlen: int
    window_nheads: int
    windows: tuple[tuple[int, int], ...]
    variant_seqlen: int
    variant_batch: int
    variant_nheads: int
    variant_window: tuple[int, int]
    varlen_count: int
    varlen_max: int
    varlen_nheads: int


FULL = Sizes(16384, 16, ((512, 0), (4096, 0)), 4096, 4, 16, (256, 256), 64, 4096, 16)
SMOKE = Sizes(128, 2, ((16, 0), (64, 0)), 64, 2, 2, (8, 8), 4, 64, 2)


# ----------------------------------------------------------------------------------------------
# Measuring. A record: status "ok" with fwd_ms, fwd_bwd_ms, bwd_ms, fwd_tflops, bwd_tflops
# (and for SDPA the backend used, the others timed and the refusals), or "skipped"/"failed"
# with the reason.


class Bench:
    """The device, the timer, and the SDPA backends tried per case."""

    def __init__(self, device: str, warmup_ms: float, rep_ms: float, smoke: bool):
        self.device = device
        self.timer = make_timer(device, warmup_ms, rep_ms)
        # On a CPU only SDPA's math backend takes masks and dropout: added so that the smoke
        # run goes through every SDPA path; never on the GPU, where it is never the fastest.
        self.extra_backends = (SDPBackend.MATH,) if smoke and device != "cuda" else ()

    def time(self, forward, grad_inputs, dout, flops: float) -> dict:
        """fwd and fwd+bwd medians of ``forward()``, gradients for ``grad_inputs``."""
        def forward_backward():
            torch.autograd.grad(forward(), grad_inputs, dout)

        forward_backward()  # the first call compiles the kernels
        record = dict(status="ok", fwd_ms=self.timer(forward), fwd_bwd_ms=self.timer(forward_backward))
        record["bwd_ms"] = record["fwd_bwd_ms"] - record["fwd_ms"]
        record["fwd_tflops"] = flops / (record["fwd_ms"] * 1e9)
        # timing noise can make bwd ≤ 0 on tiny shapes: no rate then
        record["bwd_tflops"] = BWD_FLOPS_FACTOR * flops / (record["bwd_ms"] * 1e9) if record["bwd_ms"] > 0 else None
        return record

    def time_ours(self, forward, grad_inputs, dout, flops: float) -> dict:
        """As ``time``; a failure is recorded (and printed) so that the rest of the run still happens."""
        try:
            return self.time(forward, grad_inputs, dout, flops)
        except Exception as error:
            _progress(f"FAILED: {type(error).__name__}: {error}")
            return dict(status="failed", reason=f"{type(error).__name__}: {error}")

    def time_sdpa(self, backends, forward, grad_inputs, dout, flops: float) -> dict:
        """Every backend that takes the case (one fwd+bwd first) timed; the fastest by fwd+bwd reported."""
        timed, refused = {}, {}
        for backend in (*backends, *self.extra_backends):
            with warnings.catch_warnings(record=True) as caught, sdpa_kernel(backend):
                warnings.simplefilter("always")
                try:
                    torch.autograd.grad(forward(), grad_inputs, dout)
                except RuntimeError as error:
                    refused[backend.name] = failure_reason(error, caught)
                    continue
                timed[backend.name] = self.time(forward, grad_inputs, dout, flops)
        if not timed:
            return dict(status="skipped", reason="; ".join(f"{name}: {why}" for name, why in refused.items()),
                        refused=refused)
        best = min(timed, key=lambda name: timed[name]["fwd_bwd_ms"])
        return dict(timed[best], backend=best, all_backends=timed, refused=refused)


def output(forward: Callable, record: dict, transpose: bool) -> torch.Tensor:
    """``forward()``'s output without autograd, under the SDPA backend that ``record`` used if any;
    ``transpose`` swaps dims 1 and 2 (SDPA's layout ↔ flash-attn's)."""
    backend = sdpa_kernel(getattr(SDPBackend, record["backend"])) if "backend" in record else contextlib.nullcontext()
    with torch.no_grad(), backend:
        out = forward()
    return out.transpose(1, 2) if transpose else out


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def visible_pairs(seqlen_q: int, seqlen_k: int, causal: bool, window, device) -> int:
    return int(reference.visible_mask(seqlen_q, seqlen_k, causal, window, device=device).sum())


def attention_flops(batch: int, nheads: int, pairs: int) -> float:
    return 4.0 * batch * nheads * HEAD_DIM * pairs


def alibi_slopes(nheads: int, device) -> torch.Tensor:
    """The ALiBi paper's geometric slopes 2^(−8h/H), h = 1..H, float32 (nheads,)."""
    return torch.exp2(-8.0 * torch.arange(1, nheads + 1, device=device) / nheads)


def random_inputs(seed: int, *shape, device):
    """q, k, v (requiring grad) and dout, random normal bf16 of ``shape``."""
    g = torch.Generator(device=device).manual_seed(seed)
    q, k, v, dout = (torch.randn(*shape, device=device, dtype=DTYPE, generator=g) for _ in range(4))
    return q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), dout


def sdpa_layout(q, k, v, dout):
    """(batch, seqlen, nheads, headdim) → SDPA's (batch, nheads, seqlen, headdim), contiguous, new leaves."""
    qt, kt, vt = (t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v))
    return qt, kt, vt, dout.transpose(1, 2).contiguous()


# ----------------------------------------------------------------------------------------------
# Table 1: sliding window


def sliding_window(bench: Bench, sizes: Sizes) -> list[dict]:
    device, n, nheads = bench.device, sizes.window_seqlen, sizes.window_nheads
    q, k, v, dout = random_inputs(1, 1, n, nheads, HEAD_DIM, device=device)
    causal_pairs = visible_pairs(n, n, True, NO_WINDOW, device)
    rows = []
    for window in (*sizes.windows, NO_WINDOW):
        _progress(f"sliding window {window}, seqlen {n}")
        pairs = visible_pairs(n, n, True, window, device)
        record = bench.time_ours(lambda window=window: flashtile.flash_attn_func(q, k, v, causal=True,
                                                                                   window_size=window),
                                 (q, k, v), dout, attention_flops(1, nheads, pairs))
        rows.append(dict(record, provider="flashtile", window=list(window), pairs_fraction=pairs / causal_pairs))
    _progress(f"sliding window: SDPA causal, seqlen {n}")
    qt, kt, vt, doutt = sdpa_layout(q, k, v, dout)
    record = bench.time_sdpa(SDPA_PLAIN, lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=True),
                             (qt, kt, vt), doutt, attention_flops(1, nheads, causal_pairs))
    rows.append(dict(record, provider="sdpa", window=list(NO_WINDOW), pairs_fraction=1.0))
    return rows


def sliding_window_table(rows: list[dict], sizes: Sizes) -> list[str]:
    plain = next(r for r in rows if r["provider"] == "flashtile" and r["window"] == list(NO_WINDOW))
    lines = [f"## 1. Sliding window: seqlen {sizes.window_seqlen}, batch 1, {sizes.window_nheads} heads, "
             f"head dim {HEAD_DIM}, bf16, causal", "",
             "| provider | window | visible pairs ÷ causal's | fwd ms | fwd+bwd ms | bwd ms | TFLOP/s fwd / bwd | "
             "time ÷ flashtile causal's, fwd / fwd+bwd |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        name = "flashtile" if r["provider"] == "flashtile" else f"SDPA {_backend(r)}"
        window = "none (plain causal)" if r["window"] == list(NO_WINDOW) else f"({r['window'][0]}, {r['window'][1]})"
        lines.append(_row(name, window, f"{r['pairs_fraction']:.3f}", *_times(r), _time_ratios(r, plain)))
    return lines


# ----------------------------------------------------------------------------------------------
# Table 2: each variant


@dataclasses.dataclass
class Case:
    name: str
    ours: Callable  # → out
    takes_sdpa_layout: bool  # ours is flashtile.attention (SDPA's layout), else flash-attn's layout
    sdpa: tuple | str  # (backends, forward) or why SDPA cannot run the case
    window: tuple[int, int] = NO_WINDOW
    bias_grad: torch.Tensor | None = None  # the bias, when its gradient is wanted


def variants(bench: Bench, sizes: Sizes) -> list[dict]:
    device, n, batch, nheads = bench.device, sizes.variant_seqlen, sizes.variant_batch, sizes.variant_nheads
    q, k, v, dout = random_inputs(2, batch, n, nheads, HEAD_DIM, device=device)
    random_bias = torch.randn(1, nheads, n, n, device=device, dtype=DTYPE,
                              generator=torch.Generator(device=device).manual_seed(4))  # [1, H, N, N]
    qt, kt, vt, doutt = sdpa_layout(q, k, v, dout)
    slopes = alibi_slopes(nheads, device)
    rows = []
    for causal in (False, True):
        visible = reference.visible_mask(n, n, causal, device=device)  # [N, N]
        distance = (torch.arange(n, device=device)[:, None] - torch.arange(n, device=device)[None, :]).abs()
        # ALiBi as SDPA can take it: [1, H, N, N], rounded to bf16 as SDPA's fused kernels want
        alibi_mask = (-slopes[:, None, None] * distance).masked_fill(~visible, -math.inf).to(DTYPE)[None]
        bias = random_bias.masked_fill(~visible, -math.inf)  # [1, H, N, N]
        bias_grad = bias.clone().requires_grad_()
        del distance, visible

        def flash(**options):
            return lambda: flashtile.flash_attn_func(q, k, v, causal=causal, **options)

        def sdpa(**options):
            return lambda: F.scaled_dot_product_attention(qt, kt, vt, **options)

        def attention(mask):
            return lambda: flashtile.attention(qt, kt, vt, attn_mask=mask)

        cases = [
            Case("plain", flash(), False, (SDPA_PLAIN, sdpa(is_causal=causal))),
            Case(f"softcap {SOFTCAP:g}", flash(softcap=SOFTCAP), False, "SDPA has no softcap"),
            Case("ALiBi", flash(alibi_slopes=slopes), False, (SDPA_MASK, sdpa(attn_mask=alibi_mask))),
            Case(f"dropout {DROPOUT_P:g}", flash(dropout_p=DROPOUT_P), False,
                 (SDPA_DROPOUT, sdpa(dropout_p=DROPOUT_P, is_causal=causal))),
            Case(f"window {sizes.variant_window}", flash(window_size=sizes.variant_window), False,
                 "SDPA has no sliding window", window=sizes.variant_window),
            Case("float bias", attention(bias), True, (SDPA_MASK, sdpa(attn_mask=bias))),
            Case("float bias, requires_grad", attention(bias_grad), True, (SDPA_MASK, sdpa(attn_mask=bias_grad)),
                 bias_grad=bias_grad),
        ]
        for case in cases:
            _progress(f"variant {case.name}, {'causal' if causal else 'non-causal'}, seqlen {n}")
            flops = attention_flops(batch, nheads, visible_pairs(n, n, causal, case.window, device))
            extra = () if case.bias_grad is None else (case.bias_grad,)
            ours_inputs, ours_dout = ((qt, kt, vt), doutt) if case.takes_sdpa_layout else ((q, k, v), dout)
            row = dict(variant=case.name, causal=causal,
                       flashtile=bench.time_ours(case.ours, (*ours_inputs, *extra), ours_dout, flops))
            if isinstance(case.sdpa, str):
                row["sdpa"] = dict(status="skipped", reason=case.sdpa)
            else:
                backends, theirs = case.sdpa
                row["sdpa"] = bench.time_sdpa(backends, theirs, (qt, kt, vt, *extra), doutt, flops)
                # dropout masks differ by design; otherwise a check that both computed the same thing
                if "dropout" not in case.name and row["flashtile"]["status"] == row["sdpa"]["status"] == "ok":
                    row["max_diff_vs_sdpa"] = max_diff(output(case.ours, {}, not case.takes_sdpa_layout),
                                                       output(theirs, row["sdpa"], False))
            rows.append(row)
        del alibi_mask, bias, bias_grad
    return rows


def variants_table(rows: list[dict], sizes: Sizes) -> list[str]:
    lines = [f"## 2. Variants: seqlen {sizes.variant_seqlen}, batch {sizes.variant_batch}, "
             f"{sizes.variant_nheads} heads, head dim {HEAD_DIM}, bf16", ""]
    for causal in (False, True):
        part = [r for r in rows if r["causal"] == causal]
        plain = part[0]["flashtile"]
        lines += [f"### {'causal' if causal else 'non-causal'}", "",
                  "| variant | flashtile ms, fwd / fwd+bwd | TFLOP/s fwd / bwd | time ÷ plain's, fwd / fwd+bwd | "
                  "SDPA ms, fwd / fwd+bwd | SDPA backend | flashtile's speed ÷ SDPA's, fwd / fwd+bwd | "
                  "max abs Δ out vs SDPA |",
                  "|---|---:|---:|---:|---:|---|---:|---:|"]
        for r in part:
            ours, theirs = r["flashtile"], r["sdpa"]
            diff = f"{r['max_diff_vs_sdpa']:.2g}" if "max_diff_vs_sdpa" in r else "—"
            lines.append(_row(r["variant"], _ms_pair(ours), _rates(ours), _time_ratios(ours, plain),
                              _ms_pair(theirs), _backend(theirs), _time_ratios(theirs, ours), diff))
        lines.append("")
    lines.append(f"With causal, the window is ({sizes.variant_window[0]}, 0). Causal with a bias or ALiBi in SDPA, "
                 "and with the bias in flashtile.attention: the causal mask folded into the bias (attn_mask excludes "
                 "is_causal), so both compute every block; TFLOP/s count the visible pairs. Dropout outputs differ "
                 "by design (different generators), so no Δ.")
    return lines


# ----------------------------------------------------------------------------------------------
# Table 3: varlen against the padded batch


def varlen(bench: Bench, sizes: Sizes) -> dict:
    device, count, nheads = bench.device, sizes.varlen_count, sizes.varlen_nheads
    lengths = torch.randint(1, sizes.varlen_max + 1, (count,), generator=torch.Generator().manual_seed(0))
    max_len, real_tokens = int(lengths.max()), int(lengths.sum())
    cu_seqlens = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).to(device, torch.int32)
    real_pairs = sum(visible_pairs(n, n, True, NO_WINDOW, device) for n in lengths.tolist())
    flops = attention_flops(1, nheads, real_pairs)  # the real sequences' work, the numerator of every row

    q_pad, k_pad, v_pad, dout_pad = random_inputs(3, count, max_len, nheads, HEAD_DIM, device=device)
    is_real = torch.arange(max_len, device=device)[None, :] < lengths.to(device)[:, None]  # [B, L], right padding
    # the packed batch: the padded batch's real tokens, in order; [total, H, D]
    q, k, v, dout = (t.detach()[is_real] for t in (q_pad, k_pad, v_pad, dout_pad))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    qt, kt, vt, doutt = sdpa_layout(q_pad, k_pad, v_pad, dout_pad)
    causal = reference.causal_mask(max_len, max_len, device=device)  # [L, L]
    key_padding_causal = is_real[:, None, None, :] & causal  # [B, 1, L, L], True = may attend

    def packed():
        return flashtile.flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, causal=True)

    _progress(f"varlen: flashtile packed, {count} sequences, {real_tokens} tokens")
    rows = [dict(bench.time_ours(packed, (q, k, v), dout, flops), name="flashtile varlen, packed")]
    expected = output(packed, {}, False) if rows[0]["status"] == "ok" else None
    runs = [
        ("flashtile flash_attn_func, padded", None,
         lambda: flashtile.flash_attn_func(q_pad, k_pad, v_pad, causal=True), (q_pad, k_pad, v_pad), dout_pad),
        ("SDPA, padded, is_causal", SDPA_PLAIN,
         lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=True), (qt, kt, vt), doutt),
        ("SDPA, padded, key-padding + causal mask", SDPA_MASK,
         lambda: F.scaled_dot_product_attention(qt, kt, vt, attn_mask=key_padding_causal), (qt, kt, vt), doutt),
    ]
    for name, backends, forward, inputs, grad_out in runs:
        _progress(f"varlen: {name}")
        if backends is None:
            record = bench.time_ours(forward, inputs, grad_out, flops)
        else:
            record = bench.time_sdpa(backends, forward, inputs, grad_out, flops)
        if record["status"] == "ok" and expected is not None:
            record["max_diff_vs_varlen"] = max_diff(output(forward, record, backends is not None)[is_real], expected)
        rows.append(dict(record, name=name))
    return dict(count=count, max_len=max_len, varlen_max=sizes.varlen_max, nheads=nheads, real_tokens=real_tokens,
                padded_tokens=count * max_len, real_pairs=real_pairs,
                padded_pairs=count * visible_pairs(max_len, max_len, True, NO_WINDOW, device),
                lengths=lengths.tolist(), rows=rows)


def varlen_table(result: dict) -> list[str]:
    packed = result["rows"][0]
    lines = [f"## 3. Varlen: {result['count']} sequences, lengths uniform in 1..{result['varlen_max']} (seed 0), "
             f"{result['nheads']} heads, head dim {HEAD_DIM}, bf16, causal", "",
             f"Real tokens {result['real_tokens']}; the padded batch ({result['count']}, {result['max_len']}) has "
             f"{result['padded_tokens']}: padded ÷ real tokens = "
             f"**{result['padded_tokens'] / result['real_tokens']:.2f}**, "
             f"padded ÷ real causal pairs = **{result['padded_pairs'] / result['real_pairs']:.2f}**. "
             "TFLOP/s count the real sequences' work only, the same numerator in every row.", "",
             "| run | fwd ms | fwd+bwd ms | bwd ms | TFLOP/s (real work) fwd / bwd | SDPA backend | "
             "varlen's speed-up over it, fwd / fwd+bwd | max abs Δ out vs varlen (real rows) |",
             "|---|---:|---:|---:|---:|---|---:|---:|"]
    for r in result["rows"]:
        diff = f"{r['max_diff_vs_varlen']:.2g}" if "max_diff_vs_varlen" in r else "—"
        lines.append(_row(r["name"], *_times(r), _backend(r), _time_ratios(r, packed), diff))
    return lines


# ----------------------------------------------------------------------------------------------
# Markdown cells


def _row(*cells) -> str:
    return "| " + " | ".join(cells) + " |"


def _ok(*records) -> bool:
    return all(r["status"] == "ok" for r in records)


def _times(r: dict) -> list[str]:
    """[fwd ms, fwd+bwd ms, bwd ms, TFLOP/s], or the reason in the first cell."""
    if not _ok(r):
        return [f"{r['status']}: {r['reason']}", "—", "—", "—"]
    return [f"{r['fwd_ms']:.3f}", f"{r['fwd_bwd_ms']:.3f}", f"{r['bwd_ms']:.3f}", _rates(r)]


def _ms_pair(r: dict) -> str:
    if r["status"] == "skipped":  # the reason is in the backend's cell
        return "—"
    return f"{r['fwd_ms']:.3f} / {r['fwd_bwd_ms']:.3f}" if _ok(r) else f"{r['status']}: {r['reason']}"


def _rates(r: dict) -> str:
    if not _ok(r):
        return "—"
    bwd = "—" if r["bwd_tflops"] is None else f"{r['bwd_tflops']:.0f}"
    return f"{r['fwd_tflops']:.0f} / {bwd}"


def _time_ratios(r: dict, base: dict) -> str:
    """r's times ÷ base's: how many times slower r is."""
    if not _ok(r, base):
        return "—"
    return f"{r['fwd_ms'] / base['fwd_ms']:.2f} / {r['fwd_bwd_ms'] / base['fwd_bwd_ms']:.2f}"


def _backend(r: dict) -> str:
    """The SDPA backend used, those refused; for a skipped case, why."""
    if r["status"] == "skipped":
        return f"skipped: {r['reason']}"
    refused = ", ".join(name.lower() for name in r.get("refused", {}))
    return r.get("backend", "—").lower() + (f" (refused: {refused})" if refused else "")


def _progress(text: str):
    print(f"… {text}", file=sys.stderr, flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, help="write the markdown tables to this file")
    parser.add_argument("--json", type=Path, help="write every measurement to this file")
    parser.add_argument("--warmup", type=float, default=10.0, help="do_bench warmup per timing, ms (default 10)")
    parser.add_argument("--rep", type=float, default=50.0, help="do_bench repetitions per timing, ms (default 50)")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes, to check the code paths (on a CPU: the Triton interpreter, 1 ms budgets)")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device != "cuda" and not args.smoke:
        parser.error("the benchmark needs a CUDA device; --smoke runs tiny shapes on the CPU")
    sizes = SMOKE if args.smoke else FULL
    warmup, rep = (1.0, 1.0) if device != "cuda" else (args.warmup, args.rep)
    bench = Bench(device, warmup, rep, args.smoke)
    torch.manual_seed(0)  # flashtile's dropout seeds come from PyTorch's generator

    env = environment(device)
    timer = ("triton.testing.do_bench median" if device == "cuda" else "time.perf_counter median") + \
        f" (warmup {warmup:g} ms, rep {rep:g} ms)"
    flops_rule = "fwd 4·B·H·D·(visible query-key pairs; for varlen the real sequences' only), bwd 2.5× fwd"
    results = dict(environment=env, settings=dict(timer=timer, bwd_method=BWD_METHOD, flops=flops_rule,
                                                  smoke=args.smoke, sizes=dataclasses.asdict(sizes)))
    results["sliding_window"] = sliding_window(bench, sizes)
    results["variants"] = variants(bench, sizes)
    results["varlen"] = varlen(bench, sizes)

    versions = f"torch {env['torch']}, triton {env['triton']}, python {env['python']}" + (
        f", CUDA {env['cuda']}, cuDNN {env['cudnn']}, driver {env['driver']}" if device == "cuda" else "")
    report = "\n".join([
        f"# flashtile's variants and varlen vs SDPA on {env['device']}, {env['date']}", "",
        f"{versions}. Timer: {timer}; {BWD_METHOD}. TFLOP/s: {flops_rule}. SDPA: the fastest backend "
        "that takes the case, by fwd+bwd (all timings and refusals in the JSON)."
        + (" **Smoke run: tiny shapes, the numbers mean nothing.**" if args.smoke else ""), "",
        *sliding_window_table(results["sliding_window"], sizes), "",
        *variants_table(results["variants"], sizes), "",
        *varlen_table(results["varlen"]), "",
    ])
    print(report)
    if args.out:
        args.out.write_text(report)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    failed = [r for r in (*results["sliding_window"], *(r["flashtile"] for r in results["variants"]),
                          *results["varlen"]["rows"]) if r["status"] == "failed"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
