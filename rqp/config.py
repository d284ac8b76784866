"""Configuration: the sender's ``.rqprc`` and the receiver's YAML file.

All validation happens here. The agents get frozen, fully checked :class:`SenderConfig` and
:class:`ReceiverConfig` objects; every problem raises :class:`~rqp.protocol.errors.ConfigError` with a
message naming the file, the key, the bad value and what was expected, e.g.::

    /home/u/.rqprc: key 'ask_timeout': bad value '-1': expected a positive duration in seconds
    (e.g. 2, 0.5, '500ms', '2s') (line 4)

The value parsers (:func:`parse_duration`, :func:`parse_queue_key`, :func:`parse_host`,
:func:`parse_size`) are public for command-line use; they raise a ``ConfigError`` that is also a
``ValueError`` (so ``argparse`` reports it) and whose message is ``bad value '...': expected ...``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import fnmatch
import functools
import ipaddress
import math
import os
import re
import stat
import types
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from fractions import Fraction
from pathlib import Path
from typing import NoReturn, TypeVar

import yaml

from rqp.protocol.constants import (
    ALL_INTERFACES,
    DEAD_LETTER_QUEUE_NAME,
    DEFAULT_ASK_TIMEOUT,
    DEFAULT_CONFIRM_TIMEOUT,
    DEFAULT_CONNECT_TIMEOUT,
    DEFAULT_DEAD_LETTER_BURST,
    DEFAULT_DEAD_LETTER_QUEUE,
    DEFAULT_DEAD_LETTER_RATE,
    DEFAULT_DEDUP_WINDOW_AGE,
    DEFAULT_DEDUP_WINDOW_KEYS,
    DEFAULT_FIRST_FRAME_TIMEOUT,
    DEFAULT_HANDSHAKE_TIMEOUT,
    DEFAULT_HEARTBEAT_INTERVAL,
    DEFAULT_IDLE_TIMEOUT,
    DEFAULT_LISTEN_HOST,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_CONNECTIONS_PER_SOURCE,
    DEFAULT_PORT,
    DEFAULT_PUT_RETRY_COUNT,
    DEFAULT_PUT_RETRY_INTERVAL,
    DEFAULT_RETRY_BACKOFF_INITIAL,
    DEFAULT_RETRY_BACKOFF_MAX,
    DEFAULT_SPILL_LIMIT,
    DEFAULT_STALL_AFTER,
    DEFAULT_TRANSMISSION_QUEUE,
    DEFAULT_WINDOW,
    ERROR_LIMIT,
    HARD_MESSAGE_CAP,
    IPC_PRIVATE,
    KEY_T_MAX,
    MIN_CONNECTION_TIMEOUT,
    TRANSMISSION_QUEUE_NAME,
)
from rqp.protocol.access import PATTERN_CHARS, PeerRule, QueueSet, identity_pattern_problem
from rqp.protocol.errors import ConfigError
from rqp.protocol.keys import is_broadcast_name, normalize_key, queue_key_problem

__all__ = [
    "DEFAULT_ASK_TIMEOUT",
    "DEFAULT_CONFIRM_TIMEOUT",
    "DEFAULT_CONNECT_TIMEOUT",
    "DEFAULT_LISTEN_HOST",
    "DEFAULT_PUT_RETRY_COUNT",
    "DEFAULT_PUT_RETRY_INTERVAL",
    "DEFAULT_DEDUP_WINDOW_KEYS",
    "DEFAULT_DEDUP_WINDOW_AGE",
    "DEFAULT_RETRY_BACKOFF_INITIAL",
    "DEFAULT_RETRY_BACKOFF_MAX",
    "DEFAULT_WINDOW",
    "MAX_DURATION",
    "MAX_WINDOW",
    "QUEUE_NAME_RE",
    "RECEIVER_KEYS",
    "RQPRC_SEARCH_ORDER",
    "SENDER_KEYS",
    "SYSTEM_RQPRC",
    "BadValueError",
    "HostAddress",
    "ReceiverConfig",
    "SenderConfig",
    "TLSFiles",
    "agent_queue",
    "default_state_dir",
    "find_rqprc",
    "is_loopback",
    "load_receiver_config",
    "did_you_mean",
    "load_optional_rqprc",
    "read_yaml",
    "show_value",
    "load_sender_config",
    "parse_duration",
    "parse_host",
    "parse_queue_key",
    "parse_size",
    "receiver_config_from_mapping",
    "sender_config_from_mapping",
]

T = TypeVar("T")
_PathArg = str | os.PathLike[str] | None
Env = Mapping[str, str] | None

# The documented defaults live in one table, rqp.protocol.constants (the sender core's
# Settings reads the same names); tests/test_config.py checks the example files against it.
MAX_WINDOW = 65536
#: Longest accepted duration. Far longer values overflow the C timeouts of sockets and selectors.
MAX_DURATION = 365 * 24 * 3600.0

#: The last place :func:`find_rqprc` looks. A module constant so that tests can replace it.
SYSTEM_RQPRC = Path("/etc/rqp/rqprc")
#: The receiving MCA's config where scripts/install puts it (the unit's --config).
SYSTEM_RECEIVER_CONFIG = Path("/etc/rqp/receiver.yaml")
#: Where :func:`find_rqprc` looks, first match wins (for help texts and error messages).
RQPRC_SEARCH_ORDER: tuple[str, ...] = (
    "the path given explicitly (e.g. --config)",
    "$RQPRC",
    "./.rqprc",
    "~/.rqprc",
    str(SYSTEM_RQPRC),
)

SENDER_KEYS: tuple[str, ...] = (
    "hosts",
    "port",
    "transmission_queue",
    "dead_letter_queue",
    "state_dir",
    "ask_timeout",
    "confirm_timeout",
    "connect_timeout",
    "error_limit",
    "queues",
    "retry_backoff_initial",
    "retry_backoff_max",
    "retry_max_attempts",
    "retry_max_age",
    "window",
    "stall_after",
    "heartbeat_interval",
    "control_socket",
    "metrics_listen",
    "tls",
    "plaintext",
)
RECEIVER_KEYS: tuple[str, ...] = (
    "listen",
    "dead_letter_queue",
    "max_message_size",
    "queues",
    "offer",
    "put_retry_count",
    "put_retry_interval",
    "state_dir",
    "host_name",
    "dedup_window_keys",
    "dedup_window_age",
    "control_socket",
    "metrics_listen",
    "max_connections",
    "max_connections_per_source",
    "first_frame_timeout",
    "idle_timeout",
    "handshake_timeout",
    "tls",
    "plaintext",
    "peers",
    "dead_letter_rate",
    "dead_letter_burst",
    "spill_limit",
)
_OFFER_KEYS = ("allow", "deny")
_TLS_KEYS = ("cert", "key", "ca")
_HOST_ENTRY_KEYS = ("host", "tls")
_PEER_RULE_KEYS = ("identity", "network", "queues")

#: A queue name: NetarchiveSuite style ``<ENV>_<PREFIX>_<REPLICA>[_<MACHINE>][_<APP>]`` or any
#: name of this shape. Names start with a letter, so they never look like a number.
QUEUE_NAME_RE = re.compile(r"[A-Za-z][A-Za-z0-9_.\-]{0,127}")

_NO_FILE = "<mapping>"
_BOOL_NOTE = " (YAML reads yes/no/on/off/true/false as booleans)"


# --------------------------------------------------------------------------------------------
# Errors


class NoRqprcFound(ConfigError):
    """No ``.rqprc`` at any place :func:`find_rqprc` looks (a host that only receives)."""


class BadValueError(ConfigError, ValueError):
    """One value is wrong (what the ``parse_*`` functions raise). The loaders prefix the file
    and the key to the message. Public, like every exception that can reach a user: its name
    shows in tracebacks (issue 10: ``rqp.config._BadValue`` did)."""

    def __init__(self, value: object, expected: str):
        if isinstance(value, bool):
            expected += _BOOL_NOTE
        super().__init__(f"bad value {show_value(value)}: {expected}")
        self.value = value
        self.expected = expected


def show_value(value: object) -> str:
    """The value as the user wrote it (near enough), quoted and cut to a readable length."""
    if isinstance(value, bool):
        text = "true" if value else "false"
    elif value is None:
        text = "null"
    elif isinstance(value, str):
        text = value
    else:
        text = repr(value)
    if len(text) > 80:
        text = text[:77] + "..."
    return repr(text)


def did_you_mean(word: object, choices: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest of ``choices``, else empty: for error messages."""
    folded = {choice.casefold(): choice for choice in choices}
    close = difflib.get_close_matches(str(word).casefold(), folded, n=1)
    return f" (did you mean {folded[close[0]]!r}?)" if close else ""


