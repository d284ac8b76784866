"""Signals a program is sure to receive: the one home of "a signal mask survives exec".

A process inherits the signals its parent holds (blocks), through fork and exec alike. A
program started by one that holds SIGTERM (an application with a signal-waiting thread of its
own, a supervisor, a test harness that started it from such a thread) would never receive it:
a tool would run on after ``timeout`` or ``systemctl stop``, an agent would never stop. So
each program lets go of the signals it handles, when it starts handling them.
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterable

__all__ = ["end_on_sigterm", "handle", "hold_none", "let_ctrl_c_through"]


def handle(handler: Callable | int, signals: Iterable[int]) -> dict[int, Callable | int]:
    """Install ``handler`` for each of ``signals`` and let them through (unblock them in this
    thread, and so in the threads it starts from now on). Returns the handlers they had."""
    signals = tuple(signals)
    previous = {sig: signal.signal(sig, handler) for sig in signals}
    signal.pthread_sigmask(signal.SIG_UNBLOCK, signals)
    return previous


def end_on_sigterm() -> None:
    """For a worker process its parent ends with SIGTERM (a multiprocessing pool's terminate,
    which its ``with`` block calls): the default action, let through. Held, the pool's end
    waits for that worker for good."""
    handle(signal.SIG_DFL, (signal.SIGTERM,))


def let_ctrl_c_through() -> None:
    """Let SIGINT through where Python's own handler (KeyboardInterrupt) takes it: a program
    that ends on Ctrl-C. Not where the program started with SIGINT ignored, as a shell's
    background job does: that stays as the shell asked."""
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, (signal.SIGINT,))


def hold_none() -> None:
    """Hold no signal at all, as daemon(7) asks of a daemon that starts: the agents, whose
    threads started later inherit that."""
    signal.pthread_sigmask(signal.SIG_SETMASK, ())
