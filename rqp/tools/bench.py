"""rqp-bench: end-to-end throughput and latency of the real agents, beside a raw ceiling.

One run prints one table. Every figure is for the whole path on loopback::

    application --sendMessage--> transmission queue --> sending MCA --TCP--> receiving MCA
        --> destination System V queue --> consumer (another process)

for SURE and UNSURE messages of 100 bytes and 4 KiB, plus the latency of a single SURE message
(send one, wait until it is in the destination queue and taken, repeat). Beside each figure is
the CEILING: the same four hops done by a minimal pipeline of plain ``struct`` and sockets
(producer -> System V queue -> "sender" process -> length-prefixed frames on TCP -> "receiver"
process -> System V queue -> consumer, with a one-byte ack per message written back, pipelined).
Both pipelines run in the same run, with the same queue sizes, the same consumer checks and the
same process layout (the producer is this process, the consumer a child process).

Every message is checked: each case must deliver exactly its messages, with their exact bytes
(a tag and a sequence number at the front of each payload), and SURE messages in order. A
missing, duplicated, reordered or corrupt message, a dead letter, or a pipeline that stops
moving for ``STALL`` seconds ends the run with an error and exit status 1.

Run as root, the benchmark re-executes itself under ``unshare --ipc`` (a private IPC
namespace) and raises ``kernel.msgmnb`` there (a per-namespace sysctl) before it creates any
queue, so every queue is created with the same, larger ``msg_qbytes``; ``kernel.msgmax`` is left
as it is. Everything it starts (agents, pipeline processes, queues, semaphores, the temporary
directory) is removed at the end, also after a failure, Ctrl-C or SIGTERM; child processes are
told by the kernel (PR_SET_PDEATHSIG) to stop if the benchmark itself is killed.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import multiprocessing
import os
import platform
import secrets
import shutil
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import sysv_ipc

import rqp
from rqp import cli
from rqp.protocol.constants import DEFAULT_MTYPE, SURE_MSG, UNSURE_MSG
from rqp.protocol.errors import RQPError
from rqp.protocol.records import DeadLetterRecord
from rqp.system import signals
from rqp.system.files import remove_abandoned
from rqp.system.queues import LocalQueue, format_key, kernel_limits
from rqp.system.service import EVENT_LOOP_VARIABLE, sender_serving
from rqp.system.signals import STOP_SIGNALS, raise_if_stopped
from rqp.tools.rabbit import CONFIRM_WINDOW, Broker, rabbit_python


#: Set in the environment of the re-executed benchmark (inside its own IPC namespace) to the
#: IPC namespace it left, so that it can tell that it really is in another one.
ISOLATED_ENV = "RQP_BENCH_ISOLATED"
DEFAULT_MSGMNB = 4 << 20
SIZES = (100, 4096)
DEFAULT_MESSAGES = {100: 60_000, 4096: 20_000}
QUICK_MESSAGES = {100: 400, 4096: 200}
DEFAULT_ROUNDS = 3
DEFAULT_LATENCY_SAMPLES = 500
QUICK_LATENCY_SAMPLES = 40
#: No message moved for this long: the run fails (and says where the messages are).
STALL = 20.0
START_TIMEOUT = 20.0
WORKDIR_PREFIX = "rqp-bench-"

#: Front of every payload: the case's tag and the message's sequence number.
PAYLOAD_HEAD = struct.Struct(">IQ")
#: Raw pipeline: what the producer puts on the raw transmission queue in front of the payload.
RAW_RECORD = struct.Struct(">BI")  # message type, destination queue key
#: Raw pipeline: the frame on the TCP connection, in front of the payload.
RAW_FRAME = struct.Struct(">IBI")  # payload length, message type, destination queue key
RAW_ACK = b"\x02"
#: System V message type of the message that tells the raw sender to finish.
RAW_STOP_MTYPE = 2
RAW_BATCH = 256

_PR_SET_PDEATHSIG = 1


class BenchError(RQPError):
    """The benchmark could not measure, or a check failed."""


class Stalled(BenchError):
    """Raised in the main thread by the watchdog (through a signal) when nothing moves."""


# --------------------------------------------------------------------------------------------
# small helpers
# --------------------------------------------------------------------------------------------


def say(text: str = "", *, err: bool = False) -> None:
    print(text, file=sys.stderr if err else sys.stdout, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def filler(size: int) -> bytes:
    """The deterministic bytes after the tag and sequence number of a ``size``-byte payload."""
    n = size - PAYLOAD_HEAD.size
    if n < 0:
        raise ValueError(f"payload size {size} is below the {PAYLOAD_HEAD.size}-byte head")
    return bytes((i * 7 + 3) & 0xFF for i in range(n))


def size_label(size: int) -> str:
    return f"{size // 1024} KiB" if size % 1024 == 0 else f"{size} B"


def type_label(msg_type: int) -> str:
    return "SURE" if msg_type == SURE_MSG else "UNSURE"


def unused_key(taken: set[int], span: int = 1) -> int:
    """A key such that no queue or semaphore has any of ``key .. key + span - 1`` yet."""
    while True:
        key = 0x52420000 | (secrets.randbits(16) & ~0xF)  # "RB": clear of the "RQ" keys
        span_keys = range(key, key + span)
        if (not taken.intersection(span_keys)
                and not any(LocalQueue.exists(k) or _semaphore_exists(k) for k in span_keys)):
            taken.update(span_keys)
            return key


def _semaphore_exists(key: int) -> bool:
    try:
        sysv_ipc.Semaphore(key)
    except sysv_ipc.ExistentialError:
        return False
    return True


_libc = None


def _load_libc():
    global _libc
    if _libc is None:
        try:
            _libc = ctypes.CDLL(None, use_errno=True)
        except OSError:
            _libc = False
    return _libc


def _die_with_parent() -> None:
    """PR_SET_PDEATHSIG: the kernel kills this process when its parent dies.

    SIGKILL, not SIGTERM: a sending MCA's graceful stop puts held messages back on a (then
    possibly full) transmission queue, 5 s per message, and nobody would be left to wait.
    """
    libc = _load_libc()
    if libc:
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


@contextlib.contextmanager
def stop_signals_held():
    """Hold the stop signals while a child is started and recorded in the list its clean-up
    reads; a signal that came meanwhile is handled when the block ends. (The mask is the
    calling thread's: so that it holds them for the process, the tools start their other
    threads inside such a block, and those threads never take a stop signal.)

    Handled inside the fork, a stop was lost: its handler ran in an at-fork hook (logging's),
    and Python only prints what such a hook raises, so the run went on. Handled between the
    start and the record, the child was left out of the clean-up, which then waited for it.
    The child inherits the hold: it lets go with :func:`_child_setup` (a fork) or
    :func:`_child_preexec` (a command)."""
    held = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def _child_preexec() -> None:
    """``preexec_fn`` of the commands this module starts: the stop signals are let go (held by
    the parent while it started us: a signal mask survives exec), and we die with the parent."""
    signals.let_stops_through()
    _die_with_parent()


def _child_setup(parent: int) -> None:
    """First thing in every pipeline process this module forks."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's: it stops us
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    signals.let_stops_through()  # (held by stop_signals_held)
    _die_with_parent()
    if os.getppid() != parent:  # the parent died before prctl
        os._exit(1)


def _receive_retrying(mq: sysv_ipc.MessageQueue, **kwargs):
    while True:
        try:
            return mq.receive(**kwargs)
        except sysv_ipc.Error as exc:
            if type(exc) is sysv_ipc.Error and "signal" in str(exc).lower():
                continue  # EINTR; a handler that raises has already propagated
            raise


def _send_retrying(mq: sysv_ipc.MessageQueue, data: bytes, **kwargs) -> None:
    while True:
        try:
            return mq.send(data, **kwargs)
        except sysv_ipc.Error as exc:
            if type(exc) is sysv_ipc.Error and "signal" in str(exc).lower():
                continue
            raise


# --------------------------------------------------------------------------------------------
# the consumer (one per pipeline, a child process, same code for both)
# --------------------------------------------------------------------------------------------


def _consume(get, tag: int, count: int, size: int, ordered: bool, progress) -> tuple[int, int]:
    """Take ``count`` messages of case ``tag``, check each; (first, last) monotonic ns."""
    tail = filler(size)
    unpack = PAYLOAD_HEAD.unpack_from
    seen = bytearray(count)
    first = now = 0
    for i in range(count):
        data = get()
        now = time.monotonic_ns()
        if i == 0:
            first = now
        if len(data) != size or not data.endswith(tail):
            raise BenchError(f"message {i} of case {tag}: {len(data)} bytes, expected {size} "
                             f"bytes{'' if len(data) != size else ' (content differs)'}")
        got_tag, seq = unpack(data)
        if got_tag != tag:
            raise BenchError(f"message {i}: belongs to case {got_tag}, expected case {tag} "
                             "(left over from an earlier case?)")
        if ordered:
            if seq != i:
                raise BenchError(f"SURE message out of order: got sequence {seq} as message "
                                 f"{i} of case {tag}")
        else:
            if seq >= count or seen[seq]:
                raise BenchError(f"message sequence {seq} of case {tag} is "
                                 f"{'a duplicate' if seq < count else 'out of range'}")
            seen[seq] = 1
        if not i & 63:
            progress.value = i
    progress.value = count
    return first, now


def consumer_main(parent: int, key: int, raw: bool, conn, progress) -> None:
    _child_setup(parent)
    if raw:
        mq = sysv_ipc.MessageQueue(key, 0, mode=0, max_message_size=kernel_limits().msgmax)

        def get() -> bytes:
            return _receive_retrying(mq)[0]
    else:
        get = LocalQueue.open(key).get  # what an application does (rqp.receiveMessage)
    while True:
        cmd = conn.recv()
        if cmd[0] == "stop":
            return
        _, tag, count, size, ordered = cmd
        try:
            first, last = _consume(get, tag, count, size, ordered, progress)
        except Exception as exc:  # noqa: BLE001 - reported to the parent, which fails the run
            conn.send(("error", f"{type(exc).__name__}: {exc}"))
        else:
            conn.send(("done", first, last))


# --------------------------------------------------------------------------------------------
# the raw pipeline (the ceiling): plain struct and sockets
# --------------------------------------------------------------------------------------------


def raw_sender_main(parent: int, xmit_key: int, port: int, sent, acked) -> None:
    """Take records off the raw transmission queue, write length-prefixed frames on TCP.

    A second thread reads the one-byte acks and counts them; nothing waits for them.
    """
    _child_setup(parent)
    try:
        _raw_sender(xmit_key, port, sent, acked)
    except (sysv_ipc.ExistentialError, OSError):  # the parent is cleaning up after a failure
        os._exit(5)


def _raw_sender(xmit_key: int, port: int, sent, acked) -> None:
    mq = sysv_ipc.MessageQueue(xmit_key, 0, mode=0, max_message_size=kernel_limits().msgmax)
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def read_acks() -> None:
        while True:
            data = sock.recv(65536)
            if not data:
                return
            acked.value += len(data)

    reader = threading.Thread(target=read_acks, daemon=True)
    reader.start()
    record, frame = RAW_RECORD, RAW_FRAME
    hsize = record.size
    stop = False
    n = 0
    while not stop:
        data, mtype = _receive_retrying(mq)
        batch = []
        while True:
            if mtype == RAW_STOP_MTYPE:
                stop = True
                break
            msg_type, queue_key = record.unpack_from(data)
            batch.append(frame.pack(len(data) - hsize, msg_type, queue_key))
            batch.append(data[hsize:])
            if len(batch) >= 2 * RAW_BATCH:
                break
            try:
                data, mtype = mq.receive(block=False)
            except sysv_ipc.BusyError:
                break
        if batch:
            n += len(batch) // 2
            sent.value = n  # before the acks can come back
            sock.sendall(b"".join(batch))
    deadline = time.monotonic() + 10
    while acked.value < n and time.monotonic() < deadline:
        time.sleep(0.005)
    sock.shutdown(socket.SHUT_WR)
    reader.join(10)
    sock.close()
    os._exit(0 if acked.value == n else 3)


def raw_receiver_main(parent: int, listener: socket.socket) -> None:
    """Read frames, put each payload on its destination queue, write a one-byte ack each."""
    _child_setup(parent)
    try:
        _raw_receiver(listener)
    except (sysv_ipc.ExistentialError, OSError):  # the parent is cleaning up after a failure
        os._exit(5)


def _raw_receiver(listener: socket.socket) -> None:
    conn, _ = listener.accept()
    listener.close()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    msgmax = kernel_limits().msgmax
    queues: dict[int, sysv_ipc.MessageQueue] = {}
    unpack, hsize = RAW_FRAME.unpack_from, RAW_FRAME.size
    buf = bytearray()
    while True:
        data = conn.recv(1 << 18)
        if not data:
            break
        buf += data
        pos, end_buf, n = 0, len(buf), 0
        while end_buf - pos >= hsize:
            length, _msg_type, queue_key = unpack(buf, pos)
            end = pos + hsize + length
            if end > end_buf:
                break
            mq = queues.get(queue_key)
            if mq is None:
                mq = queues[queue_key] = sysv_ipc.MessageQueue(
                    queue_key, 0, mode=0, max_message_size=msgmax)
            _send_retrying(mq, bytes(buf[pos + hsize:end]), type=DEFAULT_MTYPE)
            n += 1
            pos = end
        if pos:
            del buf[:pos]
        if n:
            conn.sendall(RAW_ACK * n)
    conn.close()
    os._exit(0 if not buf else 4)


# --------------------------------------------------------------------------------------------
# the watchdog: a stalled pipeline or a dead agent ends the run instead of hanging it
# --------------------------------------------------------------------------------------------


class Watchdog:
    """Watches progress counters and processes from a thread; raises :class:`Stalled` in the
    main thread (SIGUSR2 with a raising handler, which also wakes a blocked msgsnd/msgrcv)."""

    def __init__(self, stall: float) -> None:
        self.stall = stall
        self.counters: list = []  # objects with .value, or callables
        self.processes: dict[str, object] = {}  # name -> Popen / multiprocessing.Process
        self.reason: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._main = threading.main_thread().ident
        self.armed = False

    def start(self) -> None:
        signal.signal(signal.SIGUSR2, self._on_signal)
        signals.let_through((signal.SIGUSR2,))  # (its starter may have held it)
        self._thread = threading.Thread(target=self._run, name="watchdog", daemon=True)
        with stop_signals_held():  # (so that it never holds them: the main thread gets them,
            self._thread.start()  # and stop_signals_held there holds them for the process)

    def _on_signal(self, *_):
        if self.armed and self.reason:
            self.armed = False
            raise Stalled(self.reason)

    def _snapshot(self):
        return tuple(c() if callable(c) else c.value for c in self.counters)

    def _run(self) -> None:
        last, since = None, time.monotonic()
        while not self._stop.wait(0.25):
            now = time.monotonic()
            why = None
            for name, proc in list(self.processes.items()):
                code = proc.poll() if hasattr(proc, "poll") else proc.exitcode
                if code is not None:
                    why = f"{name} exited unexpectedly (status {code})"
                    break
            snap = self._snapshot()
            if snap != last:
                last, since = snap, now
            elif why is None and now - since > self.stall:
                why = f"nothing moved for {self.stall:g}s"
            if why and self.reason is None:
                self.reason = why
                if self.armed:
                    signal.pthread_kill(self._main, signal.SIGUSR2)
            elif self.reason and self.armed:  # not delivered yet (handler not armed then)
                signal.pthread_kill(self._main, signal.SIGUSR2)

    def stop(self) -> None:
        self.armed = False
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2)
        signal.signal(signal.SIGUSR2, signal.SIG_IGN)


