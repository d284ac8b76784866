"""What both agents do around their work: signals, systemd notification, the control socket,
the metrics endpoint, reload on SIGHUP, and the command-line entry."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import errno
import json
import logging
import os
import resource
import signal
import ssl
import threading
import time
import weakref
from pathlib import Path
from typing import Callable

from rqp import RQPError
from rqp.system import signals
from rqp.system.control import Shared, exposition, serve_control, serve_metrics
from rqp.system.queues import format_key
from rqp.system.tls import file_digests
from rqp.system.service import EVENT_LOOP_VARIABLE, notify, tune_collector, watchdog_interval

#: Exit status of an agent stopped by an unexpected error (sysexits' EX_SOFTWARE). The units'
#: ``Restart=on-failure`` starts it again, and a sending MCA sends its journal first.
EXIT_UNEXPECTED = 70
#: Errors that a peer's connection ends with (reset, aborted, a failed TLS handshake): the
#: network's doing, never a bug of the agent's.
PEER_FAILURES = (ConnectionError, ssl.SSLError, EOFError)
#: Running out of file descriptors is logged at most once per this many seconds.
DESCRIPTOR_LOG_INTERVAL = 10.0


class RateLimitedLog:
    """Lines of one kind logged at most ``burst`` per ``interval`` seconds (a flood from the
    network must not fill the journal); the next line logged says how many were held back
    since when, naming them by ``what`` (a plural: the lines of one limit may differ, as a
    connection closed and one timed out). :attr:`count` counts them all."""

    def __init__(self, log: logging.Logger, interval: float, burst: int = 1, *,
                 what: str = "lines like it",
                 held_detail: Callable[[], str] | None = None, name: str = "") -> None:
        self.log = log
        self.what = what
        #: What its lines are about, said before a count flushed on its own (at a stop).
        self.name = name
        #: What more to say of the lines held back, when their count is said (then reset).
        self.held_detail = held_detail
        _LIMITS.add(self)
        self.interval = interval
        self.burst = burst
        self.count = 0
        self._window = -interval  # when the current interval began
        self._logged = 0  # lines logged in it
        self._held = 0
        self._held_since = 0.0  # wall-clock time of the first line held back
        self._held_level = logging.INFO

    def report(self, text: str, level: int = logging.WARNING, *args: object,
               extra: dict | None = None) -> bool:
        """Log ``text % args`` at ``level`` (``extra``: the event's fields, for JSON logs),
        unless this kind is over its burst: whether it was logged."""
        self.count += 1
        now = time.monotonic()
        if now - self._window >= self.interval:
            self._window, self._logged = now, 0
        if self._logged >= self.burst:
            if not self._held:
                self._held_since = time.time()
            self._held += 1
            self._held_level = level
            return False
        self._logged += 1
        message = text % args if args else text
        if self._held:
            message += f" ({self._take_held()})"
        self.log.log(level, "%s", message, extra=extra)
        return True

    def flush(self) -> None:
        """Log how many lines are held back, if any (they would be said with the next line
        of the limit, which may never come: at exit, or when a flood stops)."""
        if self._held:
            held = self._take_held()
            self.log.log(self._held_level, "%s", f"{self.name}: {held}" if self.name else held)

    def _take_held(self) -> str:
        """'N more <what> not logged since HH:MM:SS', and the count starts again."""
        since = time.strftime("%H:%M:%S", time.localtime(self._held_since))
        note, self._held = f"{self._held} more {self.what} not logged since {since}", 0
        detail = self.held_detail() if self.held_detail is not None else ""
        return f"{note}: {detail}" if detail else note


class KeyedRateLimitedLog:
    """A :class:`RateLimitedLog` for each key (a handshake's reason, a peer), so that one
    key's flood does not hide another's lines (a trial: a scanner's "no certificate" every
    10 s kept a real host's "certificate has expired" out of the log for good). At most
    ``keys`` of them, a key idle for three intervals giving its place to a new one; lines of
    further keys share one more limit, whose count of lines held back names their keys, up
    to ``keys`` of them (a re-check's peer made 65 reasons: the 66th, a real host's, was
    only counted)."""

    def __init__(self, log: logging.Logger, interval: float, *, what: str, others: str,
                 keys: int = 64) -> None:
        self.log, self.interval, self.keys = log, interval, keys
        self.what, self.others = what, others  # (of one key, of the keys beyond ``keys``)
        self._limits: dict[str, RateLimitedLog] = {}
        self._used: dict[str, float] = {}  # key -> when it was last reported (monotonic)
        self._others: RateLimitedLog | None = None
        self._others_held: collections.Counter[str] = collections.Counter()
        self._others_beyond = 0  # lines held back of keys beyond those named
        self._gone = 0  # lines of keys given up (for count)

    def report(self, key: str, text: str, level: int = logging.WARNING) -> None:
        now = time.monotonic()
        limit = self._limits.get(key)
        if limit is None and len(self._limits) >= self.keys:
            self._give_up_idle(now)
        if limit is None and len(self._limits) < self.keys:
            limit = self._limits[key] = RateLimitedLog(  # (named: a re-check's count said
                self.log, self.interval, what=self.what, name=key)  # at a stop named none)
        if limit is not None:
            self._used[key] = now
            limit.report(text, level)
            return
        if self._others is None:
            self._others = RateLimitedLog(self.log, self.interval, what=self.others,
                                          held_detail=self._others_detail)
        if not self._others.report(text, level):
            if key in self._others_held or len(self._others_held) < self.keys:
                self._others_held[key] += 1
            else:
                self._others_beyond += 1

    def _give_up_idle(self, now: float) -> None:
        """Free the places of keys not reported for three intervals (what they held back
        said first)."""
        for key, at in list(self._used.items()):
            if now - at >= 3 * self.interval:
                limit = self._limits.pop(key)
                del self._used[key]
                limit.flush()
                self._gone += limit.count

    def _others_detail(self) -> str:
        held = ", ".join(f"{n} of {key!r}" for key, n in self._others_held.most_common())
        if self._others_beyond:
            held += f", {self._others_beyond} of other kinds still"
        self._others_held.clear()
        self._others_beyond = 0
        return held

    @property
    def count(self) -> int:
        return self._gone + sum(limit.count for limit in self._limits.values()) + (
            self._others.count if self._others is not None else 0)


class SpellLog:
    """Lines for a condition that comes and goes (a full disk): a spell's start is logged at
    most once per ``again`` seconds, but a spell that lasts ``lasting`` seconds is logged all
    the same; its end is logged (at ``end_level``) when its start was, else at DEBUG. The next
    start logged counts the short spells that were not. Call :meth:`still` each time the
    condition is seen, :meth:`over` when it is gone."""

    def __init__(self, log: logging.Logger, again: float, lasting: float, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.log = log
        self.again = again
        self.lasting = lasting
        self.clock = clock
        self.active = False
        self._said_at = -again
        self._since = 0.0
        self._said = False  # (this spell's start)
        self._unsaid = 0  # short spells not logged since the last line
        self._text: str | None = None

    def still(self, text: str, level: int = logging.ERROR, *, extra: dict | None = None) -> None:
        now = self.clock()
        if not self.active:
            self.active, self._since, self._said = True, now, False
        if not self._said and (now - self._said_at >= self.again or
                               now - self._since >= self.lasting):
            more = f" (and {self._unsaid} more time(s) for a moment since the last such " \
                "line)" if self._unsaid else ""
            self.log.log(level, "%s%s", text, more, extra=extra)
            self._said_at, self._said, self._unsaid = now, True, 0
        elif text != self._text:
            self.log.debug("%s", text)
        self._text = text

    def over(self, text: str, end_level: int = logging.WARNING) -> None:
        if not self.active:
            return
        self.log.log(end_level if self._said else logging.DEBUG, "%s", text)
        self._unsaid += not self._said
        self.active, self._text = False, None


#: Every limit of this process, for :func:`flush_held_lines` at exit.
_LIMITS: weakref.WeakSet[RateLimitedLog] = weakref.WeakSet()


def flush_held_lines() -> None:
    """What every rate-limited log of this process held back, said once (at exit)."""
    for limit in list(_LIMITS):
        limit.flush()


class Daemon:
    """Base of the sending and receiving MCAs. Subclasses provide ``status()``, ``metrics()``
    and ``reload()`` (which raises :class:`RQPError` to refuse a bad config)."""

    #: What a first SIGTERM starts, for the log.
    stop_note = "stopping"

    def __init__(self, log: logging.Logger) -> None:
        self.log = log
        self._stopping = asyncio.Event()  # (bound to the running loop on first use)
        self._reloading = False
        #: The last SIGHUP's outcome (None: none since the start): ``at`` (Unix time), ``ok``,
        #: ``error`` (why it was refused). Status and metrics show it: a refused reload leaves
        #: the agent running a config that is no longer the file's.
        self.last_reload: dict | None = None
        self._servers: list = []
        self._pinger: asyncio.Task | None = None
        self._control_path: Path | None = None
        #: Set by :meth:`fatal`: the agent stops at once and exits with EXIT_UNEXPECTED.
        self.failed = False
        #: The exit status of a stop that is not a SIGTERM's (:meth:`stop_failing`).
        self.exit_status = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        #: Control requests refused for what the agent could not take (logged once per
        #: interval).
        self._bad_requests = RateLimitedLog(log, DESCRIPTOR_LOG_INTERVAL, what="control "
                                            "requests refused")
        #: Accepts refused for want of file descriptors (logged once per interval).
        self.out_of_descriptors = RateLimitedLog(log, DESCRIPTOR_LOG_INTERVAL,
                                                 what="accepts failed for want of descriptors")

    def files_replaced(self, blocks) -> str:
        """Which files of the ``tls:`` blocks (certificates, keys, CAs) were replaced since
        the last call (the start's), in words for a reload's log line ("" for none)."""
        digests = file_digests(blocks)
        before, self._tls_digests = getattr(self, "_tls_digests", digests), digests
        replaced = [path for path, digest in digests.items()
                    if path in before and before[path] != digest]
        return f"replaced: {', '.join(replaced)}" if replaced else ""

    def refuse_fixed(self, new, names: tuple[str, ...], agent: str):
        """``new`` (a config read again), or :class:`RQPError` (the reload refused, the running
        config kept) if a setting that only a start applies (a listening address, a socket, a
        directory, a queue) differs in it: a reload that took the rest would report a change
        it never made. A control socket written out as the path in use is no change."""
        running = self.config
        if new.control_socket and Path(new.control_socket) == self._control_path:
            new = dataclasses.replace(new, control_socket=running.control_socket)

        def shown(name: str, value) -> str:
            if value is None:
                return "unset"
            return format_key(value) if name.endswith("_queue") else str(value)

        fixed = [f"{name} {shown(name, getattr(running, name))} -> "
                 f"{shown(name, getattr(new, name))}"
                 for name in names if getattr(new, name) != getattr(running, name)]
        if fixed:
            raise RQPError(f"{'; '.join(fixed)}: cannot change while running, restart the "
                           f"{agent} for that")
        return new

    async def start_service(self, control_path: Path, metrics_listen) -> None:
        """Signal handlers, the control socket and (if configured) the metrics endpoint."""
        loop = self._loop = asyncio.get_running_loop()
        loop.set_exception_handler(self._on_loop_error)
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)
        loop.add_signal_handler(signal.SIGHUP, self._on_hup)
        if _HUP_BEFORE_START.is_set():  # (a reload asked while it started: taken now)
            _HUP_BEFORE_START.clear()
            self._on_hup()
        self._control_path = control_path
        # (what clients ask for together is made once: status and metrics can take 4-9 MB)
        self._metrics = Shared(exposition(self.metrics))
        self._status_line = Shared(lambda: _line(self.status()))
        self._metrics_line = Shared(self._metrics_answer)
        self._servers.append(await serve_control(control_path, self._control, self._refused,
                                                 privileged=self.commands))
        if metrics_listen:
            self._servers.append(await serve_metrics(metrics_listen.host, metrics_listen.port,
                                                     self._metrics))
            self.log.info("metrics on http://%s/metrics", metrics_listen)

    # --- unexpected errors: never a half-alive agent ---------------------------------------

    def fatal(self, where: str, exc: BaseException) -> None:
        """An error nothing expected (a bug, or the system failing under the agent): log it
        with its traceback and stop at once, exiting with EXIT_UNEXPECTED. The agent's state
        may be half-changed, so it is not trusted for a graceful stop: systemd restarts the
        agent, and what was journaled is sent again. Safe to call from any thread."""
        if self._loop is not None and threading.current_thread() is not threading.main_thread():
            self._loop.call_soon_threadsafe(self.fatal, where, exc)
            return
        if self.failed:
            self.log.error("and another unexpected error in %s", where, exc_info=exc)
            return
        self.failed = True
        self.log.critical("unexpected error in %s: stopping now with exit status %d, to be "
                          "restarted (journaled SURE messages are sent again)", where,
                          EXIT_UNEXPECTED, exc_info=exc)
        self._stopping.set()

    def stop_failing(self) -> None:
        """Stop as for SIGTERM, and exit with status 1: the agent cannot go on (its journal
        cannot be written), and systemd's Restart=on-failure is to start it again."""
        self.exit_status = 1
        self._stopping.set()

    def spawn(self, coro, where: str) -> asyncio.Task:
        """A task whose failure stops the agent (instead of a line at garbage collection)."""
        task = asyncio.get_running_loop().create_task(coro)
        task.add_done_callback(lambda t: t.cancelled() or t.exception() is None
                               or self.fatal(where, t.exception()))
        return task

    def guarded(self, where: str, function: Callable, *args) -> None:
        """Call ``function``; an exception stops the agent. For callbacks whose caller would
        swallow it (asyncio transports drop an OSError raised in ``data_received``)."""
        try:
            function(*args)
        except Exception as exc:  # noqa: BLE001 - anything here is unexpected
            self.fatal(where, exc)

    def _on_loop_error(self, loop: asyncio.AbstractEventLoop, context: dict) -> None:
        exc = context.get("exception")
        message = context.get("message", "")
        # Running out of descriptors while accepting is the system's trouble, not ours: asyncio
        # stops accepting for a second and tries again. It reports every failed accept of the
        # backlog with a traceback (thousands of lines a second): one line per interval here.
        if message.startswith("socket.accept() out of system resource"):
            soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
            why = exc.strerror if isinstance(exc, OSError) else exc
            self.out_of_descriptors.report(
                f"cannot accept connections: {why} (open files limit {soft}); not accepting "
                "for a second at a time until descriptors are free -- raise LimitNOFILE= or "
                "lower max_connections", level=logging.ERROR)
            return
        if exc is None:
            loop.default_exception_handler(context)
            return
        if message.startswith("Future exception was never retrieved") and \
                isinstance(exc, PEER_FAILURES):
            # asyncio's streams set a connection's failure on futures of their own too (a TLS
            # handshake the peer reset: its stream's close waiter), and report one collected
            # unread; the connection's code had the same error, and dealt with it. A trial's
            # 500 handshakes reset at once stopped a receiving MCA (exit 70) with it: a peer
            # must not be able to. (Our own futures' errors, and every task's, stay fatal.)
            self.log.debug("%s: %s (a peer's connection failed; already dealt with)", message,
                           exc)
            return
        self.fatal(f"the event loop ({message or 'a callback'})", exc)

    def ready(self, status: str) -> None:
        notify(f"READY=1\nSTATUS={status}")
        interval = watchdog_interval()
        if interval:
            self._pinger = asyncio.create_task(self._watchdog(interval))

    async def wait_for_stop(self) -> None:
        await self._stopping.wait()
        notify("STOPPING=1")

    def stop_service(self) -> None:
        if self._pinger:
            self._pinger.cancel()
        for server in self._servers:
            server.close()
        if self._control_path is not None:
            self._control_path.unlink(missing_ok=True)

    def _on_signal(self, sig: int) -> None:
        if self._stopping.is_set():
            self.log.warning("second %s: exiting at once", signal.Signals(sig).name)
            flush_held_lines()
            os._exit(0)
        self.log.info("%s: %s", signal.Signals(sig).name, self.stop_note)
        self._stopping.set()

    def _on_hup(self) -> None:
        if self._reloading:
            return  # a SIGHUP during a reload is coalesced into it
        self._reloading = True
        asyncio.get_running_loop().call_soon(self._reload)

    def _reload(self) -> None:
        self._reloading = False
        notify("RELOADING=1")
        try:
            self.reload()
        except RQPError as exc:
            self.log.error("reload refused, keeping the running configuration: %s", exc)
            self.last_reload = {"at": time.time(), "ok": False, "error": str(exc)}
        else:
            self.last_reload = {"at": time.time(), "ok": True, "error": None}
        notify("READY=1")

    async def _watchdog(self, interval: float) -> None:
        while True:  # from the main loop: a stuck loop stops the pings
            notify("WATCHDOG=1")
            await asyncio.sleep(interval)

    async def _metrics_answer(self) -> bytes:
        return _line({"text": (await self._metrics()).decode()})

    def _refused(self, request: dict, exc: BaseException) -> None:
        """A control request the agent could not take (a client's wrong types, or a bug):
        said, rate-limited (a re-check's flood of one such request wrote 39 MB of tracebacks
        in 10 s), the traceback at DEBUG."""
        self._bad_requests.report("control request %.200r refused: %s: %s", logging.ERROR,
                                  request, type(exc).__name__, exc)
        self.log.debug("the refused control request's traceback", exc_info=exc)

    async def _control(self, request: dict) -> dict | bytes:
        command = request.get("command")
        if command == "status":
            return await self._status_line()
        if command == "metrics":
            return await self._metrics_line()
        if command == "trace":
            key = request.get("key")
            if type(key) is not int or not 0 < key < 1 << 64:
                return {"error": f"trace: a message key is an integer in 1..2**64-1, got {key!r}"}
            return {"trace": self.trace(key)}
        answer = await self.command(command, request)
        if answer is not None:
            return answer
        return {"error": f"unknown command {command!r} (status, metrics, trace"
                         f"{''.join(', ' + c for c in self.commands)})"}

    #: The agent's own control commands (besides status, metrics and trace): they act (stop a
    #: route, connect to a host), so only root or the agent's user may send them.
    commands: tuple[str, ...] = ()

    async def command(self, command: str, request: dict) -> dict | None:
        """One of :attr:`commands` (None: not one of them)."""
        return None

    def status(self) -> dict:  # pragma: no cover - overridden
        raise NotImplementedError

    def trace(self, key: int) -> dict | None:  # pragma: no cover - overridden
        raise NotImplementedError

    def metrics(self) -> list:  # pragma: no cover - overridden
        raise NotImplementedError

    def reload(self) -> None:  # pragma: no cover - overridden
        raise NotImplementedError


def _line(answer: dict) -> bytes:
    """A control answer as its client reads it: one JSON line."""
    return json.dumps(answer, default=str).encode() + b"\n"


def event_loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The loop factory ``$RQP_EVENT_LOOP`` asks for (None: the standard loop)."""
    name = os.environ.get(EVENT_LOOP_VARIABLE, "asyncio") or "asyncio"
    if name == "asyncio":
        return None
    if name == "uvloop":
        try:
            import uvloop
        except ImportError:
            raise RQPError(f"{EVENT_LOOP_VARIABLE}=uvloop, but uvloop is not installed (pip "
                           "install uvloop, or leave the variable out for the standard "
                           "loop)") from None
        return uvloop.new_event_loop
    raise RQPError(f"{EVENT_LOOP_VARIABLE}={name!r}: expected asyncio or uvloop")


def check_only(log: logging.Logger, check: Callable[[], str]) -> int:
    """``--check``: what a start would read and refuse, without starting: ``check()`` loads
    the config and the TLS files (warnings logged) and says what would run; 0, or 1 with the
    reason logged, as a start that fails (a trial: no way to check a file before an upgrade
    or a reload but to start the agent, or send SIGHUP to the running one)."""
    try:
        print(f"OK: {check()}", flush=True)
    except RQPError as exc:
        log.error("%s", exc)
        return 1
    return 0


#: A SIGHUP that came between run_daemon's start and the agent's signal handlers.
_HUP_BEFORE_START = threading.Event()


def run_daemon(log: logging.Logger, build: Callable[[], Daemon]) -> int:
    """Build the agent and run it; exit status 1 with the reason logged if it cannot, 70
    (EXIT_UNEXPECTED) after an unexpected error."""
    # An agent started by a process that holds signals (an application with a signal thread of
    # its own, through openConnection) would never stop on SIGTERM, reload on SIGHUP, or wake
    # the sending MCA's reader thread (SIGUSR1).
    if signal.getsignal(signal.SIGHUP) != signal.SIG_IGN:  # (nohup's stays ignored)
        # A SIGHUP before the loop takes it (a fresh machine's test sent one once the
        # receiver said "listening", before its handlers: Python's default ended it) is kept
        # for start_service, as a reload once the agent runs.
        signal.signal(signal.SIGHUP, lambda *_: _HUP_BEFORE_START.set())
    signals.hold_none()
    try:
        loop_factory = event_loop_factory()
        agent = build()
        tune_collector()  # (the sending MCA's hot path: about 1 µs a message less)
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            runner.run(agent.run())
    except RQPError as exc:
        log.error("%s", exc)
        return 1
    except OSError as exc:  # (binding the listening socket, opening the control socket)
        log.error("cannot start: %s%s", exc, " (another program, or another agent, listens "
                  "there: ss -ltnp shows which)" if exc.errno == errno.EADDRINUSE else "")
        return 1
    except Exception:  # noqa: BLE001 - a bug on the way in or out: say so, with the traceback
        log.critical("unexpected error: exit status %d", EXIT_UNEXPECTED, exc_info=True)
        return EXIT_UNEXPECTED
    finally:
        flush_held_lines()  # (a trial: 22 connections stopped, 20 lines, the 2 never counted)
    return EXIT_UNEXPECTED if agent.failed else agent.exit_status
