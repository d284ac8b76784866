"""Signals a program is sure to receive, and stops that clean up: the one home of both.

A process inherits the signals its parent holds (blocks), through fork and exec alike. A
program started by one that holds SIGTERM (an application with a signal-waiting thread of its
own, a supervisor, a test harness that started it from such a thread) would never receive it:
a tool would run on after ``timeout`` or ``systemctl stop``, an agent would never stop. So
each program lets go of the signals that stop it. What a program was started *ignoring*
(``nohup`` ignores SIGHUP, a shell's background job SIGINT) stays ignored, as its starter
asked.

The tools that make things (agents, queues, directories: the benchmarks, the demo) take the
stop signals (:data:`STOP_SIGNALS`) as Ctrl-C: the first raises KeyboardInterrupt, the run
cleans up and exits 130; later ones are noted and change nothing (:func:`take_stops`).

What a signal handler raises while a finalizer (``__del__``, a weakref callback: py4j's, as
Python lets go of JVM objects) or an at-fork hook runs, Python only prints ("Exception ignored
in") and the run goes on: a tool ran on after its SIGTERM (CI), a demo stopped during its
report exited 0 (twice in nine runs). So a stop's KeyboardInterrupt is noted as it is raised
(:func:`raising`) until it has gone its way; :func:`raise_if_stopped` raises it again, and
Python's print of it, no news, is dropped.
"""

from __future__ import annotations

import contextlib
import signal
import sys
from collections.abc import Callable, Iterable

__all__ = ["STOP_SIGNALS", "end_on_sigterm", "handle", "hold_none", "let_stops_through",
           "let_through", "quiet_stops", "raise_if_stopped", "raised_for_sure", "raising",
           "restore", "stopped", "take_stops"]

#: What stops a run as Ctrl-C does.
STOP_SIGNALS = frozenset({signal.SIGINT, signal.SIGTERM, signal.SIGHUP})

#: The stop signals received since take_stops(), in order.
stopped: list[int] = []


def handle(handler: Callable | int, signals: Iterable[int]) -> dict[int, Callable | int]:
    """Install ``handler`` for each of ``signals`` that the program was not started ignoring,
    and let them through (unblock them in this thread, and so in the threads it starts from
    now on). Returns the handlers replaced. A signal that was held and came meanwhile is
    handled here: a handler that raises, raises from this call."""
    signals = tuple(signals)
    previous = {sig: signal.signal(sig, handler) for sig in signals
                if signal.getsignal(sig) != signal.SIG_IGN}
    let_through(signals)
    return previous


def restore(previous: dict[int, Callable | int]) -> None:
    """Put back the handlers :func:`handle` replaced."""
    for sig, handler in previous.items():
        signal.signal(sig, handler)


def let_through(signals: Iterable[int]) -> None:
    """Unblock ``signals`` in this thread (and the threads it starts from now on)."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, tuple(signals))


def let_stops_through() -> None:
    """For a program that the stop signals end as they are (their default action, Python's
    KeyboardInterrupt for Ctrl-C): let them through. Ignored ones stay ignored."""
    let_through(STOP_SIGNALS)


def end_on_sigterm() -> None:
    """For a worker process its parent ends with SIGTERM (a multiprocessing pool's terminate,
    which its ``with`` block calls): the default action, let through. Held, the pool's end
    waits for that worker for good."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    let_through((signal.SIGTERM,))


def hold_none() -> None:
    """Hold no signal at all, as daemon(7) asks of a daemon that starts: the agents, whose
    threads started later inherit that."""
    signal.pthread_sigmask(signal.SIG_SETMASK, ())


# --- a stop's KeyboardInterrupt, raised for sure ----------------------------------------------

#: The KeyboardInterrupts that stops raised, until they have gone their way (see the top).
_raised: list[BaseException] = []
_unraisable_before: Callable | None = None  # (sys.unraisablehook before ours)


def raising(exc: BaseException) -> BaseException:
    """Note ``exc``, which a stop's handler raises (or has just raised): if a finalizer
    swallows it, :func:`raise_if_stopped` raises it again, and Python does not print it."""
    global _unraisable_before
    if not any(exc is each for each in _raised):
        _raised.append(exc)
    if sys.unraisablehook is not _unraisable:  # (installed when first needed: a test runner
        _unraisable_before, sys.unraisablehook = sys.unraisablehook, _unraisable  # has its own)
    return exc


def _unraisable(info, _sys=sys) -> None:
    # (at the interpreter's end this module's globals may be None already: a re-check's
    # second SIGTERM gave "TypeError: 'NoneType' object is not iterable" here)
    if not any(info.exc_value is each for each in _raised or ()):
        (_unraisable_before or _sys.__unraisablehook__)(info)


def raise_if_stopped() -> None:
    """Raise again the stop that a finalizer swallowed, if one did (see the top): the tools'
    waits call it, and the report between its phases."""
    if _raised:
        raise KeyboardInterrupt(*_raised[0].args)


@contextlib.contextmanager
def raised_for_sure():
    """Within: a stop whose KeyboardInterrupt a finalizer swallowed ends the block all the same
    (raised again as it ends, if not before by :func:`raise_if_stopped`). Another exception that
    ends it meanwhile becomes the stop's context: the stop is what happened."""
    try:
        yield
    except KeyboardInterrupt:
        _raised.clear()  # (it went its way)
        raise
    except BaseException:
        raise_if_stopped()
        raise
    raise_if_stopped()


# --- stops that clean up ----------------------------------------------------------------------

_quiet = False  # (the clean-up has begun: stops are noted, not raised)


def _raise_on_stop(signum, _frame):
    """The first stop raises KeyboardInterrupt (the run cleans up); later ones, and any once
    the clean-up has begun, are only noted: a burst of signals must not break into the
    clean-up."""
    stopped.append(signum)
    if len(stopped) == 1 and not _quiet:
        raise raising(KeyboardInterrupt(f"signal {signal.Signals(signum).name}"))


def take_stops() -> dict[int, Callable | int]:
    """Stop on :data:`STOP_SIGNALS` as on Ctrl-C, from now on; returns the handlers replaced.
    Raises KeyboardInterrupt at once if a stop came while the program's starter held it."""
    global _quiet
    stopped.clear()
    _raised.clear()
    _quiet = False
    return handle(_raise_on_stop, STOP_SIGNALS)


def quiet_stops() -> None:
    """The clean-up begins: from here on a stop signal is noted and changes nothing, so the
    clean-up runs to its end. (One assignment, so no signal finds it half done; then the stop
    signals a library took meanwhile are taken back: PySpark takes SIGINT.)"""
    global _quiet
    _quiet = True
    _raised.clear()  # (the stop has gone its way: it is what the clean-up is for)
    for sig in STOP_SIGNALS:
        if signal.getsignal(sig) not in (signal.SIG_IGN, _raise_on_stop):
            signal.signal(sig, _raise_on_stop)
