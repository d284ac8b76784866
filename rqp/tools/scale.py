"""rqp-scale: throughput and CPU per message of the real agents as the load spreads out.

Three sweeps, each case with fresh agents, every message checked (exactly once; SURE in order
per producer and queue):

* **queue keys**: one producer sends round-robin over 1 .. 1,000 destination queues (``--keys``);
* **producers**: 1 .. 20 producer processes send to one queue through one sending MCA;
* **sending MCAs**: one receiving MCA serves 1 .. 10 sending MCAs, each with its own
  transmission queue, journal and state directory, fed by a producer of its own (on this one
  machine they share the CPU and the IPC namespace, nothing else).

``--hosts`` puts every agent on a simulated host of its own instead (the test suite's testbed,
tests/testbed.py, so it needs the source checkout): a network namespace with its own address
on a bridge and an IPC namespace of its own, so that the receiving MCA serves 10 sending hosts
over veth links, each sending host's transmission queue and producer invisible to the others.
``--tls`` has the agents talk mutual TLS (a CA and certificates made for the run).

Per case: messages/s (median over the rounds, first put to last take) and CPU microseconds per
message of each kind of process (the sum over the processes of that kind, from /proc), so that
"flat from 1 to 1,000 queue keys" can be read off directly. The consumer is one process that
takes each message from the queue it must be next on, waiting there (no polling over many
queues: the CPU it spends is reported, but it is the harness's, not RQP's). Each case after a
sweep's first is also shown against it: the change in msg/s and in the sending MCA's CPU.
With ``--passes P`` the whole list of cases is run P times in turn (fresh agents each time),
and those changes are taken pass by pass, then the median: on a machine whose speed drifts
during a run, one case run after another differs by as much as the ±10 % "flat" allows.

Like rqp-bench it re-executes itself in a private IPC namespace (root, ``unshare --ipc``),
raises ``kernel.msgmnb`` there, and removes everything it made at the end.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import multiprocessing
import os
import shutil
import signal
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import sysv_ipc

import rqp
from rqp import cli
from rqp.protocol.constants import SURE_MSG, UNSURE_MSG
from rqp.protocol.records import TRANSMISSION_HEADER_SIZE
from rqp.system import signals
from rqp.system.files import remove_abandoned
from rqp.system.queues import LocalQueue, kernel_limits
from rqp.system.signals import raise_if_stopped
from rqp.tools.bench import (
    BenchError, ISOLATED_ENV, _child_preexec, _child_setup, _ipc_namespace, free_port,
    START_TIMEOUT, process_cpu_ns, reexec_isolated, say, stop_signals_held,
    unused_key, wait_started,
)

#: Front of every payload: the round's tag, the producer's number, its sequence number.
HEAD = struct.Struct(">IHI")
#: A round that has not finished after this many seconds fails the run.
ROUND_TIMEOUT = 300.0
#: The run's working directory in $TMPDIR: PREFIX PID-random.
WORKDIR_PREFIX = "rqp-scale-"
#: The keys sweep's queue key counts (``--keys``).
KEY_COUNTS = [1, 10, 100, 1000]
#: Queues a run makes besides one a key: transmission queues and DEAD.LETTER.Qs (10 senders).
QUEUES_BESIDE = 32
SWEEPS = {
    "keys": [dict(keys=k, producers=1, senders=1) for k in KEY_COUNTS],
    "producers": [dict(keys=1, producers=p, senders=1) for p in (1, 5, 20)],
    "senders": [dict(keys=1, producers=s, senders=s) for s in (1, 10)],
}


def _tail(size: int) -> bytes:
    return bytes((i * 7 + 3) & 0xFF for i in range(size - HEAD.size))


_CLONE_NEWIPC = 0x08000000


def enter_ipc_namespace(where: str | int) -> None:
    """setns(2) this thread into the IPC namespace of the nsfs file ``where`` (a path, or an
    open descriptor); os.setns is Python 3.12's."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = where if isinstance(where, int) else os.open(where, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if libc.setns(fd, _CLONE_NEWIPC) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into the IPC namespace {where}: {os.strerror(err)}")
    finally:
        if fd is not where:
            os.close(fd)


