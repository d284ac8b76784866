"""Argument types shared by the command-line tools (argparse reports their messages)."""

from __future__ import annotations

import argparse
import math
import os


def number(kind: type, *, minimum: float, inclusive: bool = True, what: str = "a number"):
    """An argparse type: ``kind`` (int or float), finite, >= (or >) ``minimum``."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not math.isfinite(value) or \
                (value < minimum if inclusive else value <= minimum):
            bound = f">= {minimum:g}" if inclusive else f"> {minimum:g}"
            raise argparse.ArgumentTypeError(f"expected {what} {bound}, got {text!r}")
        return value
    return parse


positive_int = number(int, minimum=1, what="a whole number")
count = number(int, minimum=0, what="a whole number")
positive_seconds = number(float, minimum=0, inclusive=False, what="a number of seconds")

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def log_level(text: str) -> str:
    """An argparse type: one of :data:`LOG_LEVELS`, any case (``verbose`` is refused, not
    silently taken as INFO)."""
    if text.lower() not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(
            f"unknown log level {text!r}: use one of {', '.join(LOG_LEVELS)}")
    return text.upper()


def add_log_level(parser: argparse.ArgumentParser) -> None:
    """``--log-level``, default ``$RQP_LOG_LEVEL`` or info: the same option for every agent."""
    parser.add_argument("--log-level", type=log_level, metavar="LEVEL",
                        default=os.environ.get("RQP_LOG_LEVEL", "info"),
                        help=f"{', '.join(LOG_LEVELS)} (default: $RQP_LOG_LEVEL, else info)")
