"""rqp-demo: the whole path on one machine, in about a minute (most of it Spark's start).

Starts a receiving MCA on loopback, sends SURE and UNSURE messages through ``openConnection``
(which starts the sending MCA), shows them arriving in the destination System V queue,
provokes dead letters and shows their reasons, drains them into an archive and runs the
PySpark report on it (``--report-dir``, default ``./rqp-demo-report``), then stops both agents
and removes its queues.
Run as root it works in a private IPC namespace (``unshare --ipc``), so it touches none of the
host's queues; otherwise it uses queue keys that no queue has yet, and removes them.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import rqp
from rqp.cli import add_version
from rqp.protocol.records import DeadLetterRecord
from rqp.system import signals
from rqp.system.queues import LocalQueue, format_key
from rqp.system.service import serving_pid
from rqp.tools import tls as tls_tool

NAME = "DEMO_THE_ORDERS_COMMON"


def say(text: str = "") -> None:
    print(text, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(what: str, predicate, timeout: float = 15.0):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise SystemExit(f"rqp-demo: gave up waiting for {what} after {timeout:g}s")
        time.sleep(0.02)


def unused_key() -> int:
    while True:
        key = 0x52000000 | secrets.randbits(24)
        if not LocalQueue.exists(key):
            return key


def port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def stop(proc: subprocess.Popen | None, pid: int | None = None) -> None:
    if proc is not None and proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    elif pid:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            if _gone(pid):
                return
            time.sleep(0.02)
        os.kill(pid, signal.SIGKILL)


def _gone(pid: int) -> bool:
    """Whether ``pid`` has ended: reaped here if it is our child (openConnection started the
    sending MCA as one; an unreaped child still answers kill(pid, 0), for 15 s of waiting)."""
    try:
        if os.waitpid(pid, os.WNOHANG)[0] == pid:
            return True
    except ChildProcessError:
        pass  # not our child
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def run(workdir: Path, report_dir: Path) -> int:
    dest, xmit, dlq = unused_key(), unused_key(), unused_key()
    port = free_port()
    (workdir / "state").mkdir()
    receiver_tls, sender_tls = (f"tls: {json.dumps(block)}\n" for block in
                                tls_tool.agent_pair(workdir / "tls", "127.0.0.1", "demo-sender",
                                                    ca_name="RQP demo CA"))
    receiver_yaml = workdir / "receiver.yaml"
    receiver_yaml.write_text(
        f"listen: 127.0.0.1:{port}\ndead_letter_queue: {dlq:#x}\nstate_dir: state\n"
        "put_retry_count: 2\nput_retry_interval: 0.2\nmax_message_size: 1000\n"
        f"host_name: demo-receiver\noffer:\n  allow: [{dest:#x}]\n{receiver_tls}"
        f"peers:\n  - identity: demo-sender\n    queues: [{dest:#x}]\n")
    rqprc = workdir / ".rqprc"
    rqprc.write_text(
        f"hosts: [127.0.0.1:{port}]\ntransmission_queue: {xmit:#x}\n"
        f"dead_letter_queue: {dlq:#x}\nstate_dir: state\nask_timeout: 1s\n"
        f"confirm_timeout: 3s\nqueues:\n  {NAME}: {dest:#x}\n{sender_tls}")
    say(f"== RQP demo in {workdir}")
    say("0. made a CA and two certificates with rqpctl tls (init-ca; issue 127.0.0.1, issue "
        "demo-sender): the agents talk mutual TLS, and the receiver lets identity "
        f"demo-sender put into {NAME} only")
    say(f"   destination queue {NAME} = {format_key(dest)}, transmission queue "
        f"{format_key(xmit)}, DEAD.LETTER.Q {format_key(dlq)}")
    queues = [LocalQueue.create(dest, mode=0o600)]
    receiver = sender_pid = None
    try:
        receiver = subprocess.Popen(
            [sys.executable, "-m", "rqp_agents.receiver", "--config", str(receiver_yaml)],
            stderr=open(workdir / "receiver.log", "wb"), start_new_session=True)
        wait_until("the receiving MCA to listen", lambda: port_open(port))
        say(f"1. receiving MCA listening on 127.0.0.1:{port}, TLS (pid {receiver.pid})")

        # (start_sender=True: its own, in its own state_dir, even on a host that runs
        # rqp-sender.service, whose agents the demo does not touch)
        handle = rqp.openConnection(NAME, rqprc=rqprc, start_sender=True)
        sender_pid = serving_pid(xmit)
        say(f"2. openConnection({NAME!r}) -> handle {handle}; it started the sending MCA "
            f"(pid {sender_pid})")
        queues += [LocalQueue.open(xmit), LocalQueue.open(dlq)]

        sent = [(rqp.SURE_MSG, b"order 1001: 3 x widget"), (rqp.UNSURE_MSG, b"tick 17:00:00"),
                (rqp.SURE_MSG, b"order 1002: 1 x gadget")]
        for msg_type, data in sent:
            rqp.sendMessage(handle, data, msg_type)
            kind = "SURE" if msg_type == rqp.SURE_MSG else "UNSURE"
            say(f"3. sendMessage({kind:6}) {data.decode()!r}")
        for _ in sent:
            data = rqp.receiveMessage(dest, timeout=15)
            say(f"4. arrived in {NAME}: {data.decode()!r}")
        rqp.closeConnection(handle)

        nowhere = unused_key()
        handle = rqp.openConnection(nowhere, rqprc=rqprc)
        rqp.sendMessage(handle, b"for a queue no host has", rqp.UNSURE_MSG)
        rqp.closeConnection(handle)
        say(f"5. sent an UNSURE message to {format_key(nowhere)}, which no host offers")
        handle = rqp.openConnection(NAME, rqprc=rqprc)
        rqp.sendMessage(handle, b"x" * 2000, rqp.UNSURE_MSG)
        rqp.closeConnection(handle)
        say(f"5. sent an UNSURE message of 2000 bytes to {NAME}, over the receiver's 1000-byte "
            "max_message_size")
        dead = LocalQueue.open(dlq)  # the two agents share this host's DEAD.LETTER.Q
        wait_until("two dead letters", lambda: dead.depth >= 2)
        for i in range(2):
            record = DeadLetterRecord.from_bytes(dead.peek(i)[0])  # a look; the drain takes
            say(f"6. DEAD.LETTER.Q: reason {record.reason.name} ({record.description}); "
                f"queue {format_key(record.queue_key)}; by the {record.agent.name.lower()}; "
                f"detail: {record.detail}")
        archive = workdir / "archive"
        drained = subprocess.run(
            [sys.executable, "-m", "rqp_agents.drain", "--once", "--archive", str(archive),
             "--queue", f"{dlq:#x}", "--rqprc", str(rqprc)], capture_output=True, text=True)
        if drained.returncode:
            raise rqp.RQPError(f"rqp-dlq-drain failed: {drained.stderr.strip()}")
        say(f"7. rqp-dlq-drain: {drained.stdout.strip()}")
        say(f"8. rqp-dlq-report (PySpark, local mode) into {report_dir}:")
        from rqp.report import job
        if job.main(["--input", str(archive), "--output", str(report_dir)]) != 0:
            raise rqp.RQPError("rqp-dlq-report failed")
        say(f"   open {report_dir / 'report.html'} in a browser")
        say("== done: every message arrived; the undeliverable ones were dead-lettered with "
            "their reasons, archived and reported")
        return 0
    finally:
        signals.quiet_stops()  # (the clean-up runs to its end)
        stop(None, sender_pid or serving_pid(xmit))
        stop(receiver)
        for queue in queues:
            try:
                queue.remove()
            except rqp.QueueError:
                pass
        say("   agents stopped, queues removed")


def _interrupted(why: str) -> int:
    print(f"rqp-demo: interrupted ({why}); its agents are stopped, its queues and files "
          "removed", file=sys.stderr)
    return 130


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="rqp-demo", description=__doc__.split("\n\n")[0],
                                     epilog=__doc__.split("\n\n", 1)[1])
    add_version(parser)
    parser.add_argument("--report-dir", metavar="DIR", default="rqp-demo-report",
                        help="where the dead-letter report goes (default: ./rqp-demo-report)")
    args = parser.parse_args(argv)  # (--help ends here, before anything is started)
    if os.geteuid() == 0 and not os.environ.get("RQP_DEMO_ISOLATED") and shutil.which("unshare"):
        # (becomes the demo in its own IPC namespace, same process: a stop signal reaches it)
        env = dict(os.environ, RQP_DEMO_ISOLATED="1")
        sys.stdout.flush()
        os.execvpe("unshare", ["unshare", "--ipc", "--", sys.executable, "-m", "rqp.tools.demo",
                               *argv], env)
    try:
        signals.take_stops()  # Ctrl-C, SIGTERM, SIGHUP: stop the agents, remove what it made
    except KeyboardInterrupt as exc:  # (held by its starter: it came before we began)
        print(f"rqp-demo: stopped ({exc}) before it began; nothing was made", file=sys.stderr)
        return 130
    report_dir = Path(args.report_dir).resolve()
    workdir = Path(tempfile.mkdtemp(prefix="rqp-demo-"))
    try:
        return run(workdir, report_dir)
    except KeyboardInterrupt as exc:
        return _interrupted(str(exc) or "Ctrl-C")
    except Exception as exc:  # noqa: BLE001
        if signals.stopped:  # (what the stop ended first: PySpark's JVM, in our process group)
            return _interrupted(f"signal {signal.Signals(signals.stopped[0]).name}")
        if not isinstance(exc, rqp.RQPError):
            raise
        print(f"rqp-demo: {exc}", file=sys.stderr)
        for log in ("receiver.log", "state/sender-*.log"):
            for path in workdir.glob(log):
                print(f"--- {path.name}\n{path.read_text(errors='replace')}", file=sys.stderr)
        return 1
    finally:
        if "pyspark" in sys.modules:  # (the report's JVM, which may still write in workdir)
            from rqp.report import compute
            compute.end_jvm()
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