# --------------------------------------------------------------------------------------------
# Value parsers

_DURATION_RE = re.compile(r"(?P<num>[0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*(?P<unit>ms|s|m|h|d|w)?")
#: Text in exponent form ('1.0e9'): YAML reads it as a string, and it is no duration here.
_EXPONENT_RE = re.compile(r"\s*(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)[eE][+-]?[0-9]+\s*(?:ms|s|m|h|d|w)?\s*")
_DURATION_UNITS: Mapping[str | None, Fraction] = {
    "ms": Fraction(1, 1000),
    "s": Fraction(1),
    None: Fraction(1),
    "m": Fraction(60),
    "h": Fraction(3600),
    "d": Fraction(86400),
    "w": Fraction(7 * 86400),
}
_DURATION_EXPECTED = ("expected a positive duration in seconds (e.g. 2, 0.5, '500ms', '2s', "
                      "'5m', '1h', '1d')")


def parse_duration(value: object) -> float:
    """Seconds from a positive number, or a string: ``'500ms'``, ``'2s'``, ``'3m'``, ``'1h'``,
    ``'1d'``."""
    seconds = _duration_seconds(value)
    if seconds is None and isinstance(value, str) and _EXPONENT_RE.fullmatch(value):
        raise BadValueError(value, "expected a duration written out, not in exponent form "
                            "(e.g. 30, '500ms', '2h'; at most a year)")
    if seconds is None or math.isnan(seconds) or seconds <= 0:
        raise BadValueError(value, _DURATION_EXPECTED)
    if seconds > MAX_DURATION:
        raise BadValueError(value, f"expected a duration of at most {MAX_DURATION:.0f} s (a year)")
    return seconds


def _duration_seconds(value: object) -> float | None:
    try:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str) and (match := _DURATION_RE.fullmatch(value.strip())):
            return float(Fraction(match["num"]) * _DURATION_UNITS[match["unit"]])
    except OverflowError:  # too big for a float: over the limit
        return math.inf
    except ValueError:  # more digits than int() takes
        pass
    return None


_KEY_RE = re.compile(r"([+-]?)(?:0[xX]([0-9a-fA-F]+)|0[oO]?([0-7]+)|(0|[1-9][0-9]*))")
_KEY_EXPECTED = (
    f"expected a System V queue key: an integer 1..{KEY_T_MAX} or a negative key_t "
    "-2147483648..-1, written in decimal, hex or octal (e.g. 0x52510001, 1381040129)"
)


def _resolve_queue(config, name_or_key: object) -> int:
    """A queue an application or an operator names: a public ConfigError that says which
    file's names were looked in (BadValueError alone would not name the file)."""
    try:
        return parse_queue_key(name_or_key, {**config.queues, **config.builtin_queues})
    except BadValueError as exc:
        where = config.source or "the configuration"
        raise ConfigError(f"{where}: unknown queue {show_value(name_or_key)}: {exc.expected}") \
            from None


def parse_queue_key(value: object, names: Mapping[str, int] | None = None) -> int:
    """A System V ``key_t`` as an unsigned 32-bit int; a string in ``names`` gives its key.

    Negative keys (``key_t`` is signed) are normalised to ``value & 0xFFFFFFFF``. 0 is
    ``IPC_PRIVATE`` and is rejected: it names no queue.
    """
    expected = _KEY_EXPECTED + (", or a configured queue name" if names is not None else "")
    if isinstance(value, bool):
        raise BadValueError(value, expected)
    if isinstance(value, int):
        number = value
    elif isinstance(value, str):
        text = value.strip()
        if names is not None and text in names:
            return names[text]
        if QUEUE_NAME_RE.fullmatch(text):
            if names is None:
                raise BadValueError(value, _KEY_EXPECTED + "; a queue name cannot be used here")
            known = sorted(names)
            listed = ", ".join(known[:20]) + (f" and {len(known) - 20} more" if len(known) > 20 else "")
            raise BadValueError(
                value,
                "expected a queue key or a queue name defined under 'queues'"
                f"{did_you_mean(text, known)}; known names: {listed}",
            )
        match = _KEY_RE.fullmatch(text) if len(text) <= 40 else None
        if match is None:
            raise BadValueError(value, expected)
        sign, hex_digits, octal_digits, decimal_digits = match.groups()
        if hex_digits is not None:
            number = int(hex_digits, 16)
        elif octal_digits is not None:
            number = int(octal_digits, 8)
        else:
            number = int(decimal_digits)
        if sign == "-":
            number = -number
    else:
        raise BadValueError(value, expected)
    number = normalize_key(number)
    if number == IPC_PRIVATE:
        raise BadValueError(value,
                            "expected a key other than 0 (0 is IPC_PRIVATE: it names no queue)")
    if queue_key_problem(number):
        raise BadValueError(value, expected)
    return number


@dataclasses.dataclass(frozen=True)
class HostAddress:
    """A host and a TCP port. ``str()`` gives ``host:port``, or ``[v6]:port`` for IPv6.

    Unpacks like a pair: ``host, port = address``.
    """

    host: str
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    def __iter__(self) -> Iterator[str | int]:
        return iter((self.host, self.port))


_HOST_EXPECTED = (
    "expected 'host', 'host:port', 'IPv4:port', '[IPv6]:port', '[IPv6]' or a bare IPv6 address, "
    "with a port in 1..65535"
)
_LABEL = r"[A-Za-z0-9_](?:[A-Za-z0-9_\-]*[A-Za-z0-9_])?"
_HOSTNAME_RE = re.compile(rf"{_LABEL}(?:\.{_LABEL})*\.?")
_NUMERIC_HOST_RE = re.compile(r"[0-9.]+")


def _hostname_or_ipv4(text: str) -> str | None:
    if len(text) > 254 or not _HOSTNAME_RE.fullmatch(text):
        return None
    if _NUMERIC_HOST_RE.fullmatch(text):  # all digits and dots: it must be a real IPv4 address
        try:
            return str(ipaddress.IPv4Address(text))
        except ValueError:
            return None
    return text.lower()


def _ipv6(text: str) -> str | None:
    try:
        return str(ipaddress.IPv6Address(text))
    except ValueError:
        return None


def _port(text: str) -> int | None:
    if not (text.isascii() and text.isdigit()) or len(text) > 5:
        return None
    port = int(text)
    return port if 1 <= port <= 65535 else None


def parse_host(value: object, default_port: int = DEFAULT_PORT) -> HostAddress:
    """``host``, ``host:port``, ``1.2.3.4:5``, ``[::1]:7460``, ``[::1]`` or ``::1``.

    Host names are lower-cased and IP addresses put in canonical form, so equal addresses
    compare equal.
    """
    if not isinstance(value, str):
        quote = isinstance(value, (int, list))  # YAML took 1:2:3 for a number, [::1] for a list
        raise BadValueError(value, _HOST_EXPECTED + (" (quote IPv6 addresses in YAML)" * quote))
    text = value.strip()
    host: str | None
    port: int | None = default_port
    if text.startswith("["):
        inside, bracket, rest = text[1:].partition("]")
        host = _ipv6(inside) if bracket else None
        if rest:
            port = _port(rest[1:]) if rest.startswith(":") else None
    elif text.count(":") >= 2:
        host = _ipv6(text)
    elif ":" in text:
        name, _, port_text = text.partition(":")
        host, port = _hostname_or_ipv4(name), _port(port_text)
    else:
        host = _hostname_or_ipv4(text)
    if host is None or port is None:
        raise BadValueError(value, _HOST_EXPECTED)
    return HostAddress(host, port)


_LISTEN_EXPECTED = (
    "expected 'host:port', 'host' or ':port' for all interfaces "
    "(e.g. '0.0.0.0:7460', ':7460', '[::]:7460'), with a port in 1..65535"
)


def _parse_listen(value: object) -> HostAddress:
    text = value.strip() if isinstance(value, str) else value
    if isinstance(text, str) and text.startswith(":") and not text.startswith("::"):
        text = ALL_INTERFACES + text  # ':port' means every interface
    try:
        return parse_host(text, DEFAULT_PORT)
    except BadValueError:
        raise BadValueError(value, _LISTEN_EXPECTED) from None


_METRICS_EXPECTED = "expected 'host:port' or ':port' (loopback), e.g. ':9746' or '127.0.0.1:9746'"