# --------------------------------------------------------------------------------------------
# the benchmark
# --------------------------------------------------------------------------------------------


@dataclass
class CaseResult:
    case: str
    message_type: str
    size: int
    messages: int
    rounds: int
    #: How the agents talk: "plaintext" or "TLS" (mutual, rqp/1).
    transport: str = "plaintext"
    #: Seconds from the first put to the last take, one per round.
    rqp_seconds: list = field(default_factory=list)
    raw_seconds: list = field(default_factory=list)
    #: CPU microseconds per message of each RQP process, one list (per round) per process.
    cpu_us: dict = field(default_factory=dict)
    #: With --against rabbitmq: the same case through RabbitMQ, seconds and CPU per round.
    rabbit_seconds: list = field(default_factory=list)
    rabbit_cpu_us: dict = field(default_factory=dict)

    @property
    def rabbit_msg_per_s(self) -> float:
        return self.messages / statistics.median(self.rabbit_seconds) if self.rabbit_seconds \
            else float("nan")

    def rabbit_cpu_median(self, process: str) -> float:
        values = self.rabbit_cpu_us.get(process)
        return statistics.median(values) if values else float("nan")

    def cpu_median(self, process: str) -> float:
        return statistics.median(self.cpu_us[process]) if self.cpu_us.get(process) \
            else float("nan")

    @property
    def rqp_msg_per_s(self) -> float:
        return self.messages / statistics.median(self.rqp_seconds)

    @property
    def raw_msg_per_s(self) -> float:
        return self.messages / statistics.median(self.raw_seconds)

    @property
    def ratio(self) -> float:
        return self.rqp_msg_per_s / self.raw_msg_per_s if self.raw_msg_per_s else float("nan")


