"""One forward and one backward of flashtile and of SDPA cuDNN per case, inside a CUDA profiler range,
for Nsight Compute to read the hardware counters of each kernel: the profiles behind NOTES.md's
explanation of the bar rows still short.

    ncu --clock-control none --profile-from-start off --set detailed -o rows \
        python3 benchmarks/profile_rows.py [--cases d128-16384,d64c-2048]
    ncu -i rows.ncu-rep --csv --page raw > rows_raw.csv
    python3 benchmarks/profile_rows.py --summarise rows_raw.csv [--cases ...]   # the table in NOTES.md
    python3 benchmarks/profile_rows.py --summarise-source source.csv  # stall samples per SASS instruction

A case is ``d<head dim>[c]-<seqlen>`` (``c``: causal) on the standard shapes: bf16,
batch·seqlen = 16384, nheads·head dim = 2048. Everything before the range (allocation, compilation,
warm-up calls) is left out of the profile.
"""

from __future__ import annotations

import argparse
import csv
import math

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from flashtile import flash_attn_func

DEFAULT_CASES = "d128-16384,d128c-16384,d64-16384,d64c-16384,d128c-1024,d64-1024,d64c-2048"


# (column, Nsight Compute metric); percentages are of the peak sustained over the kernel's duration
SUMMARY_METRICS = (
    ("ms", "gpu__time_duration.sum"),
    ("SM GHz", "sm__cycles_elapsed.avg.per_second"),
    ("tensor pipe %", "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_elapsed"),
    ("issue %", "sm__issue_active.avg.pct_of_peak_sustained_elapsed"),
    ("XU (exp2) %", "sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_elapsed"),
    ("DRAM read %", "dram__bytes_read.sum.pct_of_peak_sustained_elapsed"),
    ("L2 hit %", "lts__t_sector_hit_rate.pct"),
    ("registers", "launch__registers_per_thread"),
    ("spill instr. (M)", "sass__inst_executed_register_spilling"),
    ("instr. (M)", "smsp__inst_executed.sum"),
    ("shared wavefronts beyond ideal (M)", "derived__memory_l1_wavefronts_shared_excessive"),  # bank conflicts
)
STALL_PREFIX = "smsp__pcsamp_warps_issue_stalled_"


def parse_case(case: str) -> tuple[int, bool, int]:
    dims, seqlen = case.split("-")
    return int(dims[1:].rstrip("c")), dims.endswith("c"), int(seqlen)


def _number(text: str) -> float:
    return float(text.replace(",", "") or 0)


def summarise(raw_csv: str, cases: list[str]) -> None:
    """A markdown table of ``SUMMARY_METRICS`` and the three commonest stall reasons per kernel, the
    kernels grouped by case: each case's flashtile kernels come first, then cuDNN's."""
    with open(raw_csv) as f:
        header, _units, *rows = csv.reader(f)
    column = {name: i for i, name in enumerate(header)}
    stalls = [name for name in header if name.startswith(STALL_PREFIX) and not name.endswith("_not_issued")]
    print("| case | kernel | " + " | ".join(name for name, _ in SUMMARY_METRICS) + " | top stall reasons |")
    print("| --- " * (len(SUMMARY_METRICS) + 3) + "|")
    case_index, previous_was_cudnn = 0, False
    for row in rows:
        kernel = row[column["Kernel Name"]]
        if kernel.startswith("void at::"):  # PyTorch's own (fills), not attention
            continue
        is_cudnn = "cudnn" in kernel
        if previous_was_cudnn and not is_cudnn:
            case_index += 1
        previous_was_cudnn = is_cudnn
        values = []
        for name, metric in SUMMARY_METRICS:
            value = _number(row[column[metric]])
            values.append(f"{value / 1e6:.3g}" if "(M)" in name else f"{value:.3g}")
        samples = {name.removeprefix(STALL_PREFIX): _number(row[column[name]]) for name in stalls}
        total = sum(samples.values()) or 1
        top = sorted(samples.items(), key=lambda item: -item[1])[:3]
        short_name = kernel.split("(")[0].removeprefix("void ")[:48]
        print(f"| {cases[case_index]} | {short_name} | " + " | ".join(values) + " | "
              + ", ".join(f"{reason} {count / total:.0%}" for reason, count in top) + " |")