def _parse_metrics_listen(value: object) -> HostAddress:
    text = value.strip() if isinstance(value, str) else value
    if isinstance(text, str) and text.startswith(":") and not text.startswith("::"):
        text = "127.0.0.1" + text  # metrics stay on loopback unless told otherwise
    try:
        address = parse_host(text, 0)
    except BadValueError:
        raise BadValueError(value, _METRICS_EXPECTED) from None
    if not address.port:
        raise BadValueError(value, _METRICS_EXPECTED)
    return address


_SIZE_RE = re.compile(r"([0-9]+)\s*(b|kib|mib|gib|tib|pib)?", re.IGNORECASE)
_SIZE_UNITS = {"b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
               "pib": 1 << 50}
_SIZE_EXPECTED = (
    f"expected a positive number of bytes up to {HARD_MESSAGE_CAP} (e.g. 8192, '8KiB', '1MiB'), "
    "or null for the kernel's msgmax"
)
#: The most spill_limit takes: far beyond any disk, only a guard against a typo's zeros.
MAX_SPILL_LIMIT = 1 << 50
_SPILL_EXPECTED = "expected a positive number of bytes (e.g. '512MiB', '4GiB', '1TiB')"


def _bytes(value: object) -> int:
    """Bytes from an int or a string with a unit, 0 when it is neither."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and (match := _SIZE_RE.fullmatch(value.strip())):
        if len(match[1]) < 20:
            return int(match[1]) * _SIZE_UNITS[(match[2] or "b").lower()]
    return 0


def parse_size(value: object) -> int:
    """Bytes from a positive int, or a string: ``'8192'``, ``'8KiB'``, ``'64 KiB'``, ``'1MiB'``
    (at most HARD_MESSAGE_CAP: a message size)."""
    size = _bytes(value)
    if not 1 <= size <= HARD_MESSAGE_CAP:
        raise BadValueError(value, _SIZE_EXPECTED)
    return size


def _parse_spill_limit(value: object) -> int:
    """Bytes of spill files, as :func:`parse_size` but up to MAX_SPILL_LIMIT."""
    size = _bytes(value)
    if not 1 <= size <= MAX_SPILL_LIMIT:
        raise BadValueError(value, _SPILL_EXPECTED + (
            f": at most {MAX_SPILL_LIMIT} (1 PiB)" if size > MAX_SPILL_LIMIT else ""))
    return size


def _int_parser(low: int, high: int | None, what: str) -> Callable[[object], int]:
    span = f"{low}..{high}" if high is not None else f">= {low}"
    expected = f"expected {what}: an integer {span}"

    def parse(value: object) -> int:
        if isinstance(value, str) and value.strip().lstrip("+-").isdigit():
            raise BadValueError(value, f"{expected} (a string here: write it without quotes)")
        if isinstance(value, bool) or not isinstance(value, int):
            raise BadValueError(value, expected)
        if value < low or (high is not None and value > high):
            raise BadValueError(value, expected)
        return value

    return parse


_parse_port = _int_parser(1, 65535, "a TCP port")
_parse_error_limit = _int_parser(1, None, "a number of errors")
_parse_window = _int_parser(1, MAX_WINDOW, "a number of frames")


def _duration_at_least(low: float, why: str) -> Callable[[object], float]:
    """parse_duration, refusing less than ``low`` seconds (``why``: what it would do)."""
    def parse(value: object) -> float:
        seconds = parse_duration(value)
        if seconds < low:
            raise BadValueError(value, f"expected a duration of at least {low:g} s ({why})")
        return seconds
    return parse


_parse_stall_after = _duration_at_least(1.0, "less would call every route stalled between "
                                              "two answers")
_parse_heartbeat = _duration_at_least(1.0, "less would flood each receiver with QUEUE_ASKs")
# (A trial's 1ms, meant as 1m perhaps, had every sending MCA reconnect between its frames.)
_parse_connection_timeout = _duration_at_least(
    MIN_CONNECTION_TIMEOUT, "less would close the connections of working peers: 1m is a "
    "minute, 1ms a millisecond")
_parse_retry_count = _int_parser(0, None, "a number of retries")
_parse_attempts = _int_parser(1, None, "a number of attempts")
_parse_key_count = _int_parser(0, None, "a number of message keys")
_parse_connections = _int_parser(1, 1_000_000, "a number of connections")
_parse_burst = _int_parser(1, 1_000_000, "a number of dead letters")


def _parse_rate(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not \
            0 < value <= 1_000_000 or not math.isfinite(value):
        raise BadValueError(value, "expected a number of dead letters per second, > 0 (e.g. "
                                   "10, 0.5)")
    return float(value)

_HOST_NAME_RE = re.compile(r"[^\s\x00-\x1f\x7f]{1,255}")


def _parse_host_name(value: object) -> str:
    if not isinstance(value, str) or not _HOST_NAME_RE.fullmatch(value):
        raise BadValueError(value, "expected a host name: 1 to 255 characters without spaces")
    return value


# --------------------------------------------------------------------------------------------
# The state directory


def _home_dir(env: Mapping[str, str], home: _PathArg) -> str:
    if home is not None:
        return os.fspath(home)
    return env.get("HOME") or os.path.expanduser("~")


def default_state_dir(
    env: Env = None,
    *,
    euid: int | None = None,
    home: _PathArg = None,
) -> str:
    """``$STATE_DIRECTORY`` (its first entry), else ``/var/lib/rqp`` for root, else
    ``$XDG_STATE_HOME/rqp`` or ``~/.local/state/rqp``."""
    env = os.environ if env is None else env
    for entry in env.get("STATE_DIRECTORY", "").split(":"):
        if entry:
            return entry
    if (os.geteuid() if euid is None else euid) == 0:
        return "/var/lib/rqp"
    xdg = env.get("XDG_STATE_HOME", "")
    if os.path.isabs(xdg):  # the XDG spec says to ignore a relative value
        return os.path.join(xdg, "rqp")
    return os.path.join(_home_dir(env, home), ".local", "state", "rqp")


# --------------------------------------------------------------------------------------------
# The result types


def _no_names() -> Mapping[str, int]:
    return types.MappingProxyType({})


def _queue_name(names: Mapping[str, int], builtins: Mapping[str, int], key: int) -> str | None:
    key = normalize_key(key)
    for table in (names, builtins):
        for name, value in table.items():
            if value == key:
                return name
    return None


@dataclasses.dataclass(frozen=True)
class TLSFiles:
    """A ``tls:`` block: this host's certificate (chain) and key, and the CA certificate(s)
    its peers must be signed by; absolute paths. :mod:`rqp.system.tls` checks and loads
    them."""

    cert: str
    key: str
    ca: str
    #: Where the block is, for messages: "/etc/rqp/receiver.yaml: tls".
    where: str = "tls"

    def name(self, field: str) -> str:
        """``field`` named for a message: "/etc/rqp/receiver.yaml: tls.key /etc/rqp/host.key"."""
        return f"{self.where}.{field} {getattr(self, field)}"


@dataclasses.dataclass(frozen=True)
class SenderConfig:
    """The sending MCA's and the application API's settings, from ``.rqprc``."""

    hosts: tuple[HostAddress, ...]
    port: int = DEFAULT_PORT
    transmission_queue: int = DEFAULT_TRANSMISSION_QUEUE
    dead_letter_queue: int = DEFAULT_DEAD_LETTER_QUEUE
    state_dir: str = dataclasses.field(default_factory=default_state_dir)
    ask_timeout: float = DEFAULT_ASK_TIMEOUT
    confirm_timeout: float = DEFAULT_CONFIRM_TIMEOUT
    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT
    error_limit: int = ERROR_LIMIT
    queues: Mapping[str, int] = dataclasses.field(default_factory=_no_names, hash=False)
    retry_backoff_initial: float = DEFAULT_RETRY_BACKOFF_INITIAL
    retry_backoff_max: float = DEFAULT_RETRY_BACKOFF_MAX
    window: int = DEFAULT_WINDOW
    #: A route with messages waiting and nothing confirmed for this long is "stalled".
    stall_after: float = DEFAULT_STALL_AFTER
    #: A quiet connection that carries a route is probed (QUEUE_ASK) this often.
    heartbeat_interval: float = DEFAULT_HEARTBEAT_INTERVAL
    #: SURE retry budget; None (the default) = retry forever, as the spec says.
    retry_max_attempts: int | None = None
    retry_max_age: float | None = None
    #: None: $RUNTIME_DIRECTORY/control.sock, else <state_dir>/sender-<queue>.sock.
    control_socket: str | None = None
    #: None: no HTTP metrics endpoint (rqpctl metrics still works).
    metrics_listen: HostAddress | None = None
    #: None: plaintext RQP/1 to every host not given its own ``tls`` in ``hosts``.
    tls: TLSFiles | None = None
    #: Hosts whose entry in ``hosts`` has its own ``tls`` (a block, or None for plaintext).
    host_tls: Mapping[HostAddress, TLSFiles | None] = dataclasses.field(
        default_factory=lambda: types.MappingProxyType({}), hash=False)
    #: Plaintext RQP/1 to the hosts without TLS on purpose (another host needs it said).
    plaintext: bool = False
    source: str | None = None

    def tls_for(self, host: HostAddress) -> TLSFiles | None:
        """The ``tls:`` files to dial ``host`` with, None for plaintext."""
        return self.host_tls.get(host, self.tls)

    def plaintext_hosts(self, hosts=None) -> list[HostAddress]:
        """The hosts among ``hosts`` (default: all) dialled in plaintext over a network."""
        return [h for h in (self.hosts if hosts is None else hosts)
                if self.tls_for(h) is None and not is_loopback(h.host)]

    def transport_problem(self) -> str | None:
        """Why a sending MCA must not dial as configured, or None: plaintext RQP/1 to another
        host needs saying so (spec section 7), by ``plaintext: true`` or by ``tls: false`` on
        that host's entry. Without it, a .rqprc with no tls: block went out in plaintext."""
        plain = [str(h) for h in self.plaintext_hosts()
                 if not self.plaintext and h not in self.host_tls]
        if not plain:
            return None
        return (f"plaintext RQP/1 to {', '.join(plain)} without saying so: anyone on the way "
                f"could read or change the messages, and whatever answers at that address "
                f"would take them. Give {self.source or '.rqprc'} a 'tls:' block (cert, key, "
                f"ca; 'rqpctl tls --help' makes them), or set 'plaintext: true' there (or "
                f"'tls: false' on a host's entry) to send plaintext RQP/1 over the network on "
                f"purpose")

    @property
    def builtin_queues(self) -> Mapping[str, int]:
        """``DEAD.LETTER.Q`` and ``RQP.XMIT.Q`` with their configured keys."""
        return {
            DEAD_LETTER_QUEUE_NAME: self.dead_letter_queue,
            TRANSMISSION_QUEUE_NAME: self.transmission_queue,
        }

    def resolve_queue(self, name_or_key: object) -> int:
        """The key of a configured or built-in queue name, or a queue key given as such."""
        return _resolve_queue(self, name_or_key)

    def agent_queue(self, key: int) -> str | None:
        """:func:`agent_queue` with this config's queues."""
        return agent_queue(key, self)

    def queue_name(self, key: int) -> str | None:
        """The first name configured for ``key``, else its built-in name, else None."""
        return _queue_name(self.queues, self.builtin_queues, key)

    @functools.cached_property
    def broadcast_keys(self) -> frozenset[int]:
        """The keys of the broadcast names of ``queues`` (spec section 6: ``PROD_ALL_BA``)."""
        return frozenset(key for name, key in self.queues.items() if is_broadcast_name(name))

    @property
    def agent_name(self) -> str:
        """The name of the sending MCA that serves this transmission queue,
        ``sender-52510000``: its journal, key incarnation, start reserve, log and control
        socket files are named after it (one MCA per transmission queue)."""
        return f"sender-{self.transmission_queue:08x}"

    @property
    def log_path(self) -> Path:
        """Where a sending MCA started by openConnection() or rqpctl writes its log."""
        return Path(self.state_dir) / f"{self.agent_name}.log"