def producer_main(parent: int, number: int, rqprc: str, keys: list[int], tag: int,
                  count: int, size: int, msg_type: int, start, cpu,
                  ipc_ns: str | None = None) -> None:
    """Send ``count`` messages round-robin over ``keys``, once ready (``start``'s semaphore
    released) and let go (its event set); put the CPU ns it spent sending in ``cpu[number]``.
    ``ipc_ns``: the IPC namespace of the simulated host whose sending MCA it feeds
    (``--hosts``)."""
    _child_setup(parent)
    if ipc_ns:
        enter_ipc_namespace(ipc_ns)
    handles = [rqp.openConnection(k, rqprc=rqprc, start_sender=False) for k in keys]
    tail, pack, send, n = _tail(size), HEAD.pack, rqp.sendMessage, len(handles)
    ready, go = start
    ready.release()
    go.wait()
    t0 = time.thread_time_ns()
    for seq in range(count):
        send(handles[seq % n], pack(tag, number, seq) + tail, msg_type)
    cpu[number] = time.thread_time_ns() - t0
    for handle in handles:
        rqp.closeConnection(handle)


def consumer_main(parent: int, keys: list[int], conn) -> None:
    """Take every message of a round from ``keys``; check each; report (first, last) ns."""
    _child_setup(parent)
    msgmax = kernel_limits().msgmax
    queues = [sysv_ipc.MessageQueue(k, 0, mode=0, max_message_size=msgmax) for k in keys]
    while True:
        cmd = conn.recv()
        if cmd[0] == "stop":
            return
        _, tag, counts, size, ordered = cmd
        try:
            conn.send(("done", *_consume(queues, tag, counts, size, ordered)))
        except Exception as exc:  # noqa: BLE001 - reported to the parent, which fails the run
            conn.send(("error", f"{type(exc).__name__}: {exc}"))


def _consume(queues, tag: int, counts: list[int], size: int, ordered: bool):
    """Take the round's messages, each from the queue it must be next on, waiting there: one
    producer sends round-robin over the queues, so its message ``i`` is the next on queue
    ``i % len(queues)`` (per queue, messages come in the order sent); several producers send
    to one queue. (A message that never comes: the parent's ROUND_TIMEOUT ends the round.)"""
    if len(counts) > 1 and len(queues) > 1:
        raise BenchError("several producers over several queues: no sweep has that case")
    seen = [bytearray(c) for c in counts]
    last_seq: dict[int, int] = {}
    tail, unpack = _tail(size), HEAD.unpack_from
    first = last = 0
    for i in range(sum(counts)):
        index = i % len(queues)
        data = queues[index].receive()[0]
        last = time.monotonic_ns()
        first = first or last
        if len(data) != size or not data.endswith(tail):
            raise BenchError(f"a message of {len(data)} bytes, expected {size}")
        t, producer, seq = unpack(data)
        if t != tag or producer >= len(counts) or seq >= counts[producer]:
            raise BenchError(f"a message of round {t}, producer {producer}, sequence "
                             f"{seq}: not one of this round's")
        if seen[producer][seq]:
            raise BenchError(f"producer {producer} sequence {seq}: a duplicate")
        seen[producer][seq] = 1
        if seq % len(queues) != index:
            raise BenchError(f"producer {producer} sequence {seq} on queue {index} of "
                             f"{len(queues)}: it was sent to queue {seq % len(queues)}")
        if ordered:  # (each queue keeps the order sent, so every producer's stream is ordered)
            if last_seq.get(producer, -1) > seq:
                raise BenchError(f"producer {producer}: SURE sequence {seq} taken after "
                                 f"{last_seq[producer]}")
            last_seq[producer] = seq
    return first, last


@dataclass
class Case:
    sweep: str
    keys: int
    producers: int
    senders: int
    seconds: list[float] = field(default_factory=list)
    cpu: dict[str, list[float]] = field(default_factory=dict)  # kind -> us/msg per round
    passes: list[int] = field(default_factory=list)  # the pass each round was in (--passes)

    def pass_figures(self, messages: int) -> dict[int, tuple[float, float]]:
        """Per pass: (msg/s, sending MCA CPU µs a message), medians of its rounds."""
        out = {}
        for each in sorted(set(self.passes)):
            rounds = [i for i, p in enumerate(self.passes) if p == each]
            out[each] = (statistics.median(messages / self.seconds[i] for i in rounds),
                         statistics.median(self.cpu["sending MCA"][i] for i in rounds))
        return out

    @property
    def label(self) -> str:
        return (f"{self.sweep}: {self.keys} key(s), {self.producers} producer(s), "
                f"{self.senders} sending MCA(s)")


