"""Command line: ``python -m flashtile check`` and ``python -m flashtile bench``."""

import argparse

from . import bench, check

__all__ = ["main"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flashtile", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    check_parser = sub.add_parser(
        "check", help="verify accuracy on every path this machine has, and memory vs N (--quick: seconds)",
        description=check.DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    check.add_arguments(check_parser)
    bench_parser = sub.add_parser(
        "bench", help="speed (TFLOP/s on a GPU, GFLOP/s on a CPU, with the spread of repeats) and peak memory "
                 "of flashtile and the attention kernels present",
        description=bench.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bench.add_arguments(bench_parser)
    args = parser.parse_args(argv)
    if args.command == "check":
        return 0 if check.run_check(quick=args.quick, interpret=args.interpret) else 1
    if args.command == "bench":
        return bench.main_bench(args, bench_parser)
    return 2