@dataclasses.dataclass(frozen=True)
class ReceiverConfig:
    """The receiving MCA's settings. Every field has a default: a receiver needs no file."""

    listen: HostAddress = HostAddress(DEFAULT_LISTEN_HOST, DEFAULT_PORT)
    dead_letter_queue: int = DEFAULT_DEAD_LETTER_QUEUE
    #: None: the kernel's ``msgmax``, read at run time.
    max_message_size: int | None = None
    queues: Mapping[str, int] = dataclasses.field(default_factory=_no_names, hash=False)
    #: None: no allow list, every writable queue may be offered (as root: none, see
    #: rqp_agents.delivery.LocalDelivery.offer_default).
    offer_allow: QueueSet | None = None
    offer_deny: QueueSet = QueueSet()
    put_retry_count: int = DEFAULT_PUT_RETRY_COUNT
    put_retry_interval: float = DEFAULT_PUT_RETRY_INTERVAL
    state_dir: str = dataclasses.field(default_factory=default_state_dir)
    #: None: ``socket.gethostname()`` at run time.
    host_name: str | None = None
    #: SURE message keys remembered to answer repeats without putting them again (0: off).
    dedup_window_keys: int = DEFAULT_DEDUP_WINDOW_KEYS
    dedup_window_age: float = DEFAULT_DEDUP_WINDOW_AGE
    #: Connections kept at once, in all and from one source address; more are closed at once.
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    max_connections_per_source: int = DEFAULT_MAX_CONNECTIONS_PER_SOURCE
    #: A connection with no complete frame this long after it was accepted is closed.
    first_frame_timeout: float = DEFAULT_FIRST_FRAME_TIMEOUT
    #: A connection with nothing in flight and no byte for this long is closed.
    idle_timeout: float = DEFAULT_IDLE_TIMEOUT
    #: A TLS connection whose handshake has not finished this long after accept is closed.
    handshake_timeout: float = DEFAULT_HANDSHAKE_TIMEOUT
    #: None: plaintext RQP/1, which a non-loopback listen needs ``plaintext: true`` for.
    tls: TLSFiles | None = None
    plaintext: bool = False
    #: None: no rules, every peer the transport lets in may use every offered queue.
    peers: tuple[PeerRule, ...] | None = None
    #: Dead letters written for one peer: per second on average, and at once.
    dead_letter_rate: float = DEFAULT_DEAD_LETTER_RATE
    dead_letter_burst: int = DEFAULT_DEAD_LETTER_BURST
    #: Bytes of spill files (whole payloads of big dead letters) kept at most.
    spill_limit: int = DEFAULT_SPILL_LIMIT
    #: None: $RUNTIME_DIRECTORY/control.sock, else <state_dir>/receiver.sock.
    control_socket: str | None = None
    #: None: no HTTP metrics endpoint (rqpctl metrics still works).
    metrics_listen: HostAddress | None = None
    source: str | None = None

    @property
    def builtin_queues(self) -> Mapping[str, int]:
        """``DEAD.LETTER.Q`` with its configured key (a receiver has no transmission queue)."""
        return {DEAD_LETTER_QUEUE_NAME: self.dead_letter_queue}

    def resolve_queue(self, name_or_key: object) -> int:
        """The key of a configured queue name or ``DEAD.LETTER.Q``, or a queue key given as such."""
        return _resolve_queue(self, name_or_key)

    def queue_name(self, key: int) -> str | None:
        """The first name configured for ``key``, else its built-in name, else None."""
        return _queue_name(self.queues, self.builtin_queues, key)

    def offers(self, key: int) -> bool:
        """Whether this receiver's configuration offers queue ``key`` to senders: the one
        decision (the agent adds only what it finds on the host: whether the queue exists, may
        be written and is not a transmission queue). A key that names no queue, the
        dead-letter queue and what the allow and deny lists exclude are not offered; nor are
        the default transmission and dead-letter keys, whatever the lists say."""
        if queue_key_problem(key) or key == self.dead_letter_queue:
            return False
        if key in (DEFAULT_TRANSMISSION_QUEUE, DEFAULT_DEAD_LETTER_QUEUE):
            # The agents' own queues, whatever the lists say: a remote peer writing there would
            # have this host's sending MCA relay its records (an open relay), or fill the dead
            # letters.
            return False
        names = self.queue_names(key)
        if self.offer_allow is not None and not self.offer_allow.includes(key, names):
            return False
        return not self.offer_deny.includes(key, names)

    def queue_names(self, key: int) -> tuple[str, ...]:
        """Every configured name of ``key`` (what name patterns are matched against)."""
        return self._names_by_key.get(key, ())

    @functools.cached_property
    def _names_by_key(self) -> Mapping[int, tuple[str, ...]]:
        """Built once per config: the receiver asks for every request."""
        names: dict[int, tuple[str, ...]] = {}
        for name, value in self.queues.items():
            names[value] = (*names.get(value, ()), name)
        return names

    def transport_problem(self) -> str | None:
        """Why this receiver must not start as configured, or None: plaintext on an address
        other hosts can reach needs ``plaintext: true`` (spec section 7)."""
        if self.tls is not None or self.plaintext or is_loopback(self.listen.host):
            return None
        source = self.source or "the receiver config"
        return (f"listening on {self.listen} without TLS: anyone who can reach it could put "
                f"into the offered queues. Give {source} a 'tls:' block (cert, key, ca; "
                f"'rqpctl tls --help' makes them), or set 'plaintext: true' there (or "
                f"--plaintext) to accept plaintext RQP/1 from the network on purpose")


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or 'localhost') is reachable from this host only."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