class Scale:
    def __init__(self, args: argparse.Namespace, workdir: Path) -> None:
        self.args, self.workdir = args, workdir
        self.procs: list = []
        self.queues: list[LocalQueue] = []
        self.taken: set[int] = set()
        self.msg_type = SURE_MSG if args.type == "SURE" else UNSURE_MSG
        # --hosts: the case's simulated hosts (a Testbed), and while they exist this thread is
        # in the receiving host's IPC namespace (its queues, the consumer), ours kept in home
        self.bed = self.receiving_host = None
        self.sending_hosts: list = []
        self.home: int | None = None
        self.tls_dir = workdir / "tls"

    # --- one case -----------------------------------------------------------------------------

    def run_case(self, case: Case, pass_: int = 1) -> None:
        args, n = self.args, self.args.messages
        try:
            if args.hosts:
                self._make_hosts(case.senders)
            dest = self._make_queues(case.keys)
            receiver, port = self._start_receiver()
            senders = [self._start_sender(i, port) for i in range(case.senders)]
            ctx = multiprocessing.get_context("fork")
            ours, theirs = ctx.Pipe()
            consumer = ctx.Process(target=consumer_main, args=(os.getpid(), dest, theirs))
            with stop_signals_held():
                consumer.start()
                self.procs.append(consumer)
            theirs.close()
            per = [n // case.producers + (i < n % case.producers) for i in range(case.producers)]
            for round_ in range(args.rounds + 1):  # the first is a warm-up
                tag = round_ + 1
                # (not a Barrier: a stop that came while the parent waited in it, inside
                # multiprocessing's own locking, broke that and ended the run with a
                # traceback, exit 1: a fresh machine's suite)
                start = ctx.Semaphore(0), ctx.Event()
                cpu = ctx.Array("q", case.producers, lock=False)
                ours.send(("consume", tag, per, args.size, self.msg_type == SURE_MSG))
                producers = [ctx.Process(target=producer_main, args=(
                    os.getpid(), i, str(senders[i % case.senders][1]), dest, tag, per[i],
                    args.size, self.msg_type, start, cpu, senders[i % case.senders][2]))
                    for i in range(case.producers)]
                for p in producers:
                    with stop_signals_held():
                        p.start()
                        self.procs.append(p)
                agents = {"sending MCA": [s[0].pid for s in senders],
                          "receiving MCA": [receiver.pid], "consumer": [consumer.pid]}
                # (before the producers are let go: read after, a busy machine could leave
                # the agents done with the round already, and their CPU counted as 0)
                before = {k: sum(map(process_cpu_ns, pids)) for k, pids in agents.items()}
                ready, go = start
                started_by = time.monotonic() + START_TIMEOUT * 3
                for _ in producers:  # (each acquire a stop may end at once, safely)
                    while not ready.acquire(timeout=0.5):
                        if time.monotonic() > started_by or any(
                                p.exitcode not in (None, 0) for p in producers):
                            raise BenchError(f"{case.label}: the producers did not start "
                                             "(see above)")
                with stop_signals_held():  # (set() takes multiprocessing's locks: no stop
                    go.set()  # may land inside them)
                t0 = time.monotonic_ns()
                deadline = time.monotonic() + ROUND_TIMEOUT
                while not ours.poll(0.5):  # (and a producer that failed ends the run now)
                    raise_if_stopped()
                    failed = [p for p in producers if p.exitcode not in (None, 0)]
                    if failed:
                        raise BenchError(f"{case.label}: a producer exited with status "
                                         f"{failed[0].exitcode} (see above)")
                    gone = [(name, proc.returncode) for name, proc in
                            [("receiving MCA", receiver), *(("sending MCA", s[0])
                                                            for s in senders)]
                            if proc.poll() is not None]
                    if gone:  # (not only at ROUND_TIMEOUT: a trial waited 300 s for it)
                        raise BenchError(f"{case.label}: the {gone[0][0]} exited with status "
                                         f"{gone[0][1]} during round {round_}")
                    if time.monotonic() > deadline:
                        raise BenchError(f"{case.label}: round {round_} did not finish in "
                                         f"{ROUND_TIMEOUT:g}s")
                reply = ours.recv()
                after = {k: sum(map(process_cpu_ns, pids)) for k, pids in agents.items()}
                for p in producers:
                    p.join(30)
                    if p.exitcode != 0:
                        raise BenchError(f"{case.label}: producer exited with {p.exitcode}")
                if reply[0] == "error":
                    raise BenchError(f"{case.label}: consumer: {reply[1]}")
                if round_ == 0:
                    continue
                case.seconds.append((reply[2] - t0) / 1e9)
                case.passes.append(pass_)
                case.cpu.setdefault("producer", []).append(sum(cpu) / 1000 / n)
                for kind in agents:
                    case.cpu.setdefault(kind, []).append((after[kind] - before[kind]) / 1000 / n)
            ours.send(("stop",))
            consumer.join(10)
        finally:
            with stop_signals_held():  # (a second stop waits for the clean-up to finish)
                self.stop_all()

    def _make_hosts(self, senders: int) -> None:
        """A receiving host and ``senders`` sending hosts; this thread enters the receiving
        host's IPC namespace (the destination queues and the consumer live there)."""
        try:
            from tests.testbed import Testbed, TestbedError, sweep_stale
        except ImportError as exc:
            raise BenchError(f"--hosts runs the agents on the test suite's simulated hosts "
                             f"(tests/testbed.py), which this installation lacks ({exc}): run "
                             "scripts/bench --scale --hosts from a clone of the project") from None
        swept = sweep_stale("scale")  # (the hosts of a run killed before it could clean up)
        if swept:
            say(f"rqp-scale: removed what a killed run left: {', '.join(swept)}", err=True)
        try:
            self.bed = Testbed(name_prefix="scale", sysctls={"kernel.msgmnb": 1 << 22})
            self.receiving_host = self.bed.add_host("r")
            self.sending_hosts = [self.bed.add_host(f"s{i}") for i in range(senders)]
        except TestbedError as exc:
            raise BenchError(f"cannot make the simulated hosts: {exc}") from None
        self.home = os.open("/proc/thread-self/ns/ipc", os.O_RDONLY | os.O_CLOEXEC)
        enter_ipc_namespace(self.receiving_host.ipc_ns_path)

    def _make_queues(self, count: int) -> list[int]:
        base = unused_key(self.taken, count)
        for key in range(base, base + count):
            self.queues.append(LocalQueue.create(key, mode=0o600))
        return list(range(base, base + count))

    def _popen(self, argv: list[str], log: Path, host=None) -> subprocess.Popen:
        with open(log, "ab") as log_file, stop_signals_held():
            if host is not None:  # (killed by the testbed's close, whatever happens to us)
                proc = host.popen(argv, stdout=subprocess.DEVNULL, stderr=log_file,
                                  cwd=str(self.workdir), preexec_fn=_child_preexec)
            else:
                proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL,
                                        stdout=subprocess.DEVNULL, stderr=log_file,
                                        cwd=str(self.workdir), start_new_session=True,
                                        preexec_fn=_child_preexec)
            self.procs.append(proc)
        return proc

    def _tls(self, name: str) -> str:
        """The ``tls:`` block of an agent's config (``--tls``): its certificate from the run's
        CA, named ``name`` (the receiving MCA: the address the senders dial)."""
        if not self.args.tls:
            return ""
        from rqp.tools import tls as tls_tool

        if not (self.tls_dir / "ca.crt").exists():  # one CA for the run
            self.tls_dir.mkdir(exist_ok=True)
            tls_tool.init_ca(self.tls_dir, name="RQP scale CA")
        cert, key = tls_tool.issue(name, self.tls_dir, force=True)
        return "tls: " + json.dumps({"cert": str(cert), "key": str(key),
                                     "ca": str(self.tls_dir / "ca.crt")}) + "\n"

    def _start_receiver(self) -> tuple[subprocess.Popen, int]:
        host = self.receiving_host
        port = free_port() if host is None else 7460
        address = "127.0.0.1" if host is None else host.address
        self.dlq = unused_key(self.taken)
        self.queues.append(LocalQueue.create(self.dlq, mode=0o600))
        # (named by its DEAD.LETTER.Q's key too: two cases' simulated hosts may get the same
        # address, as each case's testbed picks a free subnet again)
        state = self.workdir / f"receiver-{self.dlq:08x}-{address}-{port}"
        state.mkdir()
        config = state / "receiver.yaml"
        tls = self._tls(address)
        config.write_text(f"listen: {address}:{port}\ndead_letter_queue: {self.dlq:#x}\n"
                          f"state_dir: {state}\nput_retry_count: 100\nput_retry_interval: 0.1\n"
                          "offer:\n  allow: ['*']\n"
                          + (tls or ("plaintext: true\n" if host is not None else "")))
        log = state / "receiver.log"
        proc = self._popen([sys.executable, "-m", "rqp_agents.receiver", "--config",
                            str(config)], log, host)
        wait_started("the receiving MCA", lambda: "listening on" in _read(log), proc, log)
        self.receiver_address = f"{address}:{port}"
        return proc, port

    def _start_sender(self, number: int, port: int) -> tuple[subprocess.Popen, Path, str | None]:
        host = self.sending_hosts[number] if self.sending_hosts else None
        xmit = unused_key(self.taken, 2)  # (and its semaphores: xmit, xmit + 1)
        state = self.workdir / f"sender-{number}-{xmit:08x}"
        state.mkdir()
        rqprc = state / ".rqprc"
        window = f"window: {self.args.window}\n" if self.args.window is not None else ""
        # on a host of its own its DEAD.LETTER.Q is that host's default one
        dlq = f"dead_letter_queue: {self.dlq:#x}\n" if host is None else ""
        rqprc.write_text(f"hosts: [{self.receiver_address}]\ntransmission_queue: {xmit:#x}\n"
                         f"{dlq}state_dir: {state}\nask_timeout: 2s\nconfirm_timeout: 15s\n"
                         f"{window}" + (self._tls(f"scale-sender-{number}")
                                        or "plaintext: true\n"))  # (to another host: said)
        log = state / "sender.log"
        proc = self._popen([sys.executable, "-m", "rqp_agents.sender", "--rqprc", str(rqprc)],
                           log, host)
        wait_started(f"sending MCA {number}", lambda: "serving transmission queue" in _read(log),
                     proc, log)
        if host is None:  # (its semaphores, and the marker of its DEAD.LETTER.Q)
            self.semaphores = getattr(self, "semaphores", []) + [xmit, xmit + 1, self.dlq]
        return proc, rqprc, host.ipc_ns_path if host is not None else None

    def stop_all(self) -> None:
        for proc in reversed(self.procs):
            try:
                if isinstance(proc, subprocess.Popen):
                    if proc.poll() is None:
                        proc.send_signal(signal.SIGTERM)
                        try:
                            proc.wait(20)
                        except subprocess.TimeoutExpired:
                            proc.kill()
                            proc.wait()
                elif proc.is_alive():
                    proc.kill()
                    proc.join()
            except OSError:
                pass
        self.procs = []
        for queue in self.queues:
            try:
                queue.remove()
            except (rqp.RQPError, OSError, sysv_ipc.Error):
                pass
        self.queues = []
        for key in getattr(self, "semaphores", []):
            try:
                sysv_ipc.Semaphore(key).remove()
            except sysv_ipc.Error:
                pass
        self.semaphores = []
        if self.home is not None:  # back home before the hosts' namespaces go
            enter_ipc_namespace(self.home)
            os.close(self.home)
            self.home = None
        if self.bed is not None:
            self.bed.close()
            for problem in self.bed.cleanup_problems:
                say(f"rqp-scale: cleaning up the simulated hosts: {problem}", err=True)
            self.bed, self.receiving_host, self.sending_hosts = None, None, []