def summarise_source(source_csv: str, top: int = 20) -> None:
    """Warp-stall samples per SASS instruction (``ncu -i REP --page source --csv --print-source sass``),
    summed where they land: the costliest instructions, then by opcode and by ``setmaxnreg`` region (a
    warp-specialised kernel's partitions each begin with a ``USETMAXREG``). Columns are found by name,
    since Nsight Compute's versions differ: the total is the first "Warp Stall Sampling (All Samples)"
    column, each other column with "stall" in its name is a reason."""
    with open(source_csv) as f:
        rows = list(csv.reader(f))
    start = next(i for i, row in enumerate(rows) if "Source" in row and any("Sampling" in c for c in row))
    header, body = rows[start], [row for row in rows[start + 1:] if len(row) == len(rows[start])]
    column = {name: i for i, name in enumerate(header)}
    total_name = next(c for c in header if c.startswith("Warp Stall Sampling (All"))
    reasons = [c for c in header if "stall" in c.lower() and "Sampling" not in c]
    region, records = 0, []
    for row in body:
        value = row[column[total_name]].replace(",", "").replace(".", "")
        if value and not value.isdigit():
            continue  # a units row, or a kernel's name between two kernels' pages (no samples: empty)
        text = row[column["Source"]].strip()
        if "USETMAXREG" in text:
            region += 1
        opcode = text.split()[1] if text.startswith("@") and len(text.split()) > 1 else (text.split() or ["?"])[0]
        stalls = {r: _number(row[column[r]]) for r in reasons}
        records.append((_number(row[column[total_name]]), region, opcode.split(".")[0], text, stalls))
    total = sum(r[0] for r in records) or 1
    print(f"{len(records)} instructions, {total:.0f} samples ({total_name}); region = setmaxnreg partition")
    print(f"| share | region | instruction | top reasons |\n| --- | --- | --- | --- |")
    for samples, region, _, text, stalls in sorted(records, key=lambda r: -r[0])[:top]:
        named = sorted(stalls.items(), key=lambda item: -item[1])[:2]
        print(f"| {samples / total:.1%} | {region} | `{text[:70]}` | "
              + ", ".join(f"{name} {count / (samples or 1):.0%}" for name, count in named if count) + " |")
    for key, title in ((2, "opcode"), (1, "region")):
        sums: dict = {}
        for record in records:
            sums[record[key]] = sums.get(record[key], 0) + record[0]
        print(f"by {title}: " + ", ".join(f"{name} {value / total:.1%}"
                                           for name, value in sorted(sums.items(), key=lambda item: -item[1])[:12]))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default=DEFAULT_CASES)
    parser.add_argument("--summarise", metavar="RAW_CSV", help="print the table of an exported profile instead")
    parser.add_argument("--summarise-source", metavar="SOURCE_CSV",
                        help="print where an exported source page's warp-stall samples land instead")
    args = parser.parse_args(argv)
    if args.summarise_source:
        summarise_source(args.summarise_source)
        return
    if args.summarise:
        summarise(args.summarise, args.cases.split(","))
        return
    for case in args.cases.split(","):
        head_dim, causal, seqlen = parse_case(case)
        batch, nheads = max(1, 16384 // seqlen), 2048 // head_dim
        torch.manual_seed(0)
        q, k, v = (torch.randn(batch, seqlen, nheads, head_dim, device="cuda", dtype=torch.bfloat16,
                               requires_grad=True) for _ in range(3))
        dout = torch.randn_like(q)
        qt, kt, vt = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v))
        doutt = dout.transpose(1, 2)
        scale = 1 / math.sqrt(head_dim)

        # autograd.grad: backward() would add three gradient accumulations to the profile
        def flashtile_step(q=q, k=k, v=v, dout=dout, scale=scale, causal=causal):
            torch.autograd.grad(flash_attn_func(q, k, v, softmax_scale=scale, causal=causal), (q, k, v), dout)

        def cudnn_step(q=qt, k=kt, v=vt, dout=doutt, scale=scale, causal=causal):
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                out = F.scaled_dot_product_attention(q, k, v, scale=scale, is_causal=causal)
            torch.autograd.grad(out, (q, k, v), dout)

        for step in (flashtile_step, cudnn_step):
            for _ in range(3):  # compile and warm up outside the profiled range
                step()
            torch.cuda.synchronize()
            torch.cuda.nvtx.range_push(f"{step.__name__.removesuffix('_step')} {case}")
            torch.cuda.profiler.start()
            step()
            torch.cuda.synchronize()
            torch.cuda.profiler.stop()
            torch.cuda.nvtx.range_pop()
        print(f"profiled {case}", flush=True)


if __name__ == "__main__":
    main()