# --------------------------------------------------------------------------------------------
# Building configs from parsed YAML


_RESERVED_NAMES = {
    DEAD_LETTER_QUEUE_NAME: "the dead-letter queue, dead_letter_queue",
    TRANSMISSION_QUEUE_NAME: "the transmission queue, transmission_queue",
}
_HOSTS_EXPECTED = (
    "expected a non-empty list of hosts ('host', 'host:port', '[IPv6]:port'), asked in that order"
)
_QUEUES_EXPECTED = (
    "expected a mapping of queue names to keys (e.g. PROD_THE_SCHED_COMMON: 0x52510001)"
)
_QUEUE_NAME_EXPECTED = (
    f"expected a queue name matching {QUEUE_NAME_RE.pattern} (e.g. PROD_THE_SCHED_COMMON)"
)
_STATE_DIR_EXPECTED = (
    "expected a directory path (a relative one starts at the config file's directory)"
)
_OFFER_EXPECTED = "expected a mapping with 'allow' and/or 'deny' lists of queue keys or names"
_QUEUE_LIST_EXPECTED = (
    "expected a list of queue keys, configured queue names and name patterns ('PROD_*'; "
    "'*' alone: every queue)"
)
_QUEUE_PATTERN_RE = re.compile(r"[A-Za-z0-9_.\-*?\[\]!]{1,128}")
_TLS_EXPECTED = (
    "expected a mapping with 'cert' (this host's certificate), 'key' (its private key) and "
    "'ca' (the CA certificate peers are signed by), PEM file paths"
)
_PEERS_EXPECTED = (
    "expected a list of rules, each a mapping with 'identity' (TLS names, '*' wildcards) "
    "and/or 'network' (CIDR), and 'queues' (what they may put into), first match wins"
)
_IDENTITY_EXPECTED = (
    "expected a TLS identity (a certificate's DNS name or common name, '*' matching within one "
    "DNS label, '*' alone: every authenticated peer) or a list of them"
)
_NETWORK_EXPECTED = "expected a network in CIDR notation (e.g. 10.1.0.0/16, fd00::/8) or a list"


def _one_or_list(value: object) -> list[object]:
    if value is None:
        return []
    return list(value) if isinstance(value, list) else [value]


def _identities(value: object) -> tuple[str, ...]:
    items = _one_or_list(value)
    if isinstance(value, list) and not items:
        raise BadValueError(value, _IDENTITY_EXPECTED)
    for item in items:
        if not isinstance(item, str) or identity_pattern_problem(item):
            raise BadValueError(item, _IDENTITY_EXPECTED)
    return tuple(items)  # type: ignore[arg-type]


def _networks(value: object) -> tuple:
    items = _one_or_list(value)
    if isinstance(value, list) and not items:
        raise BadValueError(value, _NETWORK_EXPECTED)
    networks = []
    for item in items:
        try:
            networks.append(ipaddress.ip_network(str(item).strip(), strict=False))
        except ValueError:
            raise BadValueError(item, _NETWORK_EXPECTED) from None
        if not isinstance(item, str):
            raise BadValueError(item, _NETWORK_EXPECTED)
    return tuple(networks)


def _parse_bool(value: object) -> bool:
    if not isinstance(value, bool):
        # (words YAML reads as booleans unquoted: here a string, so they were quoted)
        quoted = isinstance(value, str) and value.strip().lower() in (
            "yes", "no", "on", "off", "true", "false")
        raise BadValueError(value, "expected true or false" + (
            " (a string here: write it without quotes)" if quoted
            else _BOOL_NOTE if isinstance(value, str) else ""))
    return value


class _Fields:
    """One parsed file being validated: turns value errors into file/key errors."""

    def __init__(
        self,
        data: object,
        file: str | None,
        lines: Mapping[str, int],
        env: Mapping[str, str],
        home: _PathArg,
    ):
        self.file = file
        self.name = file or _NO_FILE
        self.lines = lines
        self.env = env
        self.home = home
        if not isinstance(data, Mapping):
            found = "a list" if isinstance(data, list) else f"the value {show_value(data)}"
            self.fail(None, f"expected a mapping of keys to values at the top level, found {found}")
        self.data: Mapping[object, object] = data

    def fail(self, key: str | None, message: str) -> NoReturn:
        line = self.lines.get(key or "")
        where = f" (line {line})" if line else ""
        prefix = f"{self.name}: key {key!r}: " if key else f"{self.name}: "
        raise ConfigError(prefix + message + where, path=self.file, key=key)

    def missing(self, key: str, expected: str) -> NoReturn:
        message = f"{self.name}: key {key!r} is required: {expected}"
        raise ConfigError(message, path=self.file, key=key)

    def bad(self, key: str, value: object, expected: str) -> NoReturn:
        self.fail(key, str(BadValueError(value, expected)))

    def parse(self, key: str, value: object, parser: Callable[[object], T]) -> T:
        try:
            return parser(value)
        except BadValueError as exc:
            self.fail(key, str(exc))

    def get(self, key: str, parser: Callable[[object], T], default: T) -> T:
        """The parsed value of ``key``; missing and null both mean the default."""
        value = self.data.get(key)
        return default if value is None else self.parse(key, value, parser)

    def check_keys(
        self,
        mapping: Mapping[object, object],
        known: Sequence[str],
        prefix: str = "",
        elsewhere: tuple[Sequence[str], str] = ((), ""),
    ) -> None:
        """Reject unknown keys, suggesting the nearest known one."""
        for key in mapping:
            if key in known:
                continue
            # (the other agent's key, exactly, says more than the nearest of ours: a trial got
            # "did you mean 'state_dir'?" for stall_after in a receiver config)
            hint = (f" (it belongs in {elsewhere[1]})" if key in elsewhere[0] else
                    did_you_mean(key, known))
            path = f"{prefix}{key}"
            line = self.lines.get(path)
            where = f" (line {line})" if line else ""
            message = f"{self.name}: unknown key {path!r}{hint}; known keys: {', '.join(known)}"
            raise ConfigError(message + where, path=self.file, key=path)

    def state_dir(self) -> str:
        base = os.path.dirname(os.path.abspath(self.file)) if self.file else os.getcwd()

        def parse(value: object) -> str:
            if not isinstance(value, str) or not value.strip() or "\0" in value:
                raise BadValueError(value, _STATE_DIR_EXPECTED)
            path = value.strip()
            if path == "~" or path.startswith("~/"):
                path = _home_dir(self.env, self.home) + path[1:]
            return os.path.normpath(os.path.join(base, os.path.expanduser(path)))

        return self.get("state_dir", parse, None) or default_state_dir(self.env, home=self.home)

    def path_value(self, key: str) -> str | None:
        """An optional path, relative to the config file's directory."""
        base = os.path.dirname(os.path.abspath(self.file)) if self.file else os.getcwd()

        def parse(value: object) -> str:
            if not isinstance(value, str) or not value.strip() or "\0" in value:
                raise BadValueError(value, "expected a path, e.g. /run/rqp/sender.sock")
            return os.path.normpath(os.path.join(base, os.path.expanduser(value.strip())))

        return self.get(key, parse, None)

    def queues(self) -> Mapping[str, int]:
        value = self.data.get("queues")
        if value is None:
            return _no_names()
        if not isinstance(value, Mapping):
            self.bad("queues", value, _QUEUES_EXPECTED)
        names: dict[str, int] = {}
        for name, key in value.items():
            path = f"queues.{name}"
            if not isinstance(name, str) or not QUEUE_NAME_RE.fullmatch(name):
                self.bad(path, name, _QUEUE_NAME_EXPECTED)
            if name in _RESERVED_NAMES:
                self.bad(path, name, f"expected a name of your own: {name} is built in (it names "
                         f"{_RESERVED_NAMES[name]}) and cannot be redefined")
            names[name] = self.parse(path, key, parse_queue_key)
        kinds: dict[int, str] = {}
        for name, key in names.items():  # a key is a broadcast channel or not, never both
            other = kinds.setdefault(key, name)
            if is_broadcast_name(other) != is_broadcast_name(name):
                cast, plain = (other, name) if is_broadcast_name(other) else (name, other)
                self.bad(f"queues.{name}", f"{names[name]:#010x}", f"a key of its own: {key:#010x} "
                         f"is already named {other}, and {cast} is a broadcast name (its part "
                         f"after the prefix is ALL: every host gets a copy) while {plain} is not")
        return types.MappingProxyType(names)

    def no_agent_queue_names(self, names: Mapping[str, int], own: Mapping[int, str]) -> None:
        """A name under 'queues' for one of the agents' own queues is a mistake (a trial's
        ``PROD_ONE: 0x5251DEAD``): no receiving MCA offers them, so every message sent to it
        was dead-lettered."""
        for name, key in names.items():
            if key in own:
                self.bad(f"queues.{name}", f"{key:#010x}", f"expected an application's queue: "
                         f"{key:#010x} is this agent's {own[key]}, which no receiving MCA "
                         "offers")

    def queue_set(self, path: str, value: object, names: Mapping[str, int]) -> QueueSet:
        """A list of queue keys, configured names and name patterns ('*' alone: every
        queue)."""
        if not isinstance(value, list):
            self.bad(path, value, _QUEUE_LIST_EXPECTED)
        keys: set[int] = set()
        patterns: list[str] = []
        for i, item in enumerate(value):
            if isinstance(item, str) and PATTERN_CHARS & set(item):
                if not _QUEUE_PATTERN_RE.fullmatch(item):
                    self.bad(f"{path}[{i}]", item, _QUEUE_LIST_EXPECTED)
                if item != "*" and not any(fnmatch.fnmatchcase(n, item) for n in names):
                    known = ", ".join(sorted(names)) or "none"
                    self.bad(f"{path}[{i}]", item, f"expected a pattern matching queue names "
                             f"defined under 'queues' (a typo?); known names: {known}")
                patterns.append(item)
            else:
                keys.add(self.parse(f"{path}[{i}]", item, lambda v: parse_queue_key(v, names)))
        return QueueSet(frozenset(keys), tuple(patterns))

    def _file(self, value: object) -> str:
        if not isinstance(value, str) or not value.strip() or "\0" in value:
            raise BadValueError(value, "expected a file path (a relative one starts at the "
                                       "config file's directory)")
        base = os.path.dirname(os.path.abspath(self.file)) if self.file else os.getcwd()
        return os.path.normpath(os.path.join(base, os.path.expanduser(value.strip())))

    def tls(self, path: str, value: object, inherit: TLSFiles | None = None) -> TLSFiles:
        """A ``tls:`` block; with ``inherit``, the fields it does not give come from there."""
        if not isinstance(value, Mapping):
            self.bad(path, value, _TLS_EXPECTED)
        self.check_keys(value, _TLS_KEYS, prefix=f"{path}.")
        files: dict[str, str] = {}
        for field in _TLS_KEYS:
            if value.get(field) is not None:
                files[field] = self.parse(f"{path}.{field}", value[field], self._file)
            elif inherit is not None:
                files[field] = getattr(inherit, field)
            else:
                self.missing(f"{path}.{field}", _TLS_EXPECTED)
        return TLSFiles(**files, where=f"{self.name}: {path}")

    def peer_rules(self, value: object, names: Mapping[str, int],
                   tls: TLSFiles | None) -> tuple[PeerRule, ...]:
        if not isinstance(value, list):
            self.bad("peers", value, _PEERS_EXPECTED)
        rules = []
        for i, rule in enumerate(value):
            path = f"peers[{i}]"
            if not isinstance(rule, Mapping):
                self.bad(path, rule, _PEERS_EXPECTED)
            self.check_keys(rule, _PEER_RULE_KEYS, prefix=f"{path}.")
            identities = self.parse(f"{path}.identity", rule.get("identity"), _identities)
            networks = self.parse(f"{path}.network", rule.get("network"), _networks)
            if not identities and not networks:
                self.fail(path, "a rule needs 'identity' (TLS peers) or 'network' (source "
                                "addresses in CIDR), or both: " + _PEERS_EXPECTED)
            if identities and tls is None:
                self.fail(f"{path}.identity", "a TLS identity needs TLS: give the receiver a "
                                              "'tls:' block, or match plaintext peers by "
                                              "'network'")
            if rule.get("queues") is None:
                self.missing(f"{path}.queues", _QUEUE_LIST_EXPECTED)
            queues = self.queue_set(f"{path}.queues", rule["queues"], names)
            rules.append(PeerRule(identities, networks, queues, where=path))
        return tuple(rules)