def _read(log: Path) -> str:
    try:
        return log.read_text(errors="replace")
    except FileNotFoundError:
        return ""


KINDS = ("producer", "sending MCA", "receiving MCA", "consumer")


def against_first(cases: list[Case], messages: int) -> dict[int, tuple[list, list]]:
    """Per case but the first of its sweep (by ``id``): for each pass both ran in, the change
    against that first case in the same pass, in percent: (msg/s, sending MCA CPU a message).
    Paired by pass, so a machine that slows down or speeds up during a run moves both."""
    first: dict[str, dict] = {}
    out: dict[int, tuple[list, list]] = {}
    for case in cases:
        figures = case.pass_figures(messages)
        if case.sweep not in first:
            first[case.sweep] = figures
            continue
        base = first[case.sweep]
        both = [p for p in figures if p in base]
        out[id(case)] = ([100 * (figures[p][0] / base[p][0] - 1) for p in both],
                         [100 * (figures[p][1] / base[p][1] - 1) for p in both])
    return out


def _change(values: list[float]) -> str:
    if not values:
        return "-"
    text = f"{statistics.median(values):+.1f}%"
    return text + (f" ({min(values):+.1f}..{max(values):+.1f})" if len(values) > 1 else "")


def table(cases: list[Case], args: argparse.Namespace) -> str:
    where = ("each agent on a simulated host of its own" if args.hosts else
             "every agent on this host")
    passes = (f", {args.passes} passes over the cases in turn (fresh agents each time)"
              if args.passes > 1 else "")
    lines = [f"{args.type} {args.size} B, {'TLS' if args.tls else 'plaintext'}, {where}, "
             f"{args.messages} messages per round, median of the rounds ({args.rounds} a "
             f"case{' each pass' if args.passes > 1 else ''}; spread min-max){passes}; CPU us per "
             "message per kind of process (summed over its processes); against the sweep's "
             "first case: the change in msg/s and in the sending MCA's CPU, in the same pass "
             "(median over the passes, min..max)",
             f"{'case':62} {'msg/s':>22} " + " ".join(f"{k:>13}" for k in KINDS)
             + f" {'msg/s vs first':>22} {'sending vs first':>22}"]
    changes = against_first(cases, args.messages)
    for case in cases:
        rates = [args.messages / s for s in case.seconds]
        rate = f"{statistics.median(rates):,.0f} ({min(rates)/1000:.1f}-{max(rates)/1000:.1f}k)"
        cpu = " ".join(f"{statistics.median(case.cpu[k]):13.1f}" for k in KINDS)
        rate_change, cpu_change = changes.get(id(case), ([], []))
        lines.append(f"{case.label:62} {rate:>22} {cpu} {_change(rate_change):>22} "
                     f"{_change(cpu_change):>22}")
    return "\n".join(lines)


