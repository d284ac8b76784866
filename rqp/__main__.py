"""``python -m rqp --include``: the directory holding ``rqp.h``, for ``cc -I``."""

from __future__ import annotations

import argparse
import sys

from rqp import get_include


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m rqp", description="Facts about the installed rqp package for C builds.")
    parser.add_argument("--include", action="store_true",
                        help="print the directory that holds rqp.h (for cc -I)")
    args = parser.parse_args(argv)
    if not args.include:
        parser.print_help(sys.stderr)
        return 2
    print(get_include())
    return 0


if __name__ == "__main__":
    sys.exit(main())