@dataclass
class Latency:
    samples: int
    size: int
    transport: str = "plaintext"
    rqp_median_ms: float = 0.0
    rqp_p99_ms: float = 0.0
    raw_median_ms: float = 0.0
    raw_p99_ms: float = 0.0


#: The processes of the RQP pipeline whose CPU time per message is reported.
CPU_PROCESSES = ("producer", "sending MCA", "receiving MCA", "consumer")
_TICK = os.sysconf("SC_CLK_TCK")


def wait_started(what: str, predicate, proc: subprocess.Popen, log: Path | None = None) -> None:
    """Poll ``predicate`` until it holds; BenchError if ``proc`` exits first (with the end of
    its ``log``) or START_TIMEOUT passes."""
    deadline = time.monotonic() + START_TIMEOUT
    while not predicate():
        raise_if_stopped()
        if proc.poll() is not None:
            tail = ""
            if log is not None:
                try:
                    tail = "; its log ends:\n" + "\n".join(
                        log.read_text(errors="replace").splitlines()[-5:])
                except OSError:
                    tail = "; no log"
            raise BenchError(f"gave up waiting for {what}: it exited with status "
                             f"{proc.returncode}{tail}")
        if time.monotonic() > deadline:
            raise BenchError(f"gave up waiting for {what} after {START_TIMEOUT:g}s")
        time.sleep(0.02)