def _build_sender(fields: _Fields) -> SenderConfig:
    f = fields
    f.check_keys(f.data, SENDER_KEYS, elsewhere=(RECEIVER_KEYS, "a receiver config, not .rqprc"))

    port = f.get("port", _parse_port, DEFAULT_PORT)
    raw_hosts = f.data.get("hosts")
    if raw_hosts is None:
        f.missing("hosts", _HOSTS_EXPECTED)
    if not isinstance(raw_hosts, list) or not raw_hosts:
        f.bad("hosts", raw_hosts, _HOSTS_EXPECTED)
    tls = f.get("tls", lambda v: f.tls("tls", v), None)
    hosts: list[HostAddress] = []
    host_tls: dict[HostAddress, TLSFiles | None] = {}
    for i, entry in enumerate(raw_hosts):
        path = f"hosts[{i}]"
        if isinstance(entry, Mapping):  # {host: 'b:7460', tls: {...} or false}
            f.check_keys(entry, _HOST_ENTRY_KEYS, prefix=f"{path}.")
            if entry.get("host") is None:
                f.missing(f"{path}.host", _HOSTS_EXPECTED)
            address = f.parse(f"{path}.host", entry["host"], lambda v: parse_host(v, port))
            if "tls" in entry:
                own = entry["tls"]
                if own is False:
                    host_tls[address] = None
                elif isinstance(own, Mapping):
                    host_tls[address] = f.tls(f"{path}.tls", own, inherit=tls)
                else:
                    f.bad(f"{path}.tls", own, _TLS_EXPECTED + ", or false for plaintext to "
                          "this host")
        else:
            address = f.parse(path, entry, lambda v: parse_host(v, port))
        if address in hosts:
            first = f"hosts[{hosts.index(address)}]"
            f.bad(path, entry, f"expected each host once, but {address} is {first} too")
        hosts.append(address)

    plaintext = f.get("plaintext", _parse_bool, False)
    if tls is not None and plaintext:
        f.fail("plaintext", "with a 'tls:' block every host is dialled over TLS: remove "
                            "'plaintext: true', and give a host's entry 'tls: false' for "
                            "plaintext to it")

    xmit = f.get("transmission_queue", parse_queue_key, DEFAULT_TRANSMISSION_QUEUE)
    dead = f.get("dead_letter_queue", parse_queue_key, DEFAULT_DEAD_LETTER_QUEUE)
    if dead == xmit:  # blame the one given explicitly
        key, other = ("dead_letter_queue", "transmission_queue")
        if f.data.get(key) is None:
            key, other = other, key
        given = f.data[key]  # (YAML reads 0x47199000 as a number: shown as a key again)
        f.bad(key, f"0x{given:08x}" if isinstance(given, int) and not isinstance(given, bool)
              else given, f"expected a key other than {other}'s (0x{xmit:08x})")

    queues = f.queues()
    f.no_agent_queue_names(queues, {dead: "dead_letter_queue (DEAD.LETTER.Q)",
                                    xmit: "transmission_queue"})

    backoff_initial = f.get("retry_backoff_initial", parse_duration, DEFAULT_RETRY_BACKOFF_INITIAL)
    backoff_max = f.get("retry_backoff_max", parse_duration, DEFAULT_RETRY_BACKOFF_MAX)
    if backoff_max < backoff_initial:
        if f.data.get("retry_backoff_max") is not None:
            expected = f"expected a duration >= retry_backoff_initial ({backoff_initial:g} s)"
            f.bad("retry_backoff_max", f.data["retry_backoff_max"], expected)
        expected = f"expected a duration <= retry_backoff_max ({backoff_max:g} s)"
        f.bad("retry_backoff_initial", f.data["retry_backoff_initial"], expected)

    return SenderConfig(
        hosts=tuple(hosts),
        port=port,
        transmission_queue=xmit,
        dead_letter_queue=dead,
        state_dir=f.state_dir(),
        ask_timeout=f.get("ask_timeout", parse_duration, DEFAULT_ASK_TIMEOUT),
        confirm_timeout=f.get("confirm_timeout", parse_duration, DEFAULT_CONFIRM_TIMEOUT),
        connect_timeout=f.get("connect_timeout", parse_duration, DEFAULT_CONNECT_TIMEOUT),
        error_limit=f.get("error_limit", _parse_error_limit, ERROR_LIMIT),
        queues=queues,
        retry_backoff_initial=backoff_initial,
        retry_backoff_max=backoff_max,
        window=f.get("window", _parse_window, DEFAULT_WINDOW),
        stall_after=f.get("stall_after", _parse_stall_after, DEFAULT_STALL_AFTER),
        heartbeat_interval=f.get("heartbeat_interval", _parse_heartbeat,
                                 DEFAULT_HEARTBEAT_INTERVAL),
        retry_max_attempts=f.get("retry_max_attempts", _parse_attempts, None),
        retry_max_age=f.get("retry_max_age", parse_duration, None),
        control_socket=f.path_value("control_socket"),
        metrics_listen=f.get("metrics_listen", _parse_metrics_listen, None),
        tls=tls,
        host_tls=types.MappingProxyType(host_tls),
        plaintext=plaintext,
        source=f.file,
    )


