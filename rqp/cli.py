"""Argument types shared by the command-line tools (argparse reports their messages)."""

from __future__ import annotations

import argparse
import math


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
