"""Command line: ``python -m flashtile check`` and ``python -m flashtile bench``."""

import argparse
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flashtile", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("check", help="verify forward and backward on this device and show memory vs N")
    from .bench import __doc__ as bench_doc, add_arguments, main_bench

    bench = sub.add_parser("bench", help="TFLOP/s and peak memory of flashtile and the attention kernels present",
                           description=bench_doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(bench)
    args = parser.parse_args(argv)
    if args.command == "check":
        from .check import run_check

        return 0 if run_check() else 1
    if args.command == "bench":
        return main_bench(args, bench)
    return 2


if __name__ == "__main__":
    sys.exit(main())
