"""Command line: ``dynsnap demo`` (and later controller, agent, status, suspend, wake). Top layer."""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dynsnap", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="local control plane + Dynamo: serve, pin, summarise, tear down")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "demo":
        from dynsnap.demo import run_demo

        rc: int = run_demo()
        return rc
    return 2


if __name__ == "__main__":
    sys.exit(main())