def write_json(cases: list[Case], args: argparse.Namespace) -> bool:
    """The figures to ``--json``'s file, if one was given: per case, what it ran (message
    type, payload size, messages a round, window: null for .rqprc's), per round (with the pass
    it was in, from 1), and each case against its sweep's first, pass by pass."""
    if not args.json:
        return False
    changes = against_first(cases, args.messages)
    Path(args.json).write_text(json.dumps(
        [{"keys": c.keys, "producers": c.producers, "senders": c.senders,
          "hosts": args.hosts, "tls": args.tls, "type": args.type, "size": args.size,
          "messages": args.messages, "window": args.window,
          "msg_per_s": [args.messages / s for s in c.seconds], "cpu_us": c.cpu,
          "pass": c.passes,
          "msg_per_s_vs_first_pct": changes.get(id(c), ([], []))[0],
          "sending_cpu_vs_first_pct": changes.get(id(c), ([], []))[1]}
         for c in cases], indent=2) + "\n")
    return True


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m rqp.tools.scale",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--sweeps", default="keys,producers,senders",
                        help="which sweeps, comma-separated (default: all of "
                        f"{', '.join(SWEEPS)})")
    parser.add_argument("--keys", type=cli.key_counts,
                        help="the keys sweep's queue key counts, comma-separated (default "
                        f"{','.join(map(str, KEY_COUNTS))})")
    parser.add_argument("--type", choices=("SURE", "UNSURE"), type=str.upper, default="SURE")
    parser.add_argument("--size", type=int, default=100, help="payload bytes (default 100)")
    parser.add_argument("--messages", type=int, default=20_000,
                        help="messages per round (default 20000)")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per case (3)")
    parser.add_argument("--passes", type=int, default=1,
                        help="go over the cases this many times in turn, with fresh agents "
                        "each time, --rounds rounds a case each pass (default 1): on a noisy "
                        "machine the cases are then compared pass by pass (flat from 1 to "
                        "1,000 keys: --sweeps keys --passes 5 --rounds 1)")
    parser.add_argument("--window", type=cli.window, help="the sending MCAs' window (default: "
                        ".rqprc's)")
    parser.add_argument("--hosts", action="store_true",
                        help="every agent on a simulated host of its own (network and IPC "
                        "namespaces, tests/testbed.py of the source checkout)")
    parser.add_argument("--tls", action="store_true",
                        help="the agents talk mutual TLS (a CA made for the run)")
    parser.add_argument("--json", metavar="FILE", type=cli.output_file,
                        help="also write the figures to FILE")
    args = parser.parse_args(argv)
    unknown = set(args.sweeps.split(",")) - set(SWEEPS)
    if unknown:
        parser.error(f"unknown sweep(s) {', '.join(sorted(unknown))}: one of "
                     f"{', '.join(SWEEPS)}")
    if args.keys is not None and "keys" not in args.sweeps.split(","):
        parser.error("--keys sets the keys sweep's counts: add keys to --sweeps")
    given, args.keys = args.keys is not None, args.keys or KEY_COUNTS
    room = kernel_limits().msgmni - QUEUES_BESIDE
    if max(args.keys) > room:
        parser.error(f"--keys {max(args.keys)}: at most {room} (kernel.msgmni "
                     f"{kernel_limits().msgmni}: one queue a key, and {QUEUES_BESIDE} beside)")
    if given and max(args.keys) > args.messages:  # (the default counts run with any --messages)
        parser.error(f"--keys {max(args.keys)}: more keys than --messages {args.messages} (a "
                     "round sends each key at least one)")
    largest = kernel_limits().msgmax - TRANSMISSION_HEADER_SIZE
    if not HEAD.size <= args.size <= largest:
        parser.error(f"--size {args.size}: a payload of {HEAD.size}..{largest} bytes (msgmax "
                     f"{kernel_limits().msgmax} less the {TRANSMISSION_HEADER_SIZE}-byte record "
                     "header)")
    if args.messages < 20:
        parser.error(f"--messages {args.messages}: at least 20")
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: at least 1")
    if args.passes < 1:
        parser.error(f"--passes {args.passes}: at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    reexec_isolated(argv, "rqp.tools.scale")
    left = os.environ.get(ISOLATED_ENV)
    if not (left and left.startswith("ipc:") and left != _ipc_namespace()):
        say("rqp-scale: needs a private IPC namespace (run as root, with unshare) to raise "
            "kernel.msgmnb for its queues", err=True)
        return 2
    Path("/proc/sys/kernel/msgmnb").write_text(f"{1 << 22}\n")
    try:
        signals.take_stops()  # (clean up as on Ctrl-C)
    except KeyboardInterrupt as exc:  # (held by its starter: it came before we began)
        say(f"rqp-scale: stopped ({exc}) before it began; nothing was made", err=True)
        return 130
    remove_abandoned(WORKDIR_PREFIX)  # of runs killed before they could clean up
    workdir = Path(tempfile.mkdtemp(prefix=f"{WORKDIR_PREFIX}{os.getpid()}-"))
    scale = Scale(args, workdir)
    sweeps = {**SWEEPS, "keys": [dict(keys=k, producers=1, senders=1) for k in args.keys]}
    cases = [Case(name, **spec) for name in args.sweeps.split(",") for spec in sweeps[name]]
    done: list[Case] = []
    stopped = False
    try:
        for pass_ in range(args.passes):
            for case in cases:
                say(f"rqp-scale: {case.label}" + (f", pass {pass_ + 1} of {args.passes}"
                                                  if args.passes > 1 else "") + " ...", err=True)
                scale.run_case(case, pass_ + 1)
                if not pass_:
                    done.append(case)
        say(table(done, args))
        write_json(done, args)
        return 0
    except (BenchError, rqp.RQPError, OSError, sysv_ipc.Error) as exc:
        say(f"rqp-scale: FAILED: {exc}", err=True)
        done = [case for case in done if case.seconds]
        if done:
            say("rqp-scale: the rounds measured before the failure:", err=True)
            say(table(done, args))
            if write_json(done, args):
                say(f"rqp-scale: and written to {args.json}", err=True)
        return 1
    except KeyboardInterrupt as exc:
        signals.quiet_stops()  # (a second Ctrl-C while this is said: not a traceback)
        say(f"rqp-scale: interrupted{f' ({exc})' if str(exc) else ''}; cleaning up", err=True)
        stopped = True
        return 130
    finally:
        signals.quiet_stops()  # let the clean-up finish
        scale.stop_all()
        shutil.rmtree(workdir, ignore_errors=True)
        if stopped:
            say("rqp-scale: stopped; its agents, queues and files are removed", err=True)


if __name__ == "__main__":
    sys.exit(main())
