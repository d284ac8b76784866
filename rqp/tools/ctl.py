"""rqpctl: operator commands for RQP.

``rqpctl dlq replay --archive DIR --rules RULES.yaml [--rqprc FILE] [--dry-run] [--rate N]
[--limit N]``: put archived dead letters back, forward or discard them by rules
(:mod:`rqp.tools.replay`). Exit status 0 if no record failed (always, for a dry run: nothing is
done), 1 if one did, 2 for a usage or configuration error.

``rqpctl dlq list --archive DIR [--limit N]``: a short table of the archive (:mod:`rqp.storage.archive`).

``rqpctl status | metrics | queues | send | receive``: the running agents and the local queues
(:mod:`rqp.tools.ctl_agents`, which lists the exit codes).

``rqpctl tls init-ca | issue | show``: certificates for RQP over TLS (:mod:`rqp.tools.tls`).
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from pathlib import Path

from rqp.cli import count, number
from rqp.protocol.errors import ConfigError, RQPError
from rqp.config import load_optional_rqprc
from rqp.storage.archive import ArchiveError, archive_files, read_archive_file
from rqp.system.control import ControlError
from rqp.tools import tls as tls_tool
from rqp.tools.ctl_agents import add_commands
from rqp.tools.replay import (
    DEFAULT_RATE, NotConfirmed, Replayer, TransmissionPutter, load_rules,
)

log = logging.getLogger("rqp.tools.ctl")
rate = number(float, minimum=0, inclusive=False, what="a number of records per second")


def _say(text: str) -> None:
    print(text, flush=True)


class _LazyPutter:
    """Starts the sending path (and a sending MCA if none runs) at the first message only."""

    def __init__(self, config, rqprc) -> None:
        self.config = config
        self.rqprc = rqprc
        self.putter: TransmissionPutter | None = None

    def __call__(self, queue_key: int, payload: bytes, replay_key: int = 0, **extras) -> None:
        if self.putter is None:
            try:
                self.putter = TransmissionPutter(self.config, self.rqprc)
            except RQPError as exc:
                raise NotConfirmed(str(exc)) from None
        self.putter(queue_key, payload, replay_key, **extras)


def _replay(args) -> int:
    archive = Path(args.archive)
    if not archive.is_dir():
        raise ConfigError(f"{archive}: {'is not a directory' if archive.exists() else 'no such directory'}"
                          " (--archive)")
    config = load_optional_rqprc(args.rqprc)
    rules = load_rules(args.rules, config=config)
    send = None
    if not args.dry_run and any(r.action in ("retry", "forward") for r in rules):
        if config is None:
            raise ConfigError(f"{args.rules}: retry and forward put messages on the transmission "
                              "queue of a .rqprc: give --rqprc (none was found)")
        send = _LazyPutter(config, config.source)
    stop = threading.Event()

    def on_signal(sig, _frame):
        if stop.is_set():
            raise KeyboardInterrupt
        _say(f"{signal.Signals(sig).name}: stopping after the record in hand")
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    replayer = Replayer(archive, rules, send=send, dry_run=args.dry_run, rate=args.rate,
                        limit=args.limit or None, config=config, out=_say, stop=stop)
    replayer.run()
    _say(replayer.summary())
    return 1 if replayer.counts["failed"] and not args.dry_run else 0


def _cut(text: str, width: int) -> str:
    return text if len(text) <= width else text[:width - 1] + "\u2026"


def _list(args) -> int:
    archive = Path(args.archive)
    if not archive.is_dir():
        raise ConfigError(f"{archive}: no such directory (--archive)")
    header = ("TIMESTAMP", "REASON", "QUEUE", "TYPE", "MTYPE", "PRIO", "MESSAGE KEY", "HOST",
              "BYTES", "PREVIEW")
    table = []
    total = files = 0
    for path in archive_files(archive):
        files += 1
        for row in read_archive_file(path):
            total += 1
            if args.limit and len(table) >= args.limit:
                continue
            table.append((
                str(row.get("timestamp", ""))[:19].replace("T", " "),
                str(row.get("reason", "")),
                row.get("queue_name") or str(row.get("queue_key_hex", "")),
                str(row.get("message_type", "")),
                str(row.get("mtype", 1)),  # (a schema-1 row: 1 and 4)
                str(row.get("priority", 4)),
                str(row.get("message_key", "")),
                _cut(str(row.get("host", "")), 20),
                str(row.get("original_length", "")) + ("+" if row.get("truncated") else ""),
                _cut(str(row.get("payload_preview", "")), 40),
            ))
    widths = [max([len(h)] + [len(r[i]) for r in table]) for i, h in enumerate(header)]
    for line in [header, *table]:
        _say("  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip())
    more = f"; showing the first {len(table)} (--limit 0 shows all)" if len(table) < total else ""
    _say(f"{total} dead letter(s) in {files} file(s){more}")
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rqpctl", description=__doc__.splitlines()[0])
    groups = parser.add_subparsers(dest="group", required=True, metavar="GROUP")
    dlq = groups.add_parser("dlq", help="the dead-letter archive", description="The "
                            "dead-letter archive written by rqp-dlq-drain.")
    commands = dlq.add_subparsers(dest="command", required=True, metavar="COMMAND")
    replay = commands.add_parser(
        "replay", help="retry, forward, discard or keep archived dead letters by rules",
        description="Apply a rules table (first matching rule wins, none = keep) to every "
        "archived dead letter. See the README, section 'Dead-letter archive'.")
    replay.add_argument("--archive", metavar="DIR", required=True)
    replay.add_argument("--rules", metavar="RULES.yaml", required=True)
    replay.add_argument("--rqprc", metavar="FILE", help="queue names and the sending path "
                        "(default: $RQPRC, ./.rqprc, ~/.rqprc, /etc/rqp/rqprc)")
    replay.add_argument("--dry-run", action="store_true",
                        help="print what would be done to each record; change nothing")
    replay.add_argument("--rate", metavar="N", type=rate, default=DEFAULT_RATE,
                        help=f"messages put back per second at most (default {DEFAULT_RATE:g})")
    replay.add_argument("--limit", metavar="N", type=count, default=0,
                        help="stop after N records were retried, forwarded, discarded or "
                        "failed (kept ones do not count; 0 = no limit)")
    replay.set_defaults(run=_replay)
    listing = commands.add_parser("list", help="a short table of the archive")
    listing.add_argument("--archive", metavar="DIR", required=True)
    listing.add_argument("--limit", metavar="N", type=count, default=100,
                         help="rows shown at most (default 100; 0 = all)")
    listing.set_defaults(run=_list)
    add_commands(groups)
    tls_tool.add_commands(groups)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.run(args)
    except ConfigError as exc:
        print(f"rqpctl: {exc}", file=sys.stderr)
        return 2
    except ControlError as exc:
        print(f"rqpctl: {exc}", file=sys.stderr)
        return 3
    except (ArchiveError, RQPError, OSError) as exc:
        print(f"rqpctl: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("rqpctl: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