def _build_receiver(fields: _Fields) -> ReceiverConfig:
    f = fields
    f.check_keys(f.data, RECEIVER_KEYS, elsewhere=(SENDER_KEYS, "the sender's .rqprc"))

    dead = f.get("dead_letter_queue", parse_queue_key, DEFAULT_DEAD_LETTER_QUEUE)
    queues = f.queues()
    f.no_agent_queue_names(queues, {dead: "dead_letter_queue (DEAD.LETTER.Q)"})
    allow: QueueSet | None = None
    deny = QueueSet()
    names = {**queues, DEAD_LETTER_QUEUE_NAME: dead}
    offer = f.data.get("offer")
    if offer is not None:
        if not isinstance(offer, Mapping):
            f.bad("offer", offer, _OFFER_EXPECTED)
        f.check_keys(offer, _OFFER_KEYS, prefix="offer.")
        if "allow" in offer:
            allow = f.queue_set("offer.allow", offer["allow"], names)
        if "deny" in offer:
            deny = f.queue_set("offer.deny", offer["deny"], names)
    tls = f.get("tls", lambda v: f.tls("tls", v), None)
    plaintext = f.get("plaintext", _parse_bool, False)
    if tls is not None and plaintext:
        f.fail("plaintext", "a port is either TLS or plaintext, never both (spec section 7): "
                            "remove 'plaintext: true' or the 'tls:' block")
    peers = None
    if f.data.get("peers") is not None:
        peers = f.peer_rules(f.data["peers"], names, tls)

    return ReceiverConfig(
        listen=f.get("listen", _parse_listen, HostAddress(DEFAULT_LISTEN_HOST, DEFAULT_PORT)),
        dead_letter_queue=dead,
        max_message_size=f.get("max_message_size", parse_size, None),
        queues=queues,
        offer_allow=allow,
        offer_deny=deny,
        put_retry_count=f.get("put_retry_count", _parse_retry_count, DEFAULT_PUT_RETRY_COUNT),
        put_retry_interval=f.get("put_retry_interval", parse_duration, DEFAULT_PUT_RETRY_INTERVAL),
        state_dir=f.state_dir(),
        host_name=f.get("host_name", _parse_host_name, None),
        dedup_window_keys=f.get("dedup_window_keys", _parse_key_count,
                                DEFAULT_DEDUP_WINDOW_KEYS),
        dedup_window_age=f.get("dedup_window_age", parse_duration, DEFAULT_DEDUP_WINDOW_AGE),
        control_socket=f.path_value("control_socket"),
        metrics_listen=f.get("metrics_listen", _parse_metrics_listen, None),
        max_connections=f.get("max_connections", _parse_connections, DEFAULT_MAX_CONNECTIONS),
        max_connections_per_source=f.get("max_connections_per_source", _parse_connections,
                                         DEFAULT_MAX_CONNECTIONS_PER_SOURCE),
        first_frame_timeout=f.get("first_frame_timeout", _parse_connection_timeout,
                                  DEFAULT_FIRST_FRAME_TIMEOUT),
        idle_timeout=f.get("idle_timeout", _parse_connection_timeout, DEFAULT_IDLE_TIMEOUT),
        handshake_timeout=f.get("handshake_timeout", _parse_connection_timeout,
                                DEFAULT_HANDSHAKE_TIMEOUT),
        tls=tls,
        plaintext=plaintext,
        peers=peers,
        dead_letter_rate=f.get("dead_letter_rate", _parse_rate, DEFAULT_DEAD_LETTER_RATE),
        dead_letter_burst=f.get("dead_letter_burst", _parse_burst, DEFAULT_DEAD_LETTER_BURST),
        spill_limit=f.get("spill_limit", _parse_spill_limit, DEFAULT_SPILL_LIMIT),
        source=f.file,
    )


#: The key scripts/install puts at the top of the configs it lays down: an agent refuses a
#: file that still has it (a template shows every key; the operator sets what this host needs).
TEMPLATE_KEY = "rqp_template"


def _refuse_template(data: object, file: str | None, lines: Mapping[str, int],
                     what: str) -> None:
    if isinstance(data, dict) and TEMPLATE_KEY in data:
        line = f" (line {lines[TEMPLATE_KEY]})" if TEMPLATE_KEY in lines else ""
        raise ConfigError(
            f"{file or _NO_FILE}: this is the template scripts/install put here, not a "
            f"configuration yet: {what}, then delete the line '{TEMPLATE_KEY}: ...'{line}",
            path=file, key=TEMPLATE_KEY)


def _sender(
    data: object, file: str | None, lines: Mapping[str, int], env: Env, home: _PathArg
) -> SenderConfig:
    _refuse_template(data, file, lines, "set 'hosts' (the receiving MCAs this host sends "
                     "to, asked in order) and whatever else this host needs")
    if data is None:
        name = file or _NO_FILE
        message = f"{name}: the file is empty; key 'hosts' is required: {_HOSTS_EXPECTED}"
        raise ConfigError(message, path=file, key="hosts")
    return _build_sender(_Fields(data, file, lines, os.environ if env is None else env, home))


def _receiver(
    data: object, file: str | None, lines: Mapping[str, int], env: Env, home: _PathArg
) -> ReceiverConfig:
    _refuse_template(data, file, lines, "set 'listen' and 'offer' (which queues remote "
                     "senders may put into) for this host")
    env = os.environ if env is None else env
    return _build_receiver(_Fields({} if data is None else data, file, lines, env, home))


def sender_config_from_mapping(
    data: object, source: _PathArg = None, *, env: Env = None, home: _PathArg = None
) -> SenderConfig:
    """Validate an already parsed ``.rqprc``. ``source`` names it in messages and is the
    directory a relative ``state_dir`` is relative to (else the current directory)."""
    return _sender(data, None if source is None else os.fspath(source), {}, env, home)


def receiver_config_from_mapping(
    data: object, source: _PathArg = None, *, env: Env = None, home: _PathArg = None
) -> ReceiverConfig:
    """Validate an already parsed receiver config; None means all defaults."""
    return _receiver(data, None if source is None else os.fspath(source), {}, env, home)


# --------------------------------------------------------------------------------------------
# Files


def _node_lines(node: yaml.Node | None, file: str) -> dict[str, int]:
    """1-based line of every key path (``a``, ``a.b``, ``a[2]``); rejects duplicate keys."""
    lines: dict[str, int] = {}
    seen: set[int] = set()

    def walk(node: yaml.Node, prefix: str) -> None:
        if id(node) in seen:  # an alias, possibly recursive
            return
        seen.add(id(node))
        if isinstance(node, yaml.MappingNode):
            first: dict[str, int] = {}
            for key_node, value_node in node.value:
                if not isinstance(key_node, yaml.ScalarNode) or key_node.value == "<<":
                    continue
                line = key_node.start_mark.line + 1
                path = prefix + key_node.value
                if key_node.value in first:
                    where = f"at lines {first[key_node.value]} and {line}"
                    message = f"{file}: key {path!r} appears twice, {where}"
                    raise ConfigError(message, path=file, key=path)
                first[key_node.value] = line
                lines[path] = line
                if key_node.tag != "tag:yaml.org,2002:str":  # ('yes:' is the key True:
                    with contextlib.suppress(yaml.YAMLError):   # its line, by that name too)
                        lines.setdefault(prefix + str(yaml.safe_load(key_node.value)), line)
                walk(value_node, path + ".")
        elif isinstance(node, yaml.SequenceNode):
            base = prefix[:-1]
            for i, item in enumerate(node.value):
                lines[f"{base}[{i}]"] = item.start_mark.line + 1
                walk(item, f"{base}[{i}].")

    if node is not None:
        walk(node, "")
    return lines


_BRACKETED_IPV6_RE = re.compile(r"\[[0-9A-Fa-f.%]*:[0-9A-Fa-f:.%]*\]")