def process_cpu_ns(pid: int) -> int:
    """CPU time a process's live threads have used: the sum of ``/proc/PID/task/*/schedstat``
    (nanoseconds), or, where the kernel has no schedstat, ``/proc/PID/stat`` (clock ticks)."""
    total, found = 0, False
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat", "rb") as f:
                total += int(f.read().split()[0])
            found = True
        except (FileNotFoundError, ProcessLookupError):
            continue  # a thread that ended meanwhile, or no schedstat
    if found:
        return total
    with open(f"/proc/{pid}/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * 1_000_000_000 // _TICK  # utime, stime


def percentile(values: list[int], p: float) -> int:
    """Nearest-rank percentile of ``values`` (0 < p <= 100)."""
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * p // 100))  # ceil
    return ordered[int(rank) - 1]


@dataclass
class Pipeline:
    """One of the two pipelines: how to put a message in and where the consumer takes it."""

    name: str
    dest_key: int
    consumer: object = None
    conn: object = None
    progress: object = None


@dataclass
class Bench:
    args: argparse.Namespace
    workdir: Path
    private: bool  # in an IPC namespace of our own
    msgmnb: int = 0
    msgmax: int = 0
    keys: set = field(default_factory=set)
    created: list = field(default_factory=list)  # LocalQueue objects to remove
    semaphores: list = field(default_factory=list)  # keys of semaphores the agents make
    children: list = field(default_factory=list)  # (name, Popen | Process)
    results: list = field(default_factory=list)
    latencies: list = field(default_factory=list)
    sent: int = 0  # messages this process has put in, for the watchdog
    raw_put: int = 0  # messages put in the raw pipeline
    tag: int = 0  # the last case's tag (every run of a pipeline is a case of its own)
    #: The System V type the RQP pipeline's messages are sent with: 1 goes as MESSAGE, 2 as
    #: MESSAGE_EX (spec section 6); and the label of the variant being measured.
    mtype: int = 1
    label: str = "plaintext"
    #: With --against rabbitmq: the broker of this run.
    broker: object = None

    @property
    def isolation(self) -> str:
        return "private IPC namespace" if self.private else "host IPC namespace"

    # --- set-up -------------------------------------------------------------------------------

    def setup(self) -> None:
        self.load = os.getloadavg()[0]
        self.msgmnb, self.msgmax = self._raise_msgmnb(self.args.msgmnb)
        k = lambda: unused_key(self.keys)  # noqa: E731
        # The sending MCA also makes semaphores with the keys xmit and xmit + 1.
        self.dest, self.xmit, self.dlq = k(), unused_key(self.keys, 2), k()
        self.raw_xmit, self.raw_dest = k(), k()
        # The queues before anything else, after msgmnb: their msg_qbytes is fixed now.
        self.queues = {}
        for name, key in (("destination queue", self.dest), ("transmission queue", self.xmit),
                          ("DEAD.LETTER.Q", self.dlq), ("raw transmission queue", self.raw_xmit),
                          ("raw destination queue", self.raw_dest)):
            self.queues[name] = LocalQueue.create(key, mode=0o600)
            self.created.append(self.queues[name])
        sizes = {q.stat().max_size for q in self.created}
        if sizes != {self.msgmnb}:
            raise BenchError(f"queues were created with msg_qbytes {sorted(sizes)}, not the "
                             f"msgmnb {self.msgmnb}: cannot compare the pipelines")
        # (and the sending MCA marks its DEAD.LETTER.Q with a semaphore of the same key)
        self.semaphores += [self.xmit, (self.xmit + 1) & 0xFFFFFFFF, self.dlq]
        self.watchdog = Watchdog(self.args.stall)
        self.rqp = Pipeline("RQP", self.dest)
        self.raw = Pipeline("raw", self.raw_dest)
        # Forked children first, while this process has one thread.
        self._start_consumer(self.rqp, raw=False)
        self._start_consumer(self.raw, raw=True)
        self._start_raw()
        self._start_agents()
        if self.args.against == "rabbitmq":
            with stop_signals_held():  # (stopped while it starts: cleanup() stops it)
                self.broker = Broker(self.workdir, (free_port(), free_port(), free_port()),
                                     rabbit_python(Path(__file__).resolve().parents[2]),
                                     preexec=_child_preexec)
            self.broker.wait_started()
        self.watchdog.counters += [self.rqp.progress, self.raw.progress, self.raw_sent,
                                   self.raw_acked, lambda: self.sent]
        self.watchdog.start()

    def _raise_msgmnb(self, want: int) -> tuple[int, int]:
        """Set kernel.msgmnb, only ever in a private IPC namespace (never the host's)."""
        limits = kernel_limits()
        if not self.private:
            say(f"rqp-bench: not in a private IPC namespace (run as root, with unshare, for "
                f"that): leaving kernel.msgmnb at {limits.msgmnb}", err=True)
        elif limits.msgmnb != want:
            try:
                Path("/proc/sys/kernel/msgmnb").write_text(f"{want}\n")
            except OSError as exc:
                say(f"rqp-bench: cannot set kernel.msgmnb to {want} ({exc.strerror or exc}); "
                    f"using {limits.msgmnb}", err=True)
            limits = kernel_limits()
        return limits.msgmnb, limits.msgmax

    def _fork(self, name: str, target, *args):
        ctx = multiprocessing.get_context("fork")
        proc = ctx.Process(target=target, args=(os.getpid(), *args), name=name, daemon=False)
        with stop_signals_held():
            proc.start()
            self.children.append((name, proc))
        return proc

    def _start_consumer(self, pipe: Pipeline, raw: bool) -> None:
        ctx = multiprocessing.get_context("fork")
        parent_end, child_end = ctx.Pipe()
        pipe.progress = ctx.RawValue("q", 0)
        pipe.conn = parent_end
        pipe.consumer = self._fork(f"{pipe.name} consumer", consumer_main, pipe.dest_key, raw,
                                   child_end, pipe.progress)
        child_end.close()
        self.watchdog.processes[f"the {pipe.name} consumer"] = pipe.consumer

    def _start_raw(self) -> None:
        ctx = multiprocessing.get_context("fork")
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        port = listener.getsockname()[1]
        self.raw_sent, self.raw_acked = ctx.RawValue("q", 0), ctx.RawValue("q", 0)
        self.raw_receiver = self._fork("raw receiver", raw_receiver_main, listener)
        listener.close()
        self.raw_sender = self._fork("raw sender", raw_sender_main, self.raw_xmit, port,
                                     self.raw_sent, self.raw_acked)
        self.raw_mq = sysv_ipc.MessageQueue(self.raw_xmit, 0, mode=0,
                                            max_message_size=self.msgmax)
        self.raw_dest_mq = sysv_ipc.MessageQueue(self.raw_dest, 0, mode=0,
                                                 max_message_size=self.msgmax)
        self.watchdog.processes["the raw sender"] = self.raw_sender
        self.watchdog.processes["the raw receiver"] = self.raw_receiver

    def _popen(self, name: str, argv: list[str], log: Path, cwd: Path) -> subprocess.Popen:
        _load_libc()
        env = {**os.environ, EVENT_LOOP_VARIABLE: self.loop_name}
        with open(log, "ab") as log_file, stop_signals_held():
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                    stderr=log_file, cwd=str(cwd), start_new_session=True,
                                    preexec_fn=_child_preexec, env=env)
            self.children.append((name, proc))
        return proc

    def _start_agents(self, transport: str = "plaintext", loop: str = "asyncio") -> None:
        port = free_port()
        state = self.workdir / "state"
        state.mkdir(exist_ok=True)
        receiver_tls, sender_tls = "", ""
        if transport == "TLS":  # a CA and certificates made for this run
            from rqp.tools import tls as tls_tool

            receiver_tls, sender_tls = (f"tls: {json.dumps(block)}\n" for block in
                                        tls_tool.agent_pair(self.workdir / "tls", "127.0.0.1",
                                                            "bench-sender", force=True))
        receiver_yaml = self.workdir / "receiver.yaml"
        # The receiver retries a full destination queue for 10 s (100 x 0.1 s) before it
        # dead-letters: a consumer that falls behind slows the pipeline instead of losing.
        receiver_yaml.write_text(
            f"listen: 127.0.0.1:{port}\ndead_letter_queue: {self.dlq:#x}\nstate_dir: state\n"
            "put_retry_count: 100\nput_retry_interval: 0.1\noffer:\n  allow: ['*']\n"
            + receiver_tls)
        self.rqprc = self.workdir / ".rqprc"
        self.rqprc.write_text(
            f"hosts: [127.0.0.1:{port}]\ntransmission_queue: {self.xmit:#x}\n"
            f"dead_letter_queue: {self.dlq:#x}\nstate_dir: state\nask_timeout: 2s\n"
            f"confirm_timeout: 15s\n"
            + (f"window: {self.args.window}\n" if self.args.window is not None else "")
            + sender_tls)
        self.transport, self.loop_name = transport, loop
        py = sys.executable
        self.receiver = self._popen("receiving MCA", [py, "-m", "rqp_agents.receiver",
                                                      "--config", str(receiver_yaml)],
                                    self.workdir / "receiver.log", self.workdir)
        self.receiver_log = self.workdir / "receiver.log"
        wait_started("the receiving MCA to listen", lambda: port_open(port), self.receiver)
        # openConnection would start the sending MCA itself (rqp.api.ensure_sender) exactly like
        # this; it is started here so that it dies with the benchmark (PR_SET_PDEATHSIG).
        self.sender_log = state / f"sender-{self.xmit:08x}.log"
        self.sender = self._popen("sending MCA", [py, "-m", "rqp_agents.sender", "--rqprc",
                                                  str(self.rqprc)], self.sender_log, state)
        wait_started("the sending MCA to serve its transmission queue",
                   lambda: sender_serving(self.xmit), self.sender)
        self.handle = rqp.openConnection(self.dest, rqprc=self.rqprc, start_sender=False)
        self.dest_queue = LocalQueue.open(self.dest)
        self.watchdog.processes["the receiving MCA"] = self.receiver
        self.watchdog.processes["the sending MCA"] = self.sender

    # --- putting messages in ------------------------------------------------------------------

    def _put_rqp(self, msg_type: int, tag: int, count: int, size: int) -> None:
        send, handle, pack, tail = rqp.sendMessage, self.handle, PAYLOAD_HEAD.pack, filler(size)
        mtype = self.mtype
        for seq in range(count):
            send(handle, pack(tag, seq) + tail, msg_type, mtype=mtype)
            self.sent += 1

    def _put_raw(self, msg_type: int, tag: int, count: int, size: int) -> None:
        head = RAW_RECORD.pack(msg_type, self.raw_dest)
        pack, tail, mq = PAYLOAD_HEAD.pack, filler(size), self.raw_mq
        for seq in range(count):
            _send_retrying(mq, head + pack(tag, seq) + tail, type=DEFAULT_MTYPE)
            self.sent += 1
        self.raw_put += count

    # --- measuring ----------------------------------------------------------------------------

    def _next_tag(self) -> int:
        self.tag += 1
        return self.tag

    def _collect(self, pipe: Pipeline) -> tuple[int, int]:
        while not pipe.conn.poll(0.25):
            raise_if_stopped()  # (and the watchdog raises Stalled here if nothing moves)
        reply = pipe.conn.recv()
        if reply[0] == "error":
            raise BenchError(f"{pipe.name} consumer: {reply[1]}")
        return reply[1], reply[2]

    def _cpu_now(self, pipe: Pipeline) -> dict:
        """CPU ns used so far by each process of the RQP pipeline (the producer: this thread)."""
        return {"producer": time.thread_time_ns(),
                "sending MCA": process_cpu_ns(self.sender.pid),
                "receiving MCA": process_cpu_ns(self.receiver.pid),
                "consumer": process_cpu_ns(pipe.consumer.pid)}

    def _run_once(self, pipe: Pipeline, msg_type: int, count: int, size: int,
                  cpu: dict | None = None) -> float:
        """Put ``count`` messages through ``pipe``; seconds from the first put to the last take.
        ``cpu``: for the RQP pipeline, each process's CPU µs per message is added to it."""
        tag = self._next_tag()
        pipe.conn.send(("consume", tag, count, size, msg_type == SURE_MSG))
        put = self._put_rqp if pipe is self.rqp else self._put_raw
        before = self._cpu_now(pipe) if cpu is not None else None
        start = time.monotonic_ns()
        put(msg_type, tag, count, size)
        _, last = self._collect(pipe)
        if cpu is not None:
            # The agents have answered everything once the consumer has the last message but
            # the last confirmations; that tail is within a tick of the whole.
            after = self._cpu_now(pipe)
            for name in CPU_PROCESSES:
                cpu.setdefault(name, []).append((after[name] - before[name]) / 1000 / count)
        self._check_clean(pipe)
        return (last - start) / 1e9

    def _check_clean(self, pipe: Pipeline) -> None:
        """After a case: nothing left behind, nothing dead-lettered."""
        left = {name: q.depth for name, q in self.queues.items()
                if name.startswith("raw") == (pipe is self.raw) and q.depth}
        if left:
            raise BenchError(f"{pipe.name}: messages left behind after the case: {left}")
        if pipe is self.raw:
            deadline = time.monotonic() + 10
            while self.raw_acked.value < self.raw_put and time.monotonic() < deadline:
                time.sleep(0.002)
            if not self.raw_put == self.raw_sent.value == self.raw_acked.value:
                raise BenchError(f"raw: {self.raw_put} messages put, {self.raw_sent.value} "
                                 f"frames sent, {self.raw_acked.value} acked")

    def throughput(self, msg_type: int, size: int, count: int, rounds: int) -> CaseResult:
        """``rounds`` timed runs of each pipeline, alternating, after one warm-up run each."""
        result = CaseResult(f"{type_label(msg_type)} {size_label(size)}", type_label(msg_type),
                            size, count, rounds, self.label)
        warmup = max(20, min(1000, count // 10))
        for pipe in (self.rqp, self.raw):
            self._run_once(pipe, msg_type, warmup, size)
        if self.broker is not None:  # (its warm-up too with the watchdog told)
            self._run_rabbit(None, msg_type, warmup, size)
        for _ in range(rounds):
            result.rqp_seconds.append(self._run_once(self.rqp, msg_type, count, size,
                                                     result.cpu_us))
            result.raw_seconds.append(self._run_once(self.raw, msg_type, count, size))
            if self.broker is not None:
                self._run_rabbit(result, msg_type, count, size)
        return result

    def _run_rabbit(self, result: CaseResult | None, msg_type: int, count: int,
                    size: int) -> None:
        """One round through RabbitMQ (the watchdog is told: nothing of ours moves meanwhile)."""
        self.watchdog.armed = False
        try:
            before = process_cpu_ns(self.broker.pid)
            got = self.broker.run(msg_type == SURE_MSG, self._next_tag(), count, size)
            broker_ns = process_cpu_ns(self.broker.pid) - before
        finally:
            self.watchdog.armed = True
        if result is None:
            return
        result.rabbit_seconds.append(got["seconds"])
        for name, ns in (("producer", got["producer_ns"]), ("broker", broker_ns),
                         ("consumer", got["consumer_ns"])):
            result.rabbit_cpu_us.setdefault(name, []).append(ns / 1000 / count)

    def _latency_samples(self, pipe: Pipeline, samples: int, size: int) -> list[int]:
        tag, tail = self._next_tag(), filler(size)
        clock = time.perf_counter_ns
        out = []
        if pipe is self.rqp:
            send, handle, get = rqp.sendMessage, self.handle, self.dest_queue.get
        else:
            head, mq, dest = RAW_RECORD.pack(SURE_MSG, self.raw_dest), self.raw_mq, self.raw_dest_mq
        warmup = max(5, samples // 10)
        for seq in range(warmup + samples):
            payload = PAYLOAD_HEAD.pack(tag, seq) + tail
            if pipe is self.rqp:
                t0 = clock()
                send(handle, payload, SURE_MSG, mtype=self.mtype)
                data = get()
                t1 = clock()
            else:
                record = head + payload
                t0 = clock()
                _send_retrying(mq, record, type=DEFAULT_MTYPE)
                data = _receive_retrying(dest)[0]
                t1 = clock()
                self.raw_put += 1
            if data != payload:
                got = PAYLOAD_HEAD.unpack_from(data) if len(data) >= PAYLOAD_HEAD.size else "?"
                raise BenchError(f"{pipe.name} latency: message {seq} came back different "
                                 f"({len(data)} bytes, tag and sequence {got})")
            self.sent += 1
            if seq >= warmup:
                out.append(t1 - t0)
        self._check_clean(pipe)
        return out

    def measure_latency(self, samples: int, size: int = 100) -> Latency:
        lat = Latency(samples, size, self.label)
        rqp_ns = self._latency_samples(self.rqp, samples, size)
        raw_ns = self._latency_samples(self.raw, samples, size)
        lat.rqp_median_ms, lat.rqp_p99_ms = (percentile(rqp_ns, p) / 1e6 for p in (50, 99))
        lat.raw_median_ms, lat.raw_p99_ms = (percentile(raw_ns, p) / 1e6 for p in (50, 99))
        return lat

    def run(self) -> None:
        self.watchdog.armed = True
        try:
            for transport, mtype, loop in self.args.variants:
                if (transport, loop) != (self.transport, self.loop_name):
                    self._stop_agents(check=True)  # the same queues, consumers and raw pipeline
                    self._start_agents(transport, loop)
                self.mtype = mtype
                self.label = "uvloop" if loop == "uvloop" else \
                    transport if mtype == 1 else "MESSAGE_EX"
                for msg_type, size in self.args.cases:
                    self.results.append(self.throughput(msg_type, size, self.args.count[size],
                                                        self.args.rounds))
                self.latencies.append(self.measure_latency(self.args.latency_samples))
            self._finish_raw()
            self._stop_agents(check=True)
        finally:
            self.watchdog.armed = False

    def _finish_raw(self) -> None:
        """Stop the raw pipeline in order; its processes check their own counts on the way."""
        for proc in (self.raw_sender, self.raw_receiver):
            self.watchdog.processes.pop(f"the {proc.name}", None)
        _send_retrying(self.raw_mq, b"stop", type=RAW_STOP_MTYPE)
        for proc in (self.raw_sender, self.raw_receiver):
            proc.join(15)
            if proc.exitcode != 0:
                raise BenchError(f"{proc.name} ended with status {proc.exitcode} "
                                 "(frames unacknowledged or cut short)")

    def _stop_agents(self, check: bool = False, grace: float = 20.0) -> None:
        """SIGTERM (their graceful stop), SIGKILL after ``grace`` seconds."""
        if hasattr(self, "watchdog"):
            self.watchdog.processes.pop("the sending MCA", None)
            self.watchdog.processes.pop("the receiving MCA", None)
        for name in ("sender", "receiver"):
            proc = getattr(self, name, None)
            if proc is None or proc.poll() is not None:
                continue
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(grace)
            except subprocess.TimeoutExpired:
                say(f"rqp-bench: the {name} did not stop within {grace:g}s: killing it", err=True)
                proc.kill()
                proc.wait()
            if check and proc.returncode != 0:
                raise BenchError(f"the {name} ended with status {proc.returncode}")

    # --- reporting ----------------------------------------------------------------------------

    def diagnose(self) -> None:
        """After a failure: where the messages are, what the agents said."""
        for pipe in (getattr(self, "rqp", None), getattr(self, "raw", None)):
            if pipe is not None and pipe.progress is not None:
                say(f"   {pipe.name} consumer: about {pipe.progress.value} message(s) of the "
                    "current case taken", err=True)
        for name, key in (("destination", self.dest), ("transmission", self.xmit),
                          ("DEAD.LETTER.Q", self.dlq), ("raw transmission", self.raw_xmit),
                          ("raw destination", self.raw_dest)):
            try:
                queue = LocalQueue.open(key)
                say(f"   {name} queue {format_key(key)}: {queue.depth} message(s)", err=True)
            except rqp.QueueError:
                continue
            if key == self.dlq:
                for _ in range(min(3, queue.depth)):
                    try:
                        rec = DeadLetterRecord.from_bytes(queue.get(block=False))
                        say(f"     dead letter: {rec.reason.name}: {rec.detail}", err=True)
                    except rqp.RQPError:
                        break
        for log in (getattr(self, "receiver_log", None), getattr(self, "sender_log", None)):
            if log and log.exists():
                lines = log.read_text(errors="replace").splitlines()[-15:]
                say(f"--- last lines of {log.name}\n" + "\n".join(lines), err=True)

    def cleanup(self) -> None:
        if hasattr(self, "watchdog"):
            self.watchdog.stop()
        if self.broker is not None:
            try:
                self.broker.stop()
            except Exception as exc:  # noqa: BLE001 - cleanup goes on
                say(f"rqp-bench: stopping RabbitMQ: {exc}", err=True)
        try:
            self._stop_agents(grace=5.0)  # after a successful run they have stopped already
        except Exception as exc:  # noqa: BLE001 - cleanup goes on
            say(f"rqp-bench: stopping the agents: {exc}", err=True)
        for pipe in (getattr(self, "rqp", None), getattr(self, "raw", None)):
            if pipe is not None and pipe.conn is not None:
                try:
                    pipe.conn.send(("stop",))
                except OSError:
                    pass
        # Removing the queues wakes anything still blocked in msgrcv/msgsnd on them.
        for queue in self.created:
            try:
                queue.remove()
            except rqp.QueueError:
                pass
        for key in self.semaphores:
            try:
                sysv_ipc.Semaphore(key).remove()
            except sysv_ipc.Error:
                pass
        for name, proc in self.children:
            if isinstance(proc, subprocess.Popen):
                continue
            proc.join(5)
            if proc.exitcode is None:
                proc.terminate()
                proc.join(5)
            if proc.exitcode is None:
                proc.kill()
                proc.join()

    def table(self) -> str:
        lines = [
            f"RQP end-to-end on loopback ({self.isolation}): "
            f"kernel.msgmnb {self.msgmnb} B ({self.msgmnb / 1024:g} KiB, every queue's "
            f"msg_qbytes), kernel.msgmax {self.msgmax} B",
            f"Python {platform.python_version()}, {os.cpu_count()} CPUs, load average "
            f"{self.load:.2f} at the start; messages per case: "
            + ", ".join(f"{self.args.count[s]} x {size_label(s)}"
                        for s in dict.fromkeys(size for _, size in self.args.cases))
            + f"; msg/s = median of {self.args.rounds} round(s); every message checked "
            "(count, bytes, SURE order)",
            "",
            f"{'case':<22}{'RQP msg/s':>13}{'spread':>8}{'raw msg/s':>12}{'RQP/raw':>10}",
        ]
        several = len(self.args.variants) > 1
        rabbit = self.broker is not None
        if rabbit:
            lines[-1] += f"{'RabbitMQ msg/s':>16}{'RQP/RabbitMQ':>14}"
        for r in self.results:
            case = f"{r.message_type:<6} {size_label(r.size)}" + (f" {r.transport}" if several
                                                                   else "")
            lines.append(f"{case:<22}{r.rqp_msg_per_s:>13,.0f}{_spread(r.rqp_seconds):>8}"
                         f"{r.raw_msg_per_s:>12,.0f}{r.ratio:>10.3f}" + (
                             f"{r.rabbit_msg_per_s:>16,.0f}"
                             f"{r.rqp_msg_per_s / r.rabbit_msg_per_s:>14.3f}" if rabbit else ""))
        if rabbit:
            lines += ["", "RabbitMQ (pika clients): SURE = persistent, durable queue, publisher "
                      f"confirms with at most {CONFIRM_WINDOW} unconfirmed; UNSURE = transient, "
                      "no confirms; consumer auto-ack. CPU per message, µs:",
                      f"{'RabbitMQ µs/msg':<22}{'producer':>15}{'broker':>15}{'consumer':>15}"
                      f"{'total':>10}"]
            for r in self.results:
                figures = [r.rabbit_cpu_median(n) for n in ("producer", "broker", "consumer")]
                lines.append(f"{r.message_type + ' ' + size_label(r.size):<22}"
                             + "".join(f"{x:>15.1f}" for x in figures)
                             + f"{sum(figures):>10.1f}")
        # TLS and MESSAGE_EX against plaintext MESSAGE, case by case, the same raw pipeline
        plain = {(r.message_type, r.size): r for r in self.results if r.transport == "plaintext"}
        for label, title in (("TLS", "TLS / plaintext"), ("MESSAGE_EX", "MESSAGE_EX / MESSAGE"),
                             ("uvloop", "uvloop / asyncio (the agents' event loop)")):
            if any(r.transport == label for r in self.results):
                lines += ["", f"{title}, msg/s: " + ", ".join(
                    f"{r.message_type} {size_label(r.size)} "
                    f"{r.rqp_msg_per_s / plain[(r.message_type, r.size)].rqp_msg_per_s:.3f}"
                    for r in self.results if r.transport == label)]
        lines += ["", "CPU per message, µs (median of the rounds; producer = sendMessage's "
                  "thread, every thread of the others, from /proc):",
                  f"{'CPU µs/msg':<22}" + "".join(f"{name:>15}" for name in CPU_PROCESSES)
                  + f"{'total':>10}"]
        for r in self.results:
            case = f"{r.message_type:<6} {size_label(r.size)}" + (f" {r.transport}" if several
                                                                   else "")
            figures = [r.cpu_median(name) for name in CPU_PROCESSES]
            lines.append(f"{case:<22}" + "".join(f"{x:>15.1f}" for x in figures)
                         + f"{sum(figures):>10.1f}")
        for lat in self.latencies:
            lines += ["", f"single SURE latency ({size_label(lat.size)}, {lat.samples} samples"
                      f"{', ' + lat.transport if several else ''}): "
                      f"median {lat.rqp_median_ms:.3f} ms, p99 {lat.rqp_p99_ms:.3f} ms "
                      f"(raw: median {lat.raw_median_ms:.3f} ms, p99 {lat.raw_p99_ms:.3f} ms)"]
        notes = self.caveats()
        if notes:
            lines += ["", *[f"NOTE: {note}" for note in notes]]
        return "\n".join(lines)

    def caveats(self) -> list[str]:
        """What makes these figures weaker than the README's (a trial: SURE 2.02x RabbitMQ at
        3,000 messages, 1.42x at 15,000, the table silent about it)."""
        notes = []
        few = {s: n for s, n in self.args.count.items() if n < DEFAULT_MESSAGES.get(s, 0)}
        if few:
            notes.append("fewer messages per case than the defaults ("
                         + ", ".join(f"{n} x {size_label(s)} against {DEFAULT_MESSAGES[s]}"
                                     for s, n in few.items())
                         + "): start-up weighs more, and the ratios move with the count; "
                         "compare only figures of the same counts (the README says which "
                         "each of its figures used)")
        if self.args.rounds < DEFAULT_ROUNDS:
            notes.append(f"{self.args.rounds} round(s) per case: the median of fewer than "
                         f"{DEFAULT_ROUNDS}, and no spread to judge it by")
        if self.latencies and self.args.latency_samples < 100:
            notes.append(f"{self.args.latency_samples} latency sample(s): the p99 of fewer than "
                         "100 is no p99")
        cpus = os.cpu_count() or 1
        if self.load > cpus / 2:
            notes.append(f"load average {self.load:.2f} on {cpus} CPUs at the start: the "
                         "machine was busy, the figures may be too")
        return notes

    def figures(self) -> dict:
        return {
            "isolation": self.isolation, "msgmnb": self.msgmnb, "msgmax": self.msgmax,
            "python": platform.python_version(), "cpus": os.cpu_count(), "load_average": self.load,
            "caveats": self.caveats(),
            "rounds": self.args.rounds, "transports": self.args.transports,
            "variants": [label for label in dict.fromkeys(r.transport for r in self.results)],
            "cases": [dict(asdict(r), rqp_msg_per_s=r.rqp_msg_per_s,
                           raw_msg_per_s=r.raw_msg_per_s, ratio=r.ratio,
                           rabbit_msg_per_s=r.rabbit_msg_per_s if r.rabbit_seconds else None,
                           rabbit_cpu_us_per_message={
                               n: r.rabbit_cpu_median(n) for n in ("producer", "broker",
                                                                   "consumer")}
                           if r.rabbit_seconds else None,
                           cpu_us_per_message={name: r.cpu_median(name)
                                               for name in CPU_PROCESSES})
                      for r in self.results],
            "latency": asdict(self.latencies[0]) if self.latencies else None,
            "latencies": [asdict(lat) for lat in self.latencies],
        }


# --------------------------------------------------------------------------------------------
# entry point
# --------------------------------------------------------------------------------------------


def _case(text: str) -> tuple[int, int]:
    """``--case``: 'sure:100' -> (SURE_MSG, 100)."""
    kind, _, size = text.strip().lower().partition(":")
    types = {"sure": SURE_MSG, "unsure": UNSURE_MSG}
    if kind not in types or not size.isdigit() or int(size) not in SIZES:
        raise argparse.ArgumentTypeError(
            f"{text!r}: a case is TYPE:SIZE, TYPE sure or unsure, SIZE one of "
            + ", ".join(str(s) for s in SIZES))
    return types[kind], int(size)


def _spread(seconds: list[float]) -> str:
    """Half the range of the rounds' msg/s, in % of their median ("-" for one round)."""
    if len(seconds) < 2:
        return "-"
    rates = [1 / s for s in seconds]
    return f"±{(max(rates) - min(rates)) / 2 / statistics.median(rates) * 100:.0f}%"


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m rqp.tools.bench",  # (scripts/bench runs it; there is no rqp-bench command)
        description="End-to-end messages/s and latency of the RQP agents on loopback, beside a "
        "minimal raw struct+sockets pipeline (the ceiling).")
    parser.add_argument("--messages", type=int, metavar="N",
                        help="messages per throughput case (default: "
                        + ", ".join(f"{n} for {size_label(s)}" for s, n in DEFAULT_MESSAGES.items())
                        + ")")
    parser.add_argument("--latency-samples", type=int, metavar="N",
                        help=f"single-message round trips (default {DEFAULT_LATENCY_SAMPLES})")
    parser.add_argument("--rounds", type=int, metavar="R",
                        help=f"timed runs per case and pipeline, alternating RQP and raw; the "
                        f"table shows the median (default {DEFAULT_ROUNDS}, 1 with --quick)")
    parser.add_argument("--quick", action="store_true",
                        help="small counts: a smoke test of a few seconds")
    parser.add_argument("--json", metavar="FILE", type=cli.output_file,
                        help="also write the figures to FILE")
    parser.add_argument("--tls", action="store_true",
                        help="run every case again with the agents talking mutual TLS (same run, "
                        "same queues and raw pipeline): TLS against plaintext")
    parser.add_argument("--extensions", action="store_true",
                        help="run every case again with each message sent with mtype 2, so as "
                        "MESSAGE_EX (spec section 6): MESSAGE_EX against MESSAGE, same run")
    parser.add_argument("--msgmnb", type=int, default=DEFAULT_MSGMNB, metavar="BYTES",
                        help=f"kernel.msgmnb (queue size) to set in the private IPC namespace "
                        f"(default {DEFAULT_MSGMNB})")
    parser.add_argument("--uvloop", action="store_true",
                        help="also run every case with the agents on uvloop (pip install "
                        "uvloop), against the standard asyncio loop in the same run")
    parser.add_argument("--against", choices=("rabbitmq",), default=None,
                        help="also run every case through a RabbitMQ broker of this run, "
                        "alternating with RQP (scripts/bench installs rabbitmq-server and pika)")
    parser.add_argument("--window", type=cli.window, default=None, metavar="N",
                        help="the sending MCA's window (frames in flight per connection; "
                        "default: .rqprc's default)")
    parser.add_argument("--case", action="append", type=_case, metavar="TYPE:SIZE",
                        dest="cases", help="run only this throughput case (repeatable): "
                        "sure:100, unsure:100, sure:4096 or unsure:4096 (default: all four)")
    parser.add_argument("--stall", type=float, default=STALL, metavar="SECONDS",
                        help=f"fail when no message moves for this long (default {STALL:g})")
    args = parser.parse_args(argv)
    base = QUICK_MESSAGES if args.quick else DEFAULT_MESSAGES
    if args.messages is not None and args.messages < 1:
        parser.error("--messages must be at least 1")
    args.count = {s: args.messages or n for s, n in base.items()}
    args.cases = list(dict.fromkeys(args.cases)) if args.cases else \
        [(t, size) for size in SIZES for t in (SURE_MSG, UNSURE_MSG)]
    args.transports = ["plaintext", "TLS"] if args.tls else ["plaintext"]
    #: (transport, mtype, event loop of the agents) of each pass over the cases
    args.variants = [(t, 1, "asyncio") for t in args.transports] + (
        [("plaintext", 2, "asyncio")] if args.extensions else []) + (
        [("plaintext", 1, "uvloop")] if args.uvloop else [])
    if args.rounds is None:
        args.rounds = 1 if args.quick else DEFAULT_ROUNDS
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if args.latency_samples is None:
        args.latency_samples = QUICK_LATENCY_SAMPLES if args.quick else DEFAULT_LATENCY_SAMPLES
    if args.latency_samples < 1:
        parser.error("--latency-samples must be at least 1")
    return args


def reexec_isolated(argv: list[str], module: str = "rqp.tools.bench") -> None:
    """Become ``unshare --ipc -- python -m MODULE ARGS`` (no return) when that is possible."""
    if os.environ.get(ISOLATED_ENV):
        return  # re-executed already (or told not to)
    unshare = shutil.which("unshare")
    if not unshare:
        return
    cmd = [unshare, "--ipc"] if os.geteuid() == 0 else [unshare, "--user", "--map-root-user",
                                                        "--ipc"]
    probe = subprocess.run([*cmd, "--", "true"], stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
    if probe.returncode != 0:
        return
    env = dict(os.environ, **{ISOLATED_ENV: _ipc_namespace()})
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(unshare, [*cmd, "--", sys.executable, "-m", module, *argv], env)


def _ipc_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/ipc")
    except OSError:
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    reexec_isolated(argv)
    left = os.environ.get(ISOLATED_ENV)
    private = bool(left) and left.startswith("ipc:") and left != _ipc_namespace()
    try:
        previous = signals.take_stops()
    except KeyboardInterrupt as exc:  # (held by its starter: it came before we began)
        say(f"rqp-bench: stopped ({exc}) before it began; nothing was made", err=True)
        return 130
    remove_abandoned(WORKDIR_PREFIX)  # of runs killed before they could clean up
    workdir = Path(tempfile.mkdtemp(prefix=f"{WORKDIR_PREFIX}{os.getpid()}-"))
    bench = Bench(args, workdir, private)
    status = 1
    try:
        say(f"rqp-bench: starting ({bench.isolation}; working directory {workdir})", err=True)
        bench.setup()
        bench.run()
        table = bench.table()
        say(table)
        if args.json:
            Path(args.json).write_text(json.dumps(bench.figures(), indent=2) + "\n")
        status = 0
    except (BenchError, rqp.RQPError, OSError, sysv_ipc.Error) as exc:
        say(f"rqp-bench: FAILED: {exc}", err=True)
        try:
            bench.diagnose()
        except Exception as diag_exc:  # noqa: BLE001
            say(f"rqp-bench: (diagnosis failed: {diag_exc})", err=True)
    except KeyboardInterrupt as exc:
        signals.quiet_stops()  # (a second Ctrl-C while this is said: not a traceback)
        say(f"rqp-bench: interrupted{f' ({exc})' if str(exc) else ''}; cleaning up", err=True)
        status = 130
    finally:
        signals.quiet_stops()  # let the clean-up finish
        try:
            bench.cleanup()
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
            signals.restore(previous)
    if status == 130:
        say("rqp-bench: stopped; its agents, queues and files are removed", err=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
