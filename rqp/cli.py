"""Argument types shared by the command-line tools (argparse reports their messages)."""

from __future__ import annotations

import argparse
import math
import os
import re


def number(kind: type, *, minimum: float, inclusive: bool = True, what: str = "a number",
           maximum: float | None = None):
    """An argparse type: ``kind`` (int or float), finite, >= (or >) ``minimum`` (and <=
    ``maximum``, if given)."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or (kind is float and not math.isfinite(value)) or \
                (value < minimum if inclusive else value <= minimum) or \
                (maximum is not None and value > maximum):
            low, high = (str(v) if kind is int else f"{v:g}" for v in (minimum, maximum or 0))
            bound = f">= {low}" if inclusive else f"> {low}"
            if maximum is not None:
                bound = f"in {low}..{high}"
            raise argparse.ArgumentTypeError(f"expected {what} {bound}, got {text!r}")
        return value
    return parse


positive_int = number(int, minimum=1, what="a whole number")
count = number(int, minimum=0, what="a whole number")
positive_seconds = number(float, minimum=0, inclusive=False, what="a number of seconds")
seconds = number(float, minimum=0, what="a number of seconds")
#: A sending MCA's window (frames in flight per connection), as .rqprc's ``window`` takes it.
window = number(int, minimum=1, maximum=65536, what="a window of frames")
#: A System V message type to put with: 1 to LONG_MAX (msgsnd's mtype is a C long).
mtype = number(int, minimum=1, maximum=(1 << 63) - 1, what="a System V message type")
#: Which message msgrcv takes (its msgtyp, a C long): 0 the first, N the first of type N, -N
#: the first of the lowest type up to N.
msgtyp = number(int, minimum=-((1 << 63) - 1), maximum=(1 << 63) - 1,
                what="a msgrcv type (0, N or -N)")


def key_counts(text: str) -> list[int]:
    """An argparse type: queue key counts for a benchmark, comma-separated whole numbers >= 1
    (``1,1000``), each once."""
    parts = text.split(",")
    counts = [int(part) for part in parts if re.fullmatch(r"[0-9]+", part)]
    if len(counts) != len(parts) or not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"expected whole numbers >= 1, comma-separated (e.g. "
                                         f"1,1000), got {text!r}")
    if len(set(counts)) != len(counts):
        raise argparse.ArgumentTypeError(f"each count once, got {text!r}")
    return counts


def output_file(text: str) -> str:
    """An argparse type: a file to write at the end of a run (figures), checked now so that a
    long run is not lost to a bad path: not a directory, in a directory that can be written."""
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is a directory: name a file in it")
    parent = os.path.dirname(os.path.abspath(text))
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK):
        raise argparse.ArgumentTypeError(f"{text!r}: its directory does not exist or cannot be "
                                         "written")
    return text


def listen_address(text: str) -> str:
    """An argparse type: ``HOST:PORT``, ``HOST``, ``[v6]:PORT`` or ``:PORT`` (all addresses),
    checked now and given back as text (a missing port is the configuration's)."""
    from rqp.config import BadValueError, parse_host

    full = "0.0.0.0" + text if text.startswith(":") else text
    try:
        parse_host(full)
    except BadValueError as exc:
        raise argparse.ArgumentTypeError(f"bad value {text!r}: {exc.expected}") from None
    return full


LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
LOG_LEVEL_ENV = "RQP_LOG_LEVEL"


class _FromEnvironment(str):
    """A default taken from the environment, so that an error about it can say so."""


def log_level(text: str) -> str:
    """An argparse type: one of :data:`LOG_LEVELS`, any case (``verbose`` is refused, not
    silently taken as INFO)."""
    if text.lower() not in LOG_LEVELS:
        where = f" (from ${LOG_LEVEL_ENV})" if isinstance(text, _FromEnvironment) else ""
        raise argparse.ArgumentTypeError(
            f"unknown log level {str(text)!r}{where}: use one of {', '.join(LOG_LEVELS)}")
    return text.upper()


def add_version(parser: argparse.ArgumentParser) -> None:
    """``--version``: the installed package's version, the same for every command (an
    operator asking which agents a host runs)."""
    from rqp import VERSION_TEXT

    parser.add_argument("--version", action="version", version=f"%(prog)s (rqp) {VERSION_TEXT}")


def add_log_level(parser: argparse.ArgumentParser) -> None:
    """``--log-level``, default ``$RQP_LOG_LEVEL`` or info, and ``--log-format``, default
    ``$RQP_LOG_FORMAT`` or text: the same options for every agent. A bad variable is refused
    like a bad option, naming the variable (argparse checks a string default with the
    option's type after the command line)."""
    parser.add_argument("--log-level", type=log_level, metavar="LEVEL",
                        default=_FromEnvironment(os.environ.get(LOG_LEVEL_ENV, "info")),
                        help=f"{', '.join(LOG_LEVELS)} (default: ${LOG_LEVEL_ENV}, else info)")
    parser.add_argument("--log-format", type=log_format, metavar="FORMAT",
                        default=_FromEnvironment(os.environ.get(LOG_FORMAT_ENV, "text")),
                        help=f"{' or '.join(LOG_FORMATS)}: a readable line, or one JSON object "
                        f"a line with the event's fields (default: ${LOG_FORMAT_ENV}, else text)")


LOG_FORMAT_ENV = "RQP_LOG_FORMAT"
LOG_FORMATS = ("text", "json")


def log_format(text: str) -> str:
    if text.lower() not in LOG_FORMATS:
        where = f" (from ${LOG_FORMAT_ENV})" if isinstance(text, _FromEnvironment) else ""
        raise argparse.ArgumentTypeError(
            f"unknown log format {str(text)!r}{where}: use one of {', '.join(LOG_FORMATS)}")
    return text.lower()