#: libyaml's loader where PyYAML has it: a trial's .rqprc of 1,000 queue names took 93 ms
#: to read with the Python one, read twice (nodes for the line numbers, then the data), at
#: every openConnection. Its mistakes are said by the Python loader (the same words as ever).
_FAST_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def _compose_and_construct(text: str, loader_class) -> tuple[object, object]:
    """One parse: the document's node (for the line numbers) and its data."""
    loader = loader_class(text)
    try:
        node = loader.get_single_node()
        return node, (loader.construct_document(node) if node is not None else None)
    finally:
        loader.dispose()


def read_yaml(path: Path) -> tuple[object, dict[str, int]]:
    """The one YAML loader of the project: ``(data, line of each key path)``, or a ConfigError
    that names the file, the line and the column (and says to quote bracketed IPv6)."""
    file = str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ConfigError(f"{file}: cannot read the file: {reason}", path=file) from None
    try:
        try:
            node, data = _compose_and_construct(text, _FAST_LOADER)
        except yaml.YAMLError:  # (said in the words of the Python loader, as always)
            node, data = _compose_and_construct(text, yaml.SafeLoader)
    except RecursionError:
        raise ConfigError(f"{file}: nested too deeply to be a config file", path=file) from None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        problem = exc.problem or exc.context or "syntax error"
        context = f" ({exc.context})" if exc.context and exc.problem else ""
        line = text.splitlines()[mark.line] if mark and mark.line < len(text.splitlines()) else ""
        if _BRACKETED_IPV6_RE.search(line):  # '- [::1]:7460' is a YAML list followed by junk
            context += "; quote IPv6 addresses in brackets: '[::1]:7460'"
        message = f"{file}: {where}invalid YAML: {problem}{context}"
        raise ConfigError(message, path=file) from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{file}: invalid YAML: {exc}", path=file) from None
    try:
        return data, _node_lines(node, file)
    except RecursionError:  # (a re-check's 1,000 nested lists: a traceback, no ConfigError)
        raise ConfigError(f"{file}: nested too deeply to be a config file", path=file) from None


def _not_a_file(path: Path) -> str | None:
    """Why ``path`` is no file to read, or None. A directory on the way that cannot be searched
    is a reason too, not an exception (a trial: ``chmod 000`` of the config's directory, then
    a reload, stopped both agents with exit status 70)."""
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        return "no such file"
    except OSError as exc:
        return f"cannot read the file: {exc.strerror or exc}"
    return None if stat.S_ISREG(mode) else "is not a file"


def find_rqprc(
    path: _PathArg = None,
    *,
    env: Env = None,
    cwd: _PathArg = None,
    home: _PathArg = None,
) -> Path:
    """The ``.rqprc`` to use: ``path``, ``$RQPRC``, ``./.rqprc``, ``~/.rqprc``, ``/etc/rqp/rqprc``.

    A file named by ``path`` or ``$RQPRC`` must exist; the other places are skipped when absent.
    """
    env = os.environ if env is None else env
    here = Path(cwd) if cwd is not None else Path.cwd()
    for given, origin in ((path, "given explicitly"), (env.get("RQPRC"), "named by $RQPRC")):
        if given:
            found = here / Path(given).expanduser()
            if problem := _not_a_file(found):
                raise ConfigError(f"{found}: {problem} ({origin})", path=str(found))
            return found
    places = list(dict.fromkeys(  # (the working directory may be HOME: looked at once)
        [here / ".rqprc", Path(_home_dir(env, home)) / ".rqprc", SYSTEM_RQPRC]))
    looked, unreachable = ["$RQPRC (not set)"], None
    for place in places:
        problem = _not_a_file(place)
        if problem == "no such file":
            looked.append(str(place))
        elif problem is not None and problem.startswith("cannot read"):
            # A directory on the way this user may not search (root's HOME, for a service
            # user): no .rqprc for it there, unless one comes after, which it must not be
            # passed over for (a trial's drain, given its receiver config, was refused with
            # "~/.rqprc: cannot read the file (given explicitly)", HOME being root's).
            looked.append(f"{place} ({problem.removeprefix('cannot read the file: ')})")
            unreachable = unreachable or (place, problem)
        elif unreachable is not None:
            raise ConfigError(f"{unreachable[0]}: {unreachable[1]} (the .rqprc looked at "
                              f"before {place})", path=str(unreachable[0]))
        elif problem is not None:  # (one there that is no file is said, not skipped)
            raise ConfigError(f"{place}: {problem} (found as the .rqprc)", path=str(place))
        else:
            return place
    raise NoRqprcFound(f"no .rqprc found; looked at: {', '.join(looked)}")


def agent_queue(key: int, config: SenderConfig | None = None) -> str | None:
    """Which of the agents' own queues ``key`` is ("the transmission queue", "DEAD.LETTER.Q",
    or the default one of either; ``config``'s or, with none, the defaults), or None for an
    application's queue. No receiving MCA offers them, so nothing may be sent there: a SURE
    message for one waited for ever (``openConnection``, a replay rule's ``to``,
    ``resubmit --to``)."""
    xmit, dead = (DEFAULT_TRANSMISSION_QUEUE, DEFAULT_DEAD_LETTER_QUEUE) if config is None \
        else (config.transmission_queue, config.dead_letter_queue)
    return {DEFAULT_TRANSMISSION_QUEUE: "the default transmission queue",
            DEFAULT_DEAD_LETTER_QUEUE: "the default DEAD.LETTER.Q",
            xmit: "the transmission queue", dead: "DEAD.LETTER.Q"}.get(key)


def load_sender_config(
    path: _PathArg = None,
    *,
    env: Env = None,
    cwd: _PathArg = None,
    home: _PathArg = None,
) -> SenderConfig:
    """Find (see :func:`find_rqprc`), read and validate the ``.rqprc``."""
    found = find_rqprc(path, env=env, cwd=cwd, home=home)
    data, lines = read_yaml(found)
    return _sender(data, str(found), lines, env, home)


def load_receiver_config(
    path: _PathArg = None,
    *,
    env: Env = None,
    home: _PathArg = None,
) -> ReceiverConfig:
    """Read and validate a receiver config; with no ``path``, all defaults."""
    if path is None:
        return _receiver(None, None, {}, env, home)
    file = Path(path).expanduser().absolute()
    if problem := _not_a_file(file):
        raise ConfigError(f"{file}: {problem}", path=str(file))
    data, lines = read_yaml(file)
    return _receiver(data, str(file), lines, env, home)


def receiver_config_path(given: str | os.PathLike | None = None) -> str | None:
    """The receiving MCA's config a tool of this host reads: ``given``, else
    :data:`SYSTEM_RECEIVER_CONFIG` if it exists, else None."""
    if given is not None:
        return str(given)
    return str(SYSTEM_RECEIVER_CONFIG) if SYSTEM_RECEIVER_CONFIG.exists() else None


def load_names_config(rqprc: str | os.PathLike | None = None,
                      receiver_config: str | os.PathLike | None = None,
                      say: Callable[[str], None] = lambda text: None):
    """Where a tool of this host finds queue names and ``dead_letter_queue``: the ``.rqprc``
    (as :func:`load_optional_rqprc`); where there is none, or it is still the template
    scripts/install put there (a host that only receives leaves it so: a trial's drain
    timer failed on it every run), the receiving MCA's config (``receiver_config``, else
    :data:`SYSTEM_RECEIVER_CONFIG` if it exists); else None (the defaults). A template with
    no receiver config is refused, as before. ``say`` is told which it read, when not the
    .rqprc."""
    receiver_config = receiver_config_path(receiver_config)
    try:
        config = load_optional_rqprc(rqprc)
    except ConfigError as exc:
        if exc.key != TEMPLATE_KEY or receiver_config is None:
            raise  # (a template and nothing else: which DEAD.LETTER.Q is unknown)
        say(f"{exc.path} is the template scripts/install put there, not a configuration (a "
            "host that only receives): not read")
        config = None
    if config is None and receiver_config is not None:
        config = load_receiver_config(receiver_config)
        say(f"queue names and dead_letter_queue {config.dead_letter_queue:#x} from "
            f"{receiver_config}")
    return config


def load_optional_rqprc(path: str | os.PathLike | None = None):
    """The ``.rqprc`` given (it must exist and be valid) or found as :func:`find_rqprc`
    finds it; None when none is given, ``$RQPRC`` is not set and none is in the usual places.
    The archive tools need one only for queue names and the sending path."""
    if not path and not os.environ.get("RQPRC"):
        try:
            path = find_rqprc()
        except NoRqprcFound:  # (only that: a re-check's drain passed over an error naming a
            return None  # .rqprc it could not reach, and drained the default queue instead)
    return load_sender_config(path)
