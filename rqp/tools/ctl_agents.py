"""rqpctl commands that talk to the running agents and the local queues.

``rqpctl status [--json]``, ``rqpctl metrics``, ``rqpctl queues``, ``rqpctl send``,
``rqpctl receive``. Exit status (for scripts): 0 = fine; 1 = an error; 2 = a usage or
configuration error; 3 = an agent asked for is not running (or runs and does not answer:
frozen, hung); 4 = it runs, but a route is not healthy (retrying, no route, connecting), or
its dead letters have no room (held in memory by a sending MCA; not written by a receiving
MCA within the last NO_ROOM_RECENT seconds), or a receiving MCA failed to write its state_dir
within those seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import pwd
import sys
import time
from pathlib import Path

import yaml

from rqp import RQPError
from rqp.cli import msgtyp, mtype, number, positive_int, seconds
from rqp.config import (
    QUEUE_NAME_RE, SYSTEM_RECEIVER_CONFIG, ConfigError, NoRqprcFound, ReceiverConfig,
    default_state_dir, find_rqprc, load_receiver_config, load_sender_config, parse_host,
    parse_queue_key, receiver_config_path,
)
from rqp.system.control import (
    NOT_RUNNING_HERE, ControlError, ControlNotAnswering, ControlRefused, request,
)
from rqp.system.queues import QueueEmpty, format_key, list_queues
from rqp.system.service import AGENTS_USER, is_agent_queue
from rqp.storage.journal import FULL as JOURNAL_FULL

EXIT_NOT_RUNNING = 3
EXIT_UNHEALTHY = 4
#: status --watch: between a tenth of a second (each asks every agent) and a day (a trial's
#: 1e308 ended in a traceback, 1e-9 asked 250 times a second).
WATCH_SECONDS = number(float, minimum=0.1, maximum=86400, what="a number of seconds")
UNHEALTHY = ("stalled", "retrying", "no route", "connecting", "stopped")
EXIT_REFUSED = 2  # the agent refused the request (a bad argument), as argparse exits
#: What rqpctl ping asks for when .rqprc names no queue (QUEUE_NO is an answer too).
DEFAULT_PING_QUEUE = 0x52510001
#: Queues the receiving MCA's status line of offers names (the rest: how many; --json has all).
OFFERS_SHOWN = 20
#: Seconds after a receiving MCA last had no room in DEAD.LETTER.Q for a dead letter during
#: which status calls it unhealthy (the count only grows: a check must see it go away).
NO_ROOM_RECENT = 300.0
#: A receiving MCA with less room than this left in its share of DEAD.LETTER.Q has no room for
#: a dead letter now (the smallest, without payload, detail and hosts, is about 100 bytes;
#: a real one's detail and hosts take more): unhealthy while it lasts, restarts or not.
NO_ROOM_BYTES = 512


def _candidates(configured: str | None, runtime: str, state_dir: str, name: str) -> list[Path]:
    """Where agent ``name`` listens: its config's control_socket, else its state_dir, else
    its unit's runtime directory (the state_dir first: a trial's --receiver-config of a second
    receiver was answered by the service's). Not this process's $RUNTIME_DIRECTORY (as an
    agent's ``rqp.system.control.default_socket`` takes it): that is the caller's own, the
    same for both agents (a trial's status showed the sending MCA twice, once as the
    receiver)."""
    if configured:
        return [Path(configured)]
    return [Path(state_dir) / f"{name}.sock", Path(runtime)]


#: Where the units' agents listen (their runtime directories).
SENDER_UNIT_SOCKET = "/run/rqp/sender/control.sock"
RECEIVER_UNIT_SOCKET = "/run/rqp/receiver/control.sock"


def sender_socket(rqprc: str | None) -> tuple[str, list[Path]]:
    config = load_sender_config(find_rqprc(rqprc))
    name = config.agent_name
    return name, _candidates(config.control_socket, SENDER_UNIT_SOCKET, config.state_dir, name)


def receiver_socket(path: str | None) -> tuple[str, list[Path]]:
    path = receiver_config_path(path)
    config = load_receiver_config(path) if path else ReceiverConfig()
    return "receiver", _candidates(config.control_socket, RECEIVER_UNIT_SOCKET,
                                   config.state_dir, "receiver")


def _not_reached(name: str, exc: ControlError) -> str:
    """Why agent ``name`` could not be asked, in one line: 'not running', or 'not
    answering' when it runs but does not answer (frozen, hung)."""
    what = "not answering" if isinstance(exc, ControlNotAnswering) else "not running"
    return f"{name}: {what}: {exc}"


def ask(candidates: list[Path], command: str, **args) -> dict:
    """The first candidate socket that answers; ControlError naming them all if none does."""
    errors, frozen = [], []
    for path in candidates:
        try:
            return request(path, command, **args)
        except ControlRefused:
            raise  # the agent is there, and said no: that is the answer
        except ControlError as exc:
            errors.append(str(exc))
            if isinstance(exc, ControlNotAnswering):
                frozen.append(str(exc))
    if frozen:  # (only that: a trial's line also said "no agent is running here" of the
        # other place a socket may be, beside "it runs, but is frozen")
        raise ControlNotAnswering("; ".join(frozen))
    missing = [str(path) for path, error in zip(candidates, errors)
               if error.startswith(NOT_RUNNING_HERE)]
    if len(missing) == len(errors) > 1:  # (one line, not the same words for each place)
        raise ControlError(f"{NOT_RUNNING_HERE} (nothing at {' nor '.join(missing)})")
    raise ControlError("; ".join(dict.fromkeys(errors)))


def _targets(args, mistakes: dict[str, ConfigError] | None = None) -> list[tuple[str, list[Path]]]:
    """Each agent to ask, and where. ``mistakes`` (status): a config with a mistake is no
    error here; the agent is asked where it would listen, and the mistake kept there by
    agent (a trial: `rqpctl status` exited 2 at the config's mistake, where the README says
    the running agent's RELOAD REFUSED, exit 4)."""
    if args.socket:
        return [(path, [Path(path)]) for path in args.socket]
    out = []
    if args.agent in ("all", "sender"):
        try:
            out.append(sender_socket(args.rqprc))
        except NoRqprcFound:
            if args.agent == "sender":
                raise
            # (a receiving-only host; or this user finds none, and the unit's agent runs:
            # it is asked where the unit's listens. A trial's status left it out silently.)
            out.append(("sender", [Path(SENDER_UNIT_SOCKET)]))
        except ConfigError as exc:
            if mistakes is None or exc.path is None:
                raise
            mistakes["sender"] = exc
            out.append(("sender", _despite(exc.path, SENDER_UNIT_SOCKET, "sender-*")))
    if args.agent in ("all", "receiver"):
        try:
            out.append(receiver_socket(args.receiver_config))
        except ConfigError as exc:
            if mistakes is None or exc.path is None:
                raise
            mistakes["receiver"] = exc
            out.append(("receiver", _despite(exc.path, RECEIVER_UNIT_SOCKET, "receiver")))
    return out


def _despite(path: str, runtime: str, name: str) -> list[Path]:
    """Where the agent of config ``path``, which has a mistake, may listen: its
    ``control_socket`` or ``state_dir`` if they can be read from it, and the defaults
    (``name`` a pattern: a sending MCA's is named after its transmission queue)."""
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except (OSError, ValueError, yaml.YAMLError, RecursionError):  # (nested too deeply: a
        data = None  # re-check's traceback)
    data = data if isinstance(data, dict) else {}
    here = os.path.dirname(os.path.abspath(path))
    # (~ as the agents read it: a re-check's state_dir "~/sc" was not found)
    control, state = (os.path.expanduser(v) if isinstance(v, str) and v else None
                      for v in (data.get("control_socket"), data.get("state_dir")))
    out = [Path(here, control)] if control else []
    for directory in ([Path(here, state)] if state else []) + [Path(default_state_dir())]:
        out += sorted(directory.glob(f"{name}.sock"))
    return [*out, Path(runtime)]


def _ask_of_file(candidates: list[Path], source: str, name: str) -> dict:
    """The status of the agent (``name``: receiver, or a sender's) that runs config file
    ``source``: the candidates asked in turn, then the agents of that kind listening on this
    host (:func:`listening_agents`: where the file says no longer holds when a reload was
    refused for ``state_dir``, or a YAML mistake hides it; a trial's status said "not
    running"); another agent's answer is not its. ControlError if none does."""
    mine, others = os.path.realpath(source), []
    kind = "receiver" if name == "receiver" else "sender"  # (a sender's: sender-52510000)
    found = [p for p in listening_agents(kind) if p not in candidates]
    for path in [*candidates, *found]:
        try:  # (one found so: the process that listens must run as a trusted user; not its
            # pid against the status's: an agent in a pid namespace of its own, a re-check's)
            st = request(path, "status", **({"peer_uids": _trusted_uids()} if path in found
                                            else {}))
        except ControlError as exc:
            others.append(str(exc))
            continue
        if st.get("source") and os.path.realpath(st["source"]) == mine:
            st["asked_at"] = str(path)
            return st
        others.append(f"{path}: its agent runs {st.get('source') or 'no file'}")
    raise ControlError(f"no agent of {mine} answers ({'; '.join(others)})")


def listening_agents(name: str) -> list[Path]:
    """The control sockets of the agents of kind ``name`` (sender, receiver) that listen in
    this network namespace, found by the names the agents give them (``sender-*.sock``,
    ``receiver.sock``, the units'): the listening Unix sockets of /proc/net/unix, made by
    root, this user or the agents' user ``rqp`` (:func:`_made_by`: a re-check's user
    ``nobody`` made one and answered for the agent)."""
    try:
        lines = Path("/proc/net/unix").read_text(errors="replace").splitlines()[1:]
    except OSError:
        return []
    found, trusted = set(), _trusted_uids()  # (looked up once, not per socket)
    for line in lines:
        fields = line.split(None, 7)  # Num RefCount Protocol Flags Type St Inode Path
        if len(fields) < 8 or not int(fields[3], 16) & _ACCEPTING:
            continue
        path = fields[7]
        base = os.path.basename(path)
        if (name == "sender" and (path == SENDER_UNIT_SOCKET or
                                  base.startswith("sender-") and base.endswith(".sock"))) or \
                (name == "receiver" and (path == RECEIVER_UNIT_SOCKET or base == "receiver.sock")):
            if _made_by(path, trusted):
                found.add(Path(path))
    return sorted(found)


def _made_by(path: str, uids: frozenset[int]) -> bool:
    """Whether the socket file ``path`` was made by one of ``uids`` (a socket's file belongs
    to the process that bound it; only a first sieve: the process that listens is checked
    too, by ``SO_PEERCRED``, as a path can be swapped meanwhile)."""
    try:
        return os.lstat(path).st_uid in uids
    except OSError:
        return False


def _trusted_uids() -> frozenset[int]:
    """Root, this user, and the agents' user ``rqp`` if there is one."""
    try:
        rqp_uid = {pwd.getpwnam(AGENTS_USER).pw_uid}
    except KeyError:
        rqp_uid = set()
    return frozenset({0, os.geteuid(), *rqp_uid})


#: /proc/net/unix's flag of a listening socket (__SO_ACCEPTCON).
_ACCEPTING = 0x10000


def _config_file(args, name: str) -> str | None:
    """The config file agent ``name`` would be asked by, if any (status's fallback)."""
    if args.socket:
        return None
    if name == "receiver":
        return receiver_config_path(args.receiver_config)
    try:
        return str(find_rqprc(args.rqprc))
    except ConfigError:
        return None


def _ago(then: float | None, now: float) -> str:
    """How long ago, shortly: 42s, 5m03s, 2h05m, 3d04h."""
    if then is None:
        return "-"
    s = int(max(now - then, 0))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def _dlq_depth(st: dict) -> str:
    depth = st["dead_letter_queue_depth"]
    return "unknown: not there, or not readable by this agent" if depth is None else str(depth)


def _or_unknown(value) -> str:
    return "?" if value is None else str(value)


def _trouble(st: dict) -> str:
    trouble = st.get("transmission_queue_trouble")
    if trouble and trouble.startswith(JOURNAL_FULL):  # (its records are read: not journaled)
        return f"; {JOURNAL_FULL.upper()}{trouble[len(JOURNAL_FULL):]}"
    return f"; CANNOT READ IT: {trouble}" if trouble else ""


def _host_line(h: dict, now: float) -> str:
    """A host of the sending MCA's status: its connection, then what failed there."""
    # (of messages, said so: a trial read "256 failed tries" as 256 connection attempts)
    failed = [f"{h['failed_tries']} failed message tr{'y' if h['failed_tries'] == 1 else 'ies'}"
              ] if h.get("failed_tries") else []
    if h.get("heartbeat_failures"):
        failed.append(f"{h['heartbeat_failures']} heartbeat(s) unanswered, the last "
                      f"{_ago(h.get('heartbeat_failed_at'), now)} ago")
    return f"{h['host']} {h.get('connection_text', h['connection'])}" + (
        f" ({'; '.join(failed)})" if failed else "")


def _print_sender(st: dict) -> None:
    now = st["now"]
    print(f"sender   pid {st['pid']} on {st['host']}, up {_ago(st['started_at'], now)}; "
          f"transmission queue {st['transmission_queue']} "
          f"({_or_unknown(st['transmission_queue_depth'])} waiting{_trouble(st)}), "
          f"journal {st['journal_depth']}, "
          f"DEAD.LETTER.Q {st['dead_letter_queue']} "
          f"({_dlq_depth(st)}"
          + (f"; {st['dead_letters_held']} more held in memory: "
             f"{st.get('dead_letters_held_why') or 'it was full'}"
             if st.get("dead_letters_held") else "")
          + f"), in flight {st['in_flight']}"
          + (f", {st['waiting_for_route']} waiting for a route" if st.get("waiting_for_route")
             else ""))
    print("  hosts: " + ", ".join(_host_line(h, now) for h in st["hosts"]))
    if refused := _reload_refused(st):
        print("  " + refused)
    if st.get("start_reserve_missing"):
        print(f"  START RESERVE MISSING: {st['start_reserve']} cannot be made "
              f"({st['start_reserve_missing']}): no SURE record is journaled until it is; make "
              "room in state_dir (a sending MCA stopped now might not start again)")
    if not st["routes"]:
        print("  no messages sent yet")
        return
    print(f"  {'queue':34} {'peer':22} {'state':10} {'for':>7} {'sent':>8} {'bytes':>10} "
          f"{'waiting':>7} {'flight':>6} {'lag':>7} {'rtt ms':>6} {'errors':>6} {'counter':>7} "
          f"{'last ok':>8}  last error")
    for r in st["routes"]:
        queue = r["queue"] + (f" {r['name']}" if r["name"] else "")
        peer = r["peer"] or ("(broadcast)" if r.get("broadcast") else "-")
        since = r["stalled_since"] if r.get("stalled_since") is not None else r["since"]
        error = (f"{r['last_error']} ({_ago(r['last_error_at'], now)} ago)"
                 if r["last_error"] else "-")
        if r.get("retry_in") is not None:
            error += f"; next try in {r['retry_in']:.0f}s (rqpctl route retry: now)"
        rtt = "-" if r.get("rtt_p50_ms") is None else f"{r['rtt_p50_ms']:.1f}"
        print(f"  {queue[:34]:34} {peer[:22]:22} {r['state']:10} {_ago(since, now):>7} "
              f"{r['sent']:>8} {r['sent_bytes']:>10} {r['waiting']:>7} {r['in_flight']:>6} "
              f"{_ago(r['oldest_taken_at'], now) if r['waiting'] or r['in_flight'] else '-':>7} "
              f"{rtt:>6} {r['errors']:>6} {r['error_counter']:>7} "
              f"{_ago(r['last_confirmed_at'], now):>8}  {error}")
        if r.get("stalled_why"):
            print(f"    stalled: nothing confirmed for {_ago(r['stalled_since'], now)} with "
                  f"{r['waiting'] + r['in_flight']} message(s) waiting or in flight: "
                  f"{r['stalled_why']}")
        by_priority = r.get("waiting_by_priority") or {}
        if len(by_priority) > 1:  # several priorities waiting: how many of each
            print("    waiting by priority: " + ", ".join(f"{p}: {n}"
                                                      for p, n in by_priority.items()))
        for c in r.get("copies", ()):  # a broadcast queue: each host's copies
            print(f"    copies to {c['peer'][:22]:22} {c['state']:10} {c['delivered']:>6} "
                  f"delivered {c['declined']:>4} declined {c['waiting']:>6} waiting "
                  f"{c['in_flight']:>4} in flight {c['lost']:>4} lost "
                  + (f"{c['unconfirmed_at_close']:>4} unconfirmed at a close "
                     if c.get("unconfirmed_at_close") else "")
                  + f"{c['dead_lettered']:>4} dead {c['errors']:>4} errors"
                  + (f" (counter {c['error_counter']})" if c.get("error_counter") else "")
                  + f"  {c['last_error'] or '-'}")
    gone = st.get("forgotten") or {}
    if gone.get("queues"):
        print(f"  and idle queues let go (beyond the {st.get('queue_memory')} most recently "
              f"busy; {gone['queues']} times so far, a queue busy again counts anew): "
              f"sent {gone['sent']} ({gone['sent_bytes']} bytes), delivered "
              f"{gone['delivered']}, lost {gone['lost']}"
              + (f", unconfirmed at a close {gone['unconfirmed_at_close']}"
                 if gone.get("unconfirmed_at_close") else "") + ", dead-lettered "
              f"{gone['dead_lettered']}, errors {gone['errors']}")


def _window_line(w: dict) -> str:
    """The receiving MCA's de-duplication window, and whether it is too small to keep a key
    for its dedup_window_age."""
    if not w["max_keys"]:
        return ("de-duplication window: off (dedup_window_keys is 0): a SURE message sent "
                "again is put again")
    line = f"de-duplication window: {w['keys']:,} of {w['max_keys']:,} keys"
    if w["oldest_age"] is not None:
        line += f", the oldest {_ago(0, w['oldest_age'])} old"
    line += " (kept " + ("until pushed out" if w["max_age"] is None
                         else f"{_ago(0, w['max_age'])}") + ")"
    if w["full"]:
        line += ("; FULL: each new key pushes out the oldest, before dedup_window_age: a SURE "
                 "message sent again after its key left is put twice (raise "
                 "dedup_window_keys)")
    return line


#: What to look at when DEAD.LETTER.Q had no room: its drain, or its size (a trial's drain ran
#: every 3 s, and bursts of refused messages still filled a queue of 16 KiB).
DRAIN_HINT = ("is rqp-dlq-drain running, and is DEAD.LETTER.Q large enough for a burst of dead "
              "letters (kernel.msgmnb before it is made: /etc/sysctl.d/60-rqp-ipc.conf, which "
              "scripts/install puts there)?")


def _no_room(st: dict) -> str | None:
    """What a receiving MCA's status says of DEAD.LETTER.Q having no room for its dead letters,
    now or within NO_ROOM_RECENT (unhealthy); None if it had room all along."""
    if unmade := st.get("dead_letter_queue_unmade"):  # (not "no room": a trial's said so)
        return (f"{unmade}: a message to dead-letter is answered DELIVERED_ERROR (a SURE one "
                "stays with its sender, an UNSURE one is lost) until it can; free a queue "
                "(ipcs -q) or raise kernel.msgmni")
    room = st.get("dead_letter_room", NO_ROOM_BYTES)
    if room < NO_ROOM_BYTES:
        return (f"DEAD.LETTER.Q has NO ROOM for this receiver's dead letters now ({room} bytes "
                "left of the three quarters it may fill): a message to dead-letter is answered "
                "DELIVERED_ERROR (a SURE one stays with its sender, an UNSURE one is lost): "
                f"{DRAIN_HINT}")
    at = st.get("dead_letters_no_room_at")
    if at is not None and st["now"] - at < NO_ROOM_RECENT and st.get("dead_letters_no_room_why"):
        return (f"a dead letter was not written {_ago(at, st['now'])} ago: "
                f"{st['dead_letters_no_room_why']} (answered DELIVERED_ERROR: a SURE message "
                "stays with its sender, an UNSURE one is lost); it has been made again since")
    if at is not None and st["now"] - at < NO_ROOM_RECENT:
        return (f"DEAD.LETTER.Q had NO ROOM for a dead letter {_ago(at, st['now'])} ago "
                "(answered DELIVERED_ERROR: a SURE message stays with its sender, an UNSURE one "
                f"is lost): {DRAIN_HINT}")
    return None


def _reload_refused(st: dict) -> str | None:
    """What an agent's status says of its last reload when it was refused (unhealthy until a
    reload is taken or the agent restarts: it runs a config that is not its file's)."""
    last = st.get("last_reload")
    if not last or last.get("ok"):
        return None
    return (f"RELOAD REFUSED {_ago(last['at'], st['now'])} ago, still running the config it "
            f"had: {last['error']}")


def _state_trouble(st: dict) -> list[str]:
    """What a receiving MCA's status says of writes to its state_dir that failed within
    NO_ROOM_RECENT (unhealthy): its de-duplication window, its dead letters' spill files."""
    said = {"dedup": "connections closed, their last SURE messages unanswered (sent again)",
            "spill": "dead letters cut to one message, their payload's end not kept"}
    return [f"STATE_DIR TROUBLE {_ago(t['at'], st['now'])} ago ({t['what']}, {t['count']} "
            f"so far): {t['error']}: {said.get(t['what'], '')}"
            for t in st.get("state_dir_trouble") or () if st["now"] - t["at"] < NO_ROOM_RECENT]


def _print_receiver(st: dict) -> None:
    now = st["now"]
    print(f"receiver pid {st['pid']} on {st['host']}, up {_ago(st['started_at'], now)}; "
          f"listening {st['listen']}, DEAD.LETTER.Q {st['dead_letter_queue']} "
          f"({_dlq_depth(st)}), {len(st['connections'])} connection(s)"
          + (f" (and {unknown} not identified yet: in the TLS handshake)" if
             (unknown := st.get("open_connections", 0) - len(st["connections"])) > 0 else "")
          + f", {st['stats'].get('messages', 0)} message(s) put")
    stats = st["stats"]
    print(f"  {'TLS (mutual)' if st.get('tls') else 'plaintext RQP/1'}; "
          f"{stats.get('refused_connections', 0)} connection(s) refused by limits, "
          + (f"{evicted} idle one(s) closed to let new ones in, "
             if (evicted := stats.get('evicted_connections', 0)) else "")
          + f"{stats.get('handshake_failures', 0)} failed handshake(s), "
          f"{stats.get('denied', 0)} request(s) denied by peers rules, "
          f"{stats.get('protocol_errors', 0)} connection(s) closed for protocol errors")
    limited = [(stats.get(k, 0), what) for k, what in (
        ("dead_letters_header_only", "written without their payload (dead_letter_rate)"),
        ("dead_letters_suppressed", "not written (dead_letter_rate)"),
        ("dead_letters_no_room", "not written: no room in DEAD.LETTER.Q, or it was gone"))]
    if any(n for n, _ in limited):
        print("  dead letters " + "; ".join(f"{n} {what}" for n, what in limited if n))
    if no_room := _no_room(st):
        print("  " + no_room)
    if refused := _reload_refused(st):
        print("  " + refused)
    for line in _state_trouble(st):
        print("  " + line)
    for c in st["connections"]:
        who = f"{c['identity']} ({c['peer']})" if c.get("identity") else c["peer"]
        print(f"  from {who:24} for {_ago(c['since'], now):>7}: {c.get('frames', 0)} frames, "
              f"{c['messages']} put, {c.get('repeats', 0)} repeats, {c['dead_letters']} "
              f"dead-lettered, {c['asks']} asks, {c.get('refused', 0)} denied; may use "
              f"{c.get('may_use', '?')}")
    if st.get("dedup_window") is not None:
        print("  " + _window_line(st["dedup_window"]))
    offered = [q for q in st["queues"] if q["offered"]]
    shown = sorted(offered, key=lambda q: not q["name"])[:OFFERS_SHOWN]  # (named ones first)
    more = f", and {len(offered) - len(shown)} more (--json lists them)" \
        if len(offered) > len(shown) else ""
    print("  offers: " + (", ".join(q["queue"] + (f" {q['name']}" if q["name"] else "")
                                    for q in shown) + more or "nothing (no writable queue)"))


def status(args) -> int:
    if args.watch is None:
        return _status_once(args)
    if args.json:
        print("rqpctl status: --watch shows the table; for tools, call --json repeatedly",
              file=sys.stderr)
        return 2
    code = 0
    try:
        while True:
            if sys.stdout.isatty():
                print("\x1b[H\x1b[2J", end="")  # home, clear: the table in place
            print(f"every {args.watch:g}s, {time.strftime('%Y-%m-%d %H:%M:%S')} (Ctrl-C ends)")
            code = _status_once(args)
            sys.stdout.flush()
            time.sleep(args.watch)  # (the refresh interval itself)
    except KeyboardInterrupt:
        return code


def _no_rqprc(args) -> str | None:
    """Why, with --agent all, no .rqprc names the sending MCA to ask (None if one does)."""
    if args.agent != "all" or args.socket or args.rqprc:
        return None
    try:
        find_rqprc()
    except NoRqprcFound as exc:
        return str(exc)
    return None


def _receiver_configured(args) -> bool:
    return bool(args.receiver_config) or SYSTEM_RECEIVER_CONFIG.exists()


def _receiver_optional(args, targets) -> bool:
    """A sending host with no receiver config: a receiver that is not running is no fault
    (with --agent all; --agent receiver, a config or a socket named ask for one)."""
    return args.agent == "all" and not args.socket and not _receiver_configured(args) and \
        any(name != "receiver" for name, _ in targets) and _no_rqprc(args) is None


def _optional(args, targets, name: str, exc: ControlError) -> str | None:
    """What to say of agent ``name`` that does not answer (a ``none`` line for status) when
    that is no fault: a sending-only host's receiver, a receiving-only host's sender; None
    when it is one (exit 3)."""
    if isinstance(exc, ControlNotAnswering):
        return None  # (one that runs, frozen, is no such host: a trial was told "none")
    candidates = ", ".join(str(p) for n, paths in targets if n == name for p in paths)
    if name == "receiver" and _receiver_optional(args, targets):
        return (f"receiver: none answers here (no receiver config at {SYSTEM_RECEIVER_CONFIG}, "
                f"and no receiving MCA at {candidates}: a sending-only host; one run with a "
                "config of its own: --receiver-config FILE, or --socket PATH)")
    no_rqprc = _no_rqprc(args) if name != "receiver" else None
    if no_rqprc is not None and _receiver_configured(args):
        return (f"sender: none answers here ({no_rqprc}; and no sending MCA at {candidates}: "
                "a receiving-only host; one run with a .rqprc of its own: --rqprc FILE, or "
                "--socket PATH)")
    return None


def _not_answering(args, name: str, exc: ControlError) -> str:
    """The line of an agent that must answer and does not (exit 3), with why it was asked
    where it was when no .rqprc named it."""
    line = _not_reached(name, exc)
    no_rqprc = _no_rqprc(args) if name != "receiver" else None
    return line if no_rqprc is None else f"{line} ({no_rqprc})"


def _named_config(args, name: str):
    """The config named on the command line for agent ``name`` (loaded), if any."""
    if args.socket:
        return None
    if name == "receiver":
        return load_receiver_config(args.receiver_config) if args.receiver_config else None
    return load_sender_config(find_rqprc(args.rqprc)) if args.rqprc else None


def _serving(st: dict, config) -> dict:
    """``st``, if it is the status of the agent ``config`` is for (the receiving MCA of its
    state_dir, the sending MCA of its transmission queue); ControlError if it is another's
    (trial 8: the config's own receiver was not running, and the service's answered on the
    unit's socket: its status, exit 0)."""
    if config is None or config.control_socket:  # (the socket it names is the agent's)
        return st
    if st.get("agent") == "receiver":  # (one receiver a state_dir: its window is there)
        mine, theirs, what = os.path.realpath(config.state_dir), st.get("state_dir"), \
            "keeps its state in"
        if theirs is not None:
            theirs = os.path.realpath(theirs)
    else:
        mine, theirs, what = format_key(config.transmission_queue), \
            st.get("transmission_queue"), "serves transmission queue"
    if theirs is not None and theirs != mine:
        raise ControlError(f"no agent of {config.source or 'that config'} answers (the one "
                           f"that does {what} {theirs}, not {mine})")
    return st


def _where_the_file_says_or_elsewhere(args, name: str, candidates: list[Path]) -> dict:
    """The status of agent ``name`` where its config says it listens; else, if one runs
    that config file but listens elsewhere (the file changed state_dir, control_socket or
    transmission_queue since it started: a trial's reload was refused for it, and status
    said "not running"), its status, with ``listens_elsewhere`` saying so."""
    try:
        return _serving(ask(candidates, "status"), _named_config(args, name))
    except ControlNotAnswering:
        raise
    except ControlError as exc:
        source = _config_file(args, name)
        if source is None:
            raise
        try:  # (the candidates again: one may have answered as the agent of another file,
            # serving the transmission queue this file named before)
            st = _ask_of_file([], source, name)
        except ControlError:
            raise exc from None
        st["listens_elsewhere"] = (
            f"RUNS AN EARLIER {source}: found at {st['asked_at']}, not where the file says "
            f"now ({', '.join(map(str, candidates))}): the file changed what only a start "
            "applies (state_dir, control_socket, transmission_queue); a restart takes it")
        return st


def _status_once(args) -> int:
    code, answers, mistakes = 0, {}, {}
    targets = _targets(args, mistakes)
    for name, candidates in targets:
        try:
            if name in mistakes:  # (only the agent of that very file: its status says it)
                answers[name] = st = _ask_of_file(candidates, mistakes[name].path, name)
            else:
                answers[name] = st = _where_the_file_says_or_elsewhere(args, name, candidates)
        except ControlError as exc:
            if name in mistakes:  # (none of its own runs: the mistake is the answer, as ever)
                raise mistakes[name] from None
            answers[name] = {"agent": name, "running": isinstance(exc, ControlNotAnswering),
                             "error": str(exc)}
            if (none := _optional(args, targets, name, exc)) is not None:
                answers[name]["configured"] = False
                if not args.json:
                    print(none)
                continue
            code = EXIT_NOT_RUNNING  # (it wins over an unhealthy route)
            answers[name]["answering"] = False
            if not args.json:
                print(_not_answering(args, name, exc))
            continue
        if (any(r["state"] in UNHEALTHY for r in st.get("routes", ()))
                or st.get("dead_letters_held") or st.get("transmission_queue_trouble")
                or st.get("start_reserve_missing")
                or _no_room(st) or _state_trouble(st) or _reload_refused(st)) \
                and code != EXIT_NOT_RUNNING:
            code = EXIT_UNHEALTHY  # (dead letters held or not written: a drain down; a disk)
        if name in mistakes:  # (it runs what the file no longer says: a restart would fail)
            st["config_mistake"] = str(mistakes[name])
            code = code if code == EXIT_NOT_RUNNING else EXIT_UNHEALTHY
        elif st.get("listens_elsewhere"):  # (as with a mistake: a restart changes it)
            code = code if code == EXIT_NOT_RUNNING else EXIT_UNHEALTHY
        if not args.json:
            if name in mistakes:
                print(f"{name}: CONFIG HAS A MISTAKE: {mistakes[name]} (the running agent "
                      "keeps the config it had; it would not start with the file as it is)")
            elif elsewhere := st.get("listens_elsewhere"):  # (by its kind: a sending MCA's
                print(f"{st.get('agent', name)}: {elsewhere}")  # name is the file's, no more)
            (_print_sender if st["agent"] == "sender" else _print_receiver)(st)
    if args.json:
        print(json.dumps(answers, indent=2, default=str))
    return code


def trace(args) -> int:
    """Where one message is, by its RQP key, as each agent on this host knows it: exit 0 if
    one knows it, else 3 if one could not be asked (it might), else 1."""
    found = unasked = False
    answers = {}
    targets = _targets(args)
    for name, candidates in targets:
        try:
            got = ask(candidates, "trace", key=args.key)["trace"]
        except ControlError as exc:
            answers[name] = {"running": isinstance(exc, ControlNotAnswering),
                             "answering": False, "error": str(exc)}
            if (none := _optional(args, targets, name, exc)) is not None:
                answers[name]["configured"] = False
                if not args.json:  # (a sending-only host, or a receiving-only one: said, as
                    print(none)    # status says it)
                continue
            unasked = True
            if not args.json:
                print(_not_answering(args, name, exc))
            continue
        answers[name] = got
        found = found or got is not None
        if args.json:
            continue
        if got is None:
            print(f"{name}: knows nothing of key {args.key:#018x}")
            continue
        print(f"{name}: {_trace_line(got, time.time())}")
    if args.json:
        print(json.dumps(answers, indent=2, default=str))
    return 0 if found else EXIT_NOT_RUNNING if unasked else 1


#: Other peers that used a key named on trace's line (a re-check's 1,024 made 86 KB of it).
TRACE_ALSO_SHOWN = 5


def _trace_line(t: dict, now: float) -> str:
    queue = t.get("queue", "") + (f" {t['name']}" if t.get("name") else "")
    state = t["state"]
    if state == "in flight":
        return (f"in flight to {t['host']} for queue {queue}, taken {_ago(t['taken_at'], now)} "
                f"ago, attempt {t['attempts']}"
                + (f"; last error: {t['last_error']}" if t["last_error"] else ""))
    if state == "waiting":
        return (f"waiting for queue {queue} ({t['route_state']}), taken "
                f"{_ago(t['taken_at'], now)} ago, {t.get('failures', 0)} failed tries "
                f"({t['attempts']} MESSAGE frame(s) sent), priority "
                f"{t['priority']}" + (f", next try in {max(t['retry_at'] - now, 0):.0f}s"
                                      if t.get("retry_at") else "")
                + (f"; last error: {t['last_error']}" if t["last_error"] else ""))
    if "peer" in t:  # the receiving MCA (each peer's keys are its own: all that used it)
        also = t.get("also", ())
        more = len(also) - TRACE_ALSO_SHOWN
        return "; also ".join(
            f"{u['state']}, from {u['peer']}" + (f", {_ago(u['at'], now)} ago" if u.get("at")
                                                  else "")
            for u in (t, *also[:TRACE_ALSO_SHOWN])) + (
            f"; and {more} more peer(s) (--json lists them)" if more > 0 else "")
    held = (f"; held in memory, not yet on DEAD.LETTER.Q ({t['held_in_memory']}): lost if "
            "the sending MCA stops, unless SURE" if t.get("held_in_memory") else "")
    return f"{state}, queue {queue}, {_ago(t['at'], now)} ago: {t['detail']}{held}"


def message_key(text: str) -> int:
    try:
        key = int(text, 0)
    except ValueError:
        key = 0
    if not 0 < key < 1 << 64:
        raise argparse.ArgumentTypeError(f"expected a message key (as the logs print it, "
                                          f"e.g. 0x67cc37a400000005), got {text!r}")
    return key


def _sender_asked(args, queue) -> tuple[str, list[Path], int | None]:
    """The sending MCA to ask (its name and sockets: --socket, else its .rqprc's) and
    ``queue`` as a key (a name is looked up in .rqprc, needed then; None stays None)."""
    if args.socket and (queue is None or isinstance(queue, int)):
        return args.socket, [Path(args.socket)], queue
    path = find_rqprc(args.rqprc)
    key = None if queue is None else load_sender_config(path).resolve_queue(queue)
    if args.socket:
        return args.socket, [Path(args.socket)], key
    name, candidates = sender_socket(str(path))
    return name, candidates, key


def route(args) -> int:
    """rqpctl route retry QUEUE: the sending MCA ends that route's back-off now."""
    name, candidates, key = _sender_asked(args, args.queue)
    try:
        got = ask(candidates, "route", action=args.action, queue=key)
    except ControlError as exc:
        print(f"{name}: {exc}")
        return EXIT_REFUSED if isinstance(exc, ControlRefused) else EXIT_NOT_RUNNING
    r = got["route"]
    did = {"retry": "retrying now", "stop": "stopped: nothing more is sent until "
           "'rqpctl route start'", "start": "started again"}[args.action]
    print(f"{name}: queue {got['queue']}: {did}, {got['held']} message(s) waiting"
          + (" or in flight" if args.action == "retry" else "")
          + (f"; the route is {r['state']}" if r else " (no route known yet)"))
    return 0


def ping(args) -> int:
    """rqpctl ping HOST: the sending MCA connects to HOST as it would, asks, and times it."""
    if args.queue is None and not args.socket:  # (the first queue named in .rqprc)
        args.queue = next(iter(load_sender_config(find_rqprc(args.rqprc)).queues.values()),
                          DEFAULT_PING_QUEUE)
    name, candidates, key = _sender_asked(args, args.queue)
    if key is None:
        key = DEFAULT_PING_QUEUE
    try:
        got = ask(candidates, "ping", host=args.host, queue=key, timeout=30.0)
    except ControlError as exc:
        print(f"{name}: {exc}")
        return EXIT_REFUSED if isinstance(exc, ControlRefused) else EXIT_NOT_RUNNING
    how = "TLS" if got["tls"] else "plaintext"
    if "problem" in got:
        print(f"{got['host']} ({how}): {got['problem']}")
        return 1
    print(f"{got['host']} ({how}): connected in {got['connect_ms']:.1f} ms; QUEUE_ASK "
          f"{got['queue']} answered {got['answer']} in {got['rtt_ms']:.1f} ms")
    return 0


def host_argument(text: str) -> str:
    try:
        parse_host(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def metrics(args) -> int:
    """Each agent's metrics; of several agents, one exposition with an ``agent`` label on
    every sample (two expositions one after the other repeat HELP lines: not valid)."""
    code, texts, notes = 0, {}, []
    targets = _targets(args)
    for name, candidates in targets:
        try:
            agent = Path(name).name.removesuffix(".sock").split("-")[0]  # sender, receiver
            texts[agent if agent not in texts else name] = ask(candidates, "metrics")["text"]
        except ControlError as exc:
            if (none := _optional(args, targets, name, exc)) is not None:
                notes.append(_comment(none))  # (a comment: the exposition stays valid)
                continue
            notes.append(_comment(_not_answering(args, name, exc)))
            code = EXIT_NOT_RUNNING
    print("\n".join(notes), end="\n" if notes else "")
    if len(texts) == 1 and len(targets) == 1:
        print(next(iter(texts.values())), end="")
    elif texts:
        print(merge_expositions(texts), end="")
    return code


def _comment(text: str) -> str:
    """``text`` as one comment line of an exposition (a re-check's path with a newline in
    it split it, and promtool failed on the second half)."""
    return "# " + text.replace("\\", "\\\\").replace("\n", "\\n").replace("\r", "\\r")


def merge_expositions(texts: dict[str, str]) -> str:
    """One Prometheus exposition of several agents' (name -> text): each family's HELP and
    TYPE once, then its samples from every agent, each with an ``agent`` label. Line by line
    (the agents' own text format), not through a parser: a re-check's 97,000 lines took
    5.5 s in prometheus_client's."""
    heads: dict[str | None, list[str]] = {}
    samples: dict[str | None, list[str]] = {}
    for agent, text in texts.items():
        label = 'agent="' + agent.replace("\\", "\\\\").replace('"', '\\"') + '"'
        family = None
        for line in text.split("\n"):  # (not splitlines: a label value may hold U+2028,
            if not line:  # \x1c..\x1e, which it splits at and the text format does not)
                continue
            if line.startswith("#"):
                parts = line.split(None, 3)
                if len(parts) >= 3 and parts[1] in ("HELP", "TYPE"):
                    family = parts[2]
                    head = heads.setdefault(family, [])
                    samples.setdefault(family, [])
                    if not any(h.split(None, 2)[1] == parts[1] for h in head):
                        head.append(line)
                continue
            brace, space = line.find("{"), line.find(" ")
            if brace != -1 and (space == -1 or brace < space):  # name{labels} value
                rest = line[brace + 1:]
                line = line[:brace + 1] + label + ("" if rest.startswith("}") else ",") + rest
            else:  # name value
                line = line[:space] + "{" + label + "}" + line[space:]
            samples.setdefault(family, []).append(line)
            heads.setdefault(family, [])
    return "".join(line + "\n" for family in heads for line in (*heads[family],
                                                                 *samples[family]))


def queues(args) -> int:
    offered = {}
    try:
        candidates = [Path(args.socket)] if args.socket else \
            receiver_socket(args.receiver_config)[1]
        st = ask(candidates, "status")
        if not args.socket and args.receiver_config:
            st = _serving(st, load_receiver_config(args.receiver_config))
        offered = {q["queue_key"]: f"no: {q['why_not']}" if q.get("why_not") else q["offered"]
                   for q in st["queues"]}
        offered[int(st["dead_letter_queue"], 16)] = "no (an agent's own)"
        note, code = "", 0
    except ControlNotAnswering as exc:  # (a re-check: "no receiving MCA answers", exit 0)
        note, code = f" (unknown: the receiving MCA runs but does not answer: {exc})", \
            EXIT_NOT_RUNNING
    except ControlError:
        note, code = " (no receiving MCA answers at its control socket: 'offered' unknown; " \
            "--receiver-config names its config)", 0
    print(f"{'queue':12} {'messages':>9} {'bytes':>9} {'mode':>5} {'uid':>6} {'gid':>6} "
          f"offered{note}")
    for q in list_queues():
        said = offered.get(q.key)
        shown = "no (an agent's own)" if is_agent_queue(q.key) else \
            said if isinstance(said, str) else {True: "yes", False: "no"}.get(said, "?")
        print(f"{format_key(q.key):12} {q.messages:>9} {q.bytes:>9} {q.mode:>5o} {q.uid:>6} "
              f"{q.gid:>6} {shown}")
    return code


def send(args) -> int:
    import rqp
    from rqp.api import ensure_sender
    from rqp.system.service import sender_serving, serving_pid
    path = find_rqprc(args.rqprc)
    config = load_sender_config(path)
    queue_key = config.resolve_queue(args.queue)  # an unknown name: an error, nothing started
    xmit = config.transmission_queue
    # What an application's openConnection() does: start a sending MCA if none serves the
    # transmission queue, exactly one however many start at once (--no-start: only put).
    started = not args.no_start and ensure_sender(config, path.resolve(), say=False)
    if started:
        print(f"started a sending MCA (pid {serving_pid(xmit)}) for transmission queue "
              f"{format_key(xmit)}; its log: {config.log_path}")
    handle = rqp.openConnection(queue_key, rqprc=path, start_sender=False)
    data = args.message.encode() if args.message is not None else sys.stdin.buffer.read()
    kind = rqp.UNSURE_MSG if args.unsure else rqp.SURE_MSG
    try:
        rqp.sendMessage(handle, data, kind, sync=args.sync, timeout=args.timeout,
                        mtype=args.mtype, priority=args.priority, ttl=args.ttl)
    finally:
        rqp.closeConnection(handle)
    print(f"put {len(data)} bytes for {args.queue} on the transmission queue"
          + (" (journaled by the sending MCA)" if args.sync else ""))
    if not sender_serving(xmit):
        from rqp.system.service import sender_unit
        unit = sender_unit()
        print("warning: no sending MCA serves the transmission queue now; it waits there"
              + (" (--no-start)" if args.no_start else f" for the service ({unit}: systemctl "
                 "start rqp-sender)" if unit else ""))
        return EXIT_NOT_RUNNING
    return 0


def queue_argument(text: str) -> str | int:
    """An argparse type: a queue name (looked up in .rqprc later), or a queue key checked now,
    so that a bad key is not mistaken for a name (and reported as "no .rqprc found")."""
    if QUEUE_NAME_RE.fullmatch(text.strip()):
        return text.strip()
    try:
        return parse_queue_key(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(f"{exc} (or a queue name from .rqprc)") from None


def ttl_argument(text: str) -> float:
    """An argparse type: --ttl, checked as sendMessage checks it (so that 0 or a ttl past any
    date is a usage error, exit 2, as a negative one is)."""
    from rqp.api import expiry_ms
    try:
        value = seconds(text)
    except argparse.ArgumentTypeError:
        try:  # (a negative number: said as for 0)
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") \
                from None
    try:
        expiry_ms(value, None, time.time_ns())
    except RQPError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


def _queue_named(args) -> int:
    """The key of queue name ``args.queue``: from the .rqprc, or on a host that only receives
    (no .rqprc) from the receiving MCA's config, whose ``queues`` name them too."""
    try:
        path = find_rqprc(args.rqprc)
    except ConfigError as exc:
        receiver = receiver_config_path(args.receiver_config)
        if args.rqprc is not None or receiver is None:
            raise ConfigError(f"queue {args.queue!r} is a name, looked up in a .rqprc or the "
                              f"receiver's config (--receiver-config), or give its key: "
                              f"{exc}") from None
        return load_receiver_config(receiver).resolve_queue(args.queue)
    return load_sender_config(path).resolve_queue(args.queue)


def receive(args) -> int:
    import rqp
    queue = _queue_named(args) if isinstance(args.queue, str) else args.queue
    for n in range(args.count):
        try:
            data, mtype = rqp.receiveMessage(queue, timeout=args.timeout, mtype=args.mtype,
                                             with_type=True)
        except QueueEmpty:  # (fewer than --count is a failure too: a trial's --count 10
            print(f"no message within {args.timeout:g}s"  # exited 0 after 3)
                  + (f" ({n} of {args.count} taken)" if n else ""))
            return 1
        text = data.decode("utf-8", "replace")
        printable = text.isprintable() and "\ufffd" not in text
        print((f"{mtype}\t" if args.with_type else "") + (text if printable else data.hex(" ")))
    return 0


def add_commands(groups) -> None:
    def targets(p):
        p.add_argument("--agent", choices=("all", "sender", "receiver"), default="all")
        p.add_argument("--rqprc", metavar="FILE", help="the sender's .rqprc")
        p.add_argument("--receiver-config", metavar="FILE",
                       help=f"the receiver's config (default {SYSTEM_RECEIVER_CONFIG} if it "
                       "exists, else the defaults)")
        p.add_argument("--socket", metavar="PATH", action="append",
                       help="ask the agent on this control socket (repeatable)")

    p = groups.add_parser("status", help="routes, connections and queues of the running "
                          "agents", description="Exit 0 fine, 3 an agent is not running or "
                          "not answering, 4 a route is not healthy, the transmission queue "
                          "cannot be read, or dead letters found DEAD.LETTER.Q full (held in "
                          "memory; not written by a receiver in the last "
                          f"{NO_ROOM_RECENT / 60:g} minutes), or a receiver failed to write "
                          "its state_dir in those minutes.")
    targets(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--watch", metavar="SECONDS", nargs="?", type=WATCH_SECONDS, const=2.0,
                   help="show it again every SECONDS (default 2; 0.1 to 86400) until Ctrl-C")
    p.set_defaults(run=status)
    p = groups.add_parser("trace", help="where one message is, by its RQP key",
                          description="Asks the agents on this host what they know of the "
                          "message: waiting or in flight (the sending MCA), how it ended "
                          "(confirmed, lost, dead-lettered: among its last 100,000), or put "
                          "(the receiving MCA: a SURE message's key in its de-duplication "
                          "window). Exit 0 found, 1 nobody knows it.")
    p.add_argument("key", type=message_key, help="the message key, e.g. 0x67cc37a400000005")
    targets(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(run=trace)
    p = groups.add_parser("route", help="act on a route of the sending MCA",
                          description="retry: end the back-off of the queue's route now (its "
                          "waiting SURE messages are tried at once, connections too); stop: "
                          "send no more of the queue's messages (those in flight are answered; "
                          "the others wait, in the sending MCA's memory, until start; while "
                          "they fill what it holds, it takes no records for any queue); start: "
                          "send them again. A stop lasts until start or a restart. Exit 3 "
                          "when no sending MCA runs.")
    p.add_argument("action", choices=("retry", "stop", "start"))
    p.add_argument("queue", type=queue_argument, help="queue key or name from .rqprc")
    p.add_argument("--rqprc", metavar="FILE", help="the sender's .rqprc")
    p.add_argument("--socket", metavar="PATH", help="ask the sending MCA on this control "
                   "socket (a queue name is still looked up in .rqprc)")
    p.set_defaults(run=route)
    p = groups.add_parser("ping", help="connect to a receiving MCA as the sending MCA does, "
                          "ask, and time it", description="The sending MCA connects to HOST "
                          "(with its TLS files for that host), sends a QUEUE_ASK for --queue "
                          "(default: the first queue named in .rqprc) and reports the time to "
                          "connect and to the answer. Exit 0 answered, 1 not, 3 no sending MCA "
                          "runs.")
    p.add_argument("host", type=host_argument, help="HOST[:PORT] as in .rqprc's hosts")
    p.add_argument("--queue", type=queue_argument, help="queue key or name to ask for")
    p.add_argument("--rqprc", metavar="FILE", help="the .rqprc of the running sending MCA to "
                   "ask (its control socket): it pings with the settings it was started or "
                   "last reloaded with, TLS files included, not this file's")
    p.add_argument("--socket", metavar="PATH", help="ask the sending MCA on this control "
                   f"socket (--queue default: {DEFAULT_PING_QUEUE:#x} without .rqprc)")
    p.set_defaults(run=ping)
    p = groups.add_parser("metrics", help="the agents' Prometheus metrics")
    targets(p)
    p.set_defaults(run=metrics)
    p = groups.add_parser("queues", help="this host's System V queues, and whether the "
                          "receiver offers them")
    p.add_argument("--receiver-config", metavar="FILE")
    p.add_argument("--socket", metavar="PATH", help="ask the receiving MCA on this control "
                   "socket")
    p.set_defaults(run=queues)
    p = groups.add_parser("send", help="send one message (an operator's quick test)")
    p.add_argument("queue", help="queue key or name from .rqprc")
    p.add_argument("message", nargs="?", help="the text (default: standard input)")
    p.add_argument("--unsure", action="store_true", help="UNSURE instead of SURE")
    p.add_argument("--sync", action="store_true", help="wait until the sending MCA "
                   "journaled it")
    p.add_argument("--timeout", type=seconds, metavar="SECONDS", default=None,
                   help="wait at most this long for room on a full transmission queue (and, "
                   "with --sync, for the journal; default 30)")
    p.add_argument("--rqprc", metavar="FILE", help="the .rqprc to use (default: $RQPRC, "
                   "./.rqprc, ~/.rqprc, /etc/rqp/rqprc)")
    p.add_argument("--no-start", action="store_true", help="do not start a sending MCA if "
                   "none runs (the message then waits on the transmission queue; exit 3)")
    p.add_argument("--mtype", type=mtype, metavar="N", default=1,
                   help="the System V type it is put with at the destination (default 1)")
    p.add_argument("--priority", type=int, choices=range(10), metavar="0-9", default=4,
                   help="0 (lowest) to 9 (highest), default 4")
    p.add_argument("--ttl", type=ttl_argument, metavar="SECONDS", default=None,
                   help="dead-letter it EXPIRED if not delivered within this long")
    p.set_defaults(run=send)
    p = groups.add_parser("receive", help="take messages from a local queue",
                          description="Exit 0 once --count messages were taken, 1 if one did "
                          "not come within --timeout.")
    p.add_argument("queue", type=queue_argument, help="queue key or name from .rqprc")
    p.add_argument("--count", type=positive_int, metavar="N", default=1,
                   help="messages to take (default 1)")
    p.add_argument("--timeout", type=seconds, metavar="SECONDS", default=5.0,
                   help="wait at most this long for each message (default 5)")
    p.add_argument("--rqprc", metavar="FILE", help="where queue names are looked up")
    p.add_argument("--receiver-config", metavar="FILE",
                   help="where queue names are looked up without a .rqprc (default "
                   f"{SYSTEM_RECEIVER_CONFIG} if it exists)")
    p.add_argument("--mtype", type=msgtyp, metavar="N", default=0,
                   help="which message, as msgrcv's msgtyp: 0 the first (default), N the "
                   "first of type N, -N the first of the lowest type up to N")
    p.add_argument("--with-type", action="store_true",
                   help="print each message's type before it (TYPE, a tab, the message)")
    p.set_defaults(run=receive)


__all__ = ["add_commands", "status", "metrics", "queues", "send", "receive",
           "EXIT_NOT_RUNNING", "EXIT_UNHEALTHY"]
