"""Command line: ``python -m flashtile check``."""

import argparse
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flashtile", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("check", help="verify forward and backward on this device and show memory vs N")
    args = parser.parse_args(argv)
    if args.command == "check":
        from .check import run_check

        return 0 if run_check() else 1
    return 2


if __name__ == "__main__":
    sys.exit(main())
