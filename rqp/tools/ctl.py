"""rqpctl: operator commands for RQP.

``rqpctl dlq replay --archive DIR --rules RULES.yaml [--rqprc FILE] [--dry-run] [--rate N]
[--limit N] [--follow [--poll SECONDS]] [--drain]``: put archived dead letters back, forward or
discard them by rules (:mod:`rqp.tools.replay`); ``--follow`` goes on as dead letters arrive
until SIGTERM/SIGINT, ``--drain`` first moves ``DEAD.LETTER.Q`` into the archive (each round).
Exit status 0 if no record failed (or, for a dry run, would fail; always for ``--follow``),
1 if one did, 2 for a usage or configuration error.

``rqpctl dlq list --archive DIR [--limit N]``: a short table of the archive (:mod:`rqp.storage.archive`).

``rqpctl dlq show ID --archive DIR [--bytes N]``: one archived dead letter in full.

``rqpctl dlq resubmit ID... --archive DIR [--to QUEUE] [--edit] [--notices] [--rqprc FILE]``:
put these back now (one-off repair; ``--edit`` opens ``$VISUAL`` / ``$EDITOR`` on the payload
first; a notice only with ``--notices``).
Exit status 0 if every one was resubmitted, 1 if one was not.

``rqpctl status | metrics | queues | send | receive``: the running agents and the local queues
(:mod:`rqp.tools.ctl_agents`, which lists the exit codes).

``rqpctl tls init-ca | issue | show``: certificates for RQP over TLS (:mod:`rqp.tools.tls`).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

from rqp.cli import add_version, count, number, positive_seconds
from rqp.protocol.constants import DEFAULT_DEAD_LETTER_QUEUE
from rqp.protocol.errors import ConfigError, QueueError, RQPError
from rqp.config import TEMPLATE_KEY, ReceiverConfig, load_names_config, load_optional_rqprc
from rqp.report.schema import row_problem
from rqp.storage.archive import (
    ROW_KEYS, ArchiveError, LockHeld, UnreadableLine, archive_files, archived_spill, find_rows,
    id_problem, is_notice, iso_utc, read_archive_lines, row_payload,
)
from rqp.system import signals
from rqp.system.control import ControlError
from rqp.system.queues import LocalQueue, format_key
from rqp.system.service import EXIT_ANOTHER_RUNS, sender_serving
from rqp.tools import tls as tls_tool
from rqp.tools.ctl_agents import add_commands
from rqp.tools.replay import (
    DEFAULT_POLL, DEFAULT_RATE, NOTICE_REFUSED, Follower, NotConfirmed, Replayer,
    ReplayRefused, RetryLedger, Rule, RulesFile, TransmissionPutter, load_rules, names_a_host,
    resubmit,
)

log = logging.getLogger("rqp.tools.ctl")
rate = number(float, minimum=0, inclusive=False, what="a number of records per second")


def _say(text: str) -> None:
    print(text, flush=True)


class _LazyPutter:
    """Starts the sending path (and a sending MCA if none runs, unless ``start_sender`` is
    false) at the first message only."""

    def __init__(self, config, rqprc, start_sender: bool = True) -> None:
        self.config = config
        self.rqprc = rqprc
        self.start_sender = start_sender
        self.putter: TransmissionPutter | None = None

    def ready(self) -> str | None:
        """Why nothing should be put now, or None: with no sending MCA to start, one must
        serve the transmission queue, or a record put there would only wait (and be counted
        as a retry)."""
        xmit = self.config.transmission_queue
        if self.start_sender or sender_serving(xmit):
            return None
        return f"no sending MCA serves transmission queue {format_key(xmit)}: nothing put"

    def __call__(self, queue_key: int, payload: bytes, replay_key: int = 0, **extras) -> None:
        if self.putter is None:
            try:
                self.putter = TransmissionPutter(self.config, self.rqprc,
                                                 start_sender=self.start_sender)
            except RQPError as exc:
                raise NotConfirmed(str(exc)) from None
        self.putter(queue_key, payload, replay_key, **extras)


def _archive(args) -> Path:
    archive = Path(args.archive)
    if getattr(args, "drain", False) and not archive.exists():
        archive.mkdir(parents=True)  # as the drain would: it fills it
    if not archive.is_dir():  # (list's said "no such directory" of a file: a re-check)
        raise ConfigError(f"{archive}: "
                          f"{'is not a directory' if archive.exists() else 'no such directory'}"
                          " (--archive)")
    return archive


def _stop_on_signals(hangup: Callable[[], None] | None = None) -> threading.Event:
    """SIGTERM and SIGINT stop after the record in hand (a second: at once); SIGHUP calls
    ``hangup`` (``--follow``: read the rules again), or without one stops as they do (a
    trial's replay died of it without a word or a summary)."""
    stop = threading.Event()

    def on_signal(sig, _frame):
        if sig == signal.SIGHUP and hangup is not None:
            hangup()
            return
        if stop.is_set():
            raise KeyboardInterrupt
        _say(f"{signal.Signals(sig).name}: stopping after the record in hand")
        stop.set()

    signals.handle(on_signal, (signal.SIGTERM, signal.SIGINT, signal.SIGHUP))
    return stop


class _Drain:
    """``--drain``: runs ``rqp-dlq-drain --once`` into the archive (as a command: ``rqp.tools``
    does not import the agents) and says what it did; ``pending()`` is whether the queue holds
    anything, read from the kernel (``msg_qnum``), so that an idle round costs no process."""

    def __init__(self, archive: Path, config) -> None:
        if config is None:  # (as the drain finds it: the receiver's config of a host with
            config = load_names_config(None)  # no .rqprc; a review saw them differ)
        self.queue = config.dead_letter_queue if config is not None else \
            DEFAULT_DEAD_LETTER_QUEUE
        self.argv = [sys.executable, "-m", "rqp_agents.drain", "--once", "--archive",
                     str(archive)]
        if config is not None and config.source:
            which = "--receiver-config" if isinstance(config, ReceiverConfig) else "--rqprc"
            self.argv += [which, str(config.source)]
        self.last_error = ""

    def _once(self, error: str) -> None:
        if error and error != self.last_error:  # said once, not every round
            _say(error)
        self.last_error = error

    def pending(self) -> bool:
        try:
            return LocalQueue.exists(self.queue) and LocalQueue.open(self.queue).depth > 0
        except QueueError as exc:  # (not readable: nothing the drain could do either)
            self._once(f"drain failed   cannot look at {format_key(self.queue)}: {exc}")
            return False

    def __call__(self) -> bool:
        done = subprocess.run(self.argv, capture_output=True, text=True,
                              stdin=subprocess.DEVNULL)
        for line in done.stdout.splitlines():
            if line and not line.startswith("drained 0 "):
                _say(line)
        error = (done.stderr.strip().splitlines() or [""])[-1]
        # (75: another drain holds the queue, the drain timer's: it drains, no failure)
        ok = done.returncode in (0, EXIT_ANOTHER_RUNS)
        self._once("" if ok else f"drain failed   rqp-dlq-drain exited with "
                   f"{done.returncode}: {error}")
        return ok


def _replay(args) -> int:
    # SIGHUP taken first (a re-check's handler died of a reload 0.2 s after its start, as
    # Python's default: with --follow, a reload request kept for its rules; else a stop)
    hangup = threading.Event()
    stop = _stop_on_signals(hangup.set if args.follow else None)
    archive = _archive(args)
    template = None
    try:
        config = load_optional_rqprc(args.rqprc)
    except ConfigError as exc:  # (a host that only receives keeps the installed template: its
        if exc.key != TEMPLATE_KEY:  # handler may still discard and keep, not send)
            raise
        config, template = None, exc
    if args.poll is not None and not args.follow:
        raise ConfigError("--poll is for --follow")

    def can_send(rules: list[Rule]) -> None:
        if args.dry_run or not any(r.action in ("retry", "forward") or r.then == "forward"
                                   for r in rules):
            return
        if template is not None:
            raise ConfigError(f"{args.rules}: retry and forward put messages on the transmission "
                              f"queue of a .rqprc: {template}")
        if config is None:
            raise ConfigError(f"{args.rules}: retry and forward put messages on the transmission "
                              "queue of a .rqprc: give --rqprc (none was found)")

    rules = load_rules(args.rules, config=config)
    can_send(rules)
    send = None
    if config is not None and template is None and not args.dry_run:
        # --follow is a service beside rqp-sender.service: a sending MCA it started would be
        # its child (stopped with it); while none takes records, it pauses. (Lazy: nothing
        # is started nor opened until a rule, maybe one a reload brings, puts a record.)
        send = _LazyPutter(config, config.source, start_sender=not args.follow)
    rules_file = RulesFile(args.rules, config, can_send, requested=hangup) if args.follow \
        else None
    drain = _Drain(archive, config) if args.drain and not args.dry_run else None
    replayer = Replayer(archive, rules, send=send, dry_run=args.dry_run, rate=args.rate,
                        limit=args.limit or None, config=config, out=_say, stop=stop,
                        follow=args.follow)
    if args.follow:
        follower = Follower(replayer, drain=drain, pending=drain and drain.pending,
                            poll=args.poll or DEFAULT_POLL, out=_say, rules=rules_file)
        _say(f"following {archive}" + (f", draining {format_key(drain.queue)} into it"
                                       if drain else "") + f" ({len(rules)} rule(s))")
        follower.run()
        _say(follower.summary())
        return 0
    if drain is not None and drain.pending():
        drain()
    replayer.run()
    _say(replayer.summary())
    return 1 if replayer.counts["failed"] else 0  # (a dry run: the status the run would
    # have, so that a script can try it first; a trial found 0 there, and 1 for the run)


def _dead_letter_id(text: str) -> str:
    """An argparse type: a dead letter's id, or its first digits (a trial's "dlq show 7"
    exited 1, where every other usage error exits 2)."""
    problem = id_problem(text)
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return text


def _hexdump(data: bytes) -> list[str]:
    lines = []
    for offset in range(0, len(data), 16):
        chunk = data[offset:offset + 16]
        hexes = " ".join(f"{b:02x}" for b in chunk)
        text = "".join(chr(b) if 0x20 <= b < 0x7F else "." for b in chunk)
        lines.append(f"  {offset:08x}  {hexes[:23]:<23}  {hexes[24:]:<23}  |{text}|")
    return lines


def _show(args) -> int:
    archive = _archive(args)
    places = find_rows(archive, [args.id])[args.id]
    path, index, row = places[0]
    lines = len(list(read_archive_lines(path)))  # (a bad line in it stopped show: a trial)
    _say(f"{'file':<18} {path} (line {row.number} of {lines})")
    for other, _, copy in places[1:]:
        _say(f"{'also in':<18} {other} (line {copy.number}: the same dead letter archived "
             "twice)")
    for key in ROW_KEYS:
        if key in ("payload_b64", "payload_preview") or key not in row:
            continue
        _say(f"{key:<18} {row[key]}")
    for key in sorted(set(row) - set(ROW_KEYS)):
        _say(f"{key:<18} {row[key]}")
    problem = row_problem(row)
    if problem is not None:  # (as replay and resubmit say it)
        _say(f"{'NOT PUT BACK':<18} no dead-letter archive line: {problem}")
    elif is_notice(row):
        _say(f"{'NOTICE':<18} {NOTICE_REFUSED}")
    entry = RetryLedger(archive, writable=False).get(row)
    if entry.retries or entry.resent:
        done = []
        if entry.retries:
            done.append(f"retried {entry.retries} time(s), the last at {iso_utc(entry.last_ns)}")
        if entry.resent:
            done.append(f"forwarded or resubmitted {entry.resent} time(s), the last at "
                        f"{iso_utc(entry.resent_ns)}")
        later = int(row.get("timestamp_ns", 0)) > max(entry.last_ns, entry.resent_ns)
        _say(f"{'replay ledger':<18} this message (key {row.get('message_key')}) was "
             + "; ".join(done) + (": this dead letter came after that (a replay's)" if later
                                  else ": this dead letter was there before"))
    payload = row_payload(row)
    where = ""
    if row.get("truncated"):
        copy = archived_spill(archive, row["spill_path"]) if row.get("spill_path") else None
        where = (f"; the whole payload: {copy}" if copy is not None and copy.exists() else
                 f"; the whole payload: {row.get('spill_path') or 'lost (no spill file)'}")
    _say(f"{'payload':<18} {len(payload)} byte(s) kept of {row.get('original_length')}{where}")
    _say(f"{'preview':<18} {row.get('payload_preview', '')}")
    shown = payload if not args.bytes else payload[:args.bytes]
    for line in _hexdump(shown):
        _say(line)
    if len(shown) < len(payload):
        _say(f"  ... {len(payload) - len(shown)} more byte(s) (--bytes 0 shows all)")
    return 0


def _editor() -> str:
    editor = os.environ.get("VISUAL") or os.environ.get("EDITOR")
    if not editor:
        raise ConfigError("--edit: set $VISUAL or $EDITOR to the editor to use (e.g. "
                          "EDITOR=nano)")
    return editor


def _edit(row, payload: bytes) -> bytes:
    """``--edit``: the payload as ``$VISUAL`` / ``$EDITOR`` leaves it (run as git runs it,
    through the shell), or ReplayRefused: not UTF-8, the editor failed, empty, unchanged."""
    editor = _editor()
    try:
        payload.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ReplayRefused(f"the payload is not UTF-8 text (byte {exc.start}): it cannot be "
                            "edited in a text editor; resubmit it without --edit") from None
    with tempfile.TemporaryDirectory(prefix="rqp-resubmit-") as directory:
        path = Path(directory) / f"{row['id']}.payload"
        path.write_bytes(payload)
        done = subprocess.run(["sh", "-c", f'{editor} "$@"', editor, str(path)])
        if done.returncode != 0:
            raise ReplayRefused(f"the editor ({editor}) exited with status {done.returncode}: "
                                "nothing resubmitted")
        edited = path.read_bytes()
    if edited.endswith(b"\n") and not payload.endswith(b"\n"):
        edited = edited[:-1]  # the newline an editor adds at the end of the last line
    if not edited.strip():
        raise ReplayRefused("the edited payload is empty: nothing resubmitted (as git commit "
                            "aborts on an empty message)")
    if edited == payload:
        raise ReplayRefused("the payload is unchanged: nothing resubmitted (resubmit without "
                            "--edit to send it as it is)")
    return edited


def _resubmit(args) -> int:
    archive = _archive(args)
    config = load_optional_rqprc(args.rqprc)
    if config is None:
        raise ConfigError("resubmit puts messages on the transmission queue of a .rqprc: give "
                          "--rqprc (none was found)")
    to = None
    if args.to is not None:
        if (problem := names_a_host(args.to)) is not None:
            raise ConfigError(f"--to {args.to}: {problem}")
        try:
            to = config.resolve_queue(args.to)
        except ConfigError as exc:
            raise ConfigError(f"--to: {exc}") from None
        if (agents := config.agent_queue(to)) is not None:
            raise ConfigError(f"--to {args.to}: {to:#010x} is {agents} of the agents, not a "
                              "destination (no receiving MCA offers it)")
    if args.edit:
        _editor()  # (before anything is read)
    counts = resubmit(archive, args.ids, _LazyPutter(config, config.source), to=to,
                      edit=_edit if args.edit else None, config=config, out=_say,
                      notices=args.notices)
    _say(f"resubmitted {counts['resubmitted']}, failed {counts['failed']}")
    return 1 if counts["failed"] else 0


def _cut(text: str, width: int) -> str:
    return text if len(text) <= width else text[:width - 1] + "\u2026"


def _list(args) -> int:
    archive = _archive(args)
    header = ("ID", "TIMESTAMP", "REASON", "QUEUE", "TYPE", "MTYPE", "PRIO", "MESSAGE KEY", "HOST",
              "BYTES", "PREVIEW")
    table, unreadable = [], []
    total = files = 0
    for path in archive_files(archive):
        try:  # (one bad file hid every row of the others, one bad line those of its file)
            rows = list(read_archive_lines(path))
        except ArchiveError as exc:
            unreadable.append(f"{exc} (its rows are not listed)")
            continue
        files += 1
        bad = 0  # (lines of this file not listed: a few named, the rest counted -- a
        # re-check's file of schema 3 gave one error line per line)
        for index, row in enumerate(rows):
            if isinstance(row, UnreadableLine):
                problem = f"{path}: line {row.number}: {row.problem} (not listed)"
            elif (why := row_problem(row)) is not None:  # (a trial: listed as any other,
                # which replay and the report then refused)
                problem = (f"{path}: line {index + 1}: no dead-letter archive line: {why} "
                           "(not listed; replay fails it, the report leaves it out)")
            else:
                problem = None
            if problem is not None:
                bad += 1
                if bad <= BAD_LINES_NAMED:
                    unreadable.append(problem)
                continue
            total += 1
            if args.limit and len(table) >= args.limit:
                continue
            table.append((
                str(row.get("id", ""))[:12],  # (enough for show and resubmit, as git's)
                str(row.get("timestamp", ""))[:19].replace("T", " "),
                str(row.get("reason", "")),
                row.get("queue_name") or str(row.get("queue_key_hex", "")),
                str(row.get("message_type", "")) + ("*" if is_notice(row) else ""),
                str(row.get("mtype", 1)),  # (a schema-1 row: 1 and 4)
                str(row.get("priority", 4)),
                str(row.get("message_key", "")),
                _cut(str(row.get("host", "")), 20),
                str(row.get("original_length", "")) + ("+" if row.get("truncated") else ""),
                _cut(str(row.get("payload_preview", "")), 40),
            ))
        if bad > BAD_LINES_NAMED:
            unreadable.append(f"{path}: {bad - BAD_LINES_NAMED} more line(s) not listed, as "
                              "those above")
    widths = [max([len(h)] + [len(r[i]) for r in table]) for i, h in enumerate(header)]
    for line in [header, *table]:
        _say("  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip())
    more = f"; showing the first {len(table)} (--limit 0 shows all)" if len(table) < total else ""
    _say(f"{total} archive row(s) in {files} file(s){more}")  # (rows: a dead letter archived
    # twice is two, which the report counts once -- a trial compared the two counts)
    if any(row[4].endswith("*") for row in table):
        _say("SURE*: a notice, written by a receiving MCA: the sending MCA of its host keeps "
             "the message and sends it again itself (replay keeps the row; resubmit asks for "
             "--notices)")
    for problem in unreadable:
        print(f"rqpctl: error: {problem}", file=sys.stderr)
    return 1 if unreadable else 0


#: Lines of one archive file that dlq list cannot list, named one by one; the rest counted.
BAD_LINES_NAMED = 3


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rqpctl", description=__doc__.splitlines()[0])
    add_version(parser)
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
    replay.add_argument("--follow", action="store_true",
                        help="go on as dead letters arrive (runmqdlq's WAIT) until SIGTERM or "
                        "SIGINT; exit status 0")
    replay.add_argument("--poll", metavar="SECONDS", type=positive_seconds,
                        help=f"--follow: look at the archive at least this often when idle "
                        f"(default {DEFAULT_POLL:g}; sooner while things happen)")
    replay.add_argument("--drain", action="store_true",
                        help="first move DEAD.LETTER.Q (the .rqprc's dead_letter_queue) into the "
                        "archive with rqp-dlq-drain --once; with --follow, each round it holds "
                        "records")
    replay.set_defaults(run=_replay)
    show = commands.add_parser("show", help="one archived dead letter in full",
                               description="Every field of one archived dead letter, where it "
                               "is, what replays did to its message, and its payload.")
    show.add_argument("id", metavar="ID", type=_dead_letter_id,
                      help="its id (rqpctl dlq list), or its first 6+ "
                      "digits")
    show.add_argument("--archive", metavar="DIR", required=True)
    show.add_argument("--bytes", metavar="N", type=count, default=256,
                      help="payload bytes shown at most (default 256; 0 = all)")
    show.set_defaults(run=_show)
    again = commands.add_parser(
        "resubmit", help="put archived dead letters back now (one-off repair)",
        description="Put these dead letters back as retry does (SURE, confirmed, with their "
        "original keys), on their queue or --to QUEUE; each leaves the archive once "
        "confirmed.")
    again.add_argument("ids", metavar="ID", nargs="+", type=_dead_letter_id,
                       help="ids (rqpctl dlq list), or their "
                       "first 6+ digits")
    again.add_argument("--archive", metavar="DIR", required=True)
    again.add_argument("--to", metavar="QUEUE", help="this queue (key or .rqprc name) instead "
                       "of the original one")
    again.add_argument("--edit", action="store_true",
                       help="edit each payload in $VISUAL or $EDITOR first (UTF-8 text only; "
                       "an empty or unchanged edit resubmits nothing)")
    again.add_argument("--notices", action="store_true",
                       help="put back notices too (SURE rows a receiving MCA wrote, marked "
                       "SURE* by list): their sender keeps each and sends it again, so only "
                       "if that sender is gone for good (else it arrives twice)")
    again.add_argument("--rqprc", metavar="FILE", help="queue names and the sending path "
                       "(default: $RQPRC, ./.rqprc, ~/.rqprc, /etc/rqp/rqprc)")
    again.set_defaults(run=_resubmit)
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
    signals.let_stops_through()  # (status --watch, receive: what stops them, gets through)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        code = args.run(args)
        sys.stdout.flush()  # (a reader that went away is found here, not at exit)
        return code
    except BrokenPipeError:  # whoever read the output went away (| head): as on SIGPIPE
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    except ConfigError as exc:
        print(f"rqpctl: {exc}", file=sys.stderr)
        return 2
    except ControlError as exc:
        print(f"rqpctl: {exc}", file=sys.stderr)
        return 3
    except LockHeld as exc:  # (as a drain that meets another: "try again later", not "failed")
        print(f"rqpctl: {exc}", file=sys.stderr)
        return EXIT_ANOTHER_RUNS
    except (ArchiveError, RQPError, OSError) as exc:
        print(f"rqpctl: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("rqpctl: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
