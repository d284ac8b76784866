"""RabbitMQ beside RQP in ``rqp-bench --against rabbitmq`` (issue 14): a broker of the bench's
own, and the same workloads through it.

The broker is Debian's ``rabbitmq-server`` started from ``/usr/lib/rabbitmq/bin`` as this user,
with everything under the bench's working directory (data, logs, config, Erlang cookie, pid
file), listening on loopback only (AMQP, Erlang distribution and epmd on ports of its own);
nothing of the system's RabbitMQ (``/etc/rabbitmq``, ``/var/lib/rabbitmq``, the systemd unit) is
used or touched. The clients are ``rabbit_load.py`` run by a Python that has ``pika``
(``scripts/bench --against rabbitmq`` installs both; ``$RQP_RABBIT_PYTHON`` names it).

SURE is compared with persistent messages to a durable queue with publisher confirms and at
most ``window`` unconfirmed; UNSURE with transient messages, no confirms. The consumer takes
with auto-ack, as the RQP consumer takes with ``msgrcv``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

from rqp.protocol.errors import RQPError

__all__ = ["Broker", "RabbitError", "SERVER", "rabbit_python"]

SERVER = Path("/usr/lib/rabbitmq/bin/rabbitmq-server")
LOAD = Path(__file__).with_name("rabbit_load.py")
START_TIMEOUT = 90.0
#: Publisher confirms outstanding at most (the issue's comparison).
CONFIRM_WINDOW = 256


class RabbitError(RQPError):
    """The RabbitMQ side of the benchmark cannot run."""


def rabbit_python(root: Path) -> str:
    """The Python with ``pika``: ``$RQP_RABBIT_PYTHON``, else ``out/rabbitmq-venv``."""
    python = os.environ.get("RQP_RABBIT_PYTHON") or str(root / "out" / "rabbitmq-venv" / "bin"
                                                          / "python")
    if not Path(python).exists():
        raise RabbitError(f"no Python with pika at {python}: run scripts/bench --against "
                          "rabbitmq, which installs rabbitmq-server and pika")
    return python


class Broker:
    """A RabbitMQ node of the benchmark's own (see the module doc)."""

    def __init__(self, workdir: Path, ports: tuple[int, int, int], python: str,
                 preexec=None) -> None:
        if not SERVER.exists():
            raise RabbitError(f"{SERVER} is missing: run scripts/bench --against rabbitmq "
                              "(it installs Debian's rabbitmq-server)")
        self.dir = workdir / "rabbitmq"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port, dist, self.epmd_port = ports
        self.python = python
        self.node = f"rqpbench{os.getpid()}@localhost"
        (self.dir / "rabbitmq.conf").write_text(
            f"listeners.tcp.default = 127.0.0.1:{self.port}\nloopback_users.guest = true\n")
        (self.dir / "enabled_plugins").write_text("[].\n")
        self.env = {
            "PATH": "/usr/bin:/bin:/usr/sbin:/sbin", "HOME": str(self.dir),
            "RABBITMQ_NODENAME": self.node, "RABBITMQ_NODE_IP_ADDRESS": "127.0.0.1",
            "RABBITMQ_NODE_PORT": str(self.port), "RABBITMQ_DIST_PORT": str(dist),
            "ERL_EPMD_PORT": str(self.epmd_port), "ERL_EPMD_ADDRESS": "127.0.0.1",
            "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS":
                "-kernel inet_dist_use_interface {127,0,0,1}",
            "RABBITMQ_MNESIA_BASE": str(self.dir / "mnesia"),
            "RABBITMQ_LOG_BASE": str(self.dir / "log"),
            "RABBITMQ_CONFIG_FILE": str(self.dir / "rabbitmq"),
            "RABBITMQ_ADVANCED_CONFIG_FILE": str(self.dir / "advanced.config"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(self.dir / "enabled_plugins"),
            "RABBITMQ_CONF_ENV_FILE": str(self.dir / "rabbitmq-env.conf"),
            "RABBITMQ_PID_FILE": str(self.dir / "beam.pid"),
        }
        self.log = self.dir / "server.log"
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen([str(SERVER)], env=self.env, cwd=self.dir,
                                         stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                         start_new_session=True, preexec_fn=preexec)
        self.pid = self.proc.pid  # (the node's own, once wait_started has read it)

    def wait_started(self) -> None:
        """Until the node listens (RabbitError if it exits or START_TIMEOUT passes)."""
        self.pid = self._listening()

    def _listening(self) -> int:
        import socket

        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RabbitError(f"rabbitmq-server exited with status {self.proc.returncode}; "
                                  f"its log {self.log} ends:\n{self._tail()}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    pid_file = self.dir / "beam.pid"
                    return int(pid_file.read_text().split()[0]) if pid_file.exists() \
                        else self.proc.pid
            except OSError:
                time.sleep(0.2)
        raise RabbitError(f"rabbitmq-server did not listen on 127.0.0.1:{self.port} within "
                          f"{START_TIMEOUT:g}s; its log {self.log} ends:\n{self._tail()}")

    def _tail(self) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-15:])
        except OSError:
            return "(unreadable)"

    def run(self, durable: bool, tag: int, count: int, size: int) -> dict:
        """One round: a consumer, then a producer; seconds from the producer's first publish to
        the consumer's last message, and the CPU ns of producer and consumer loops."""
        queue = f"rqpbench.{'durable' if durable else 'transient'}"
        consumer = subprocess.Popen(
            [self.python, str(LOAD), "consume", str(self.port), queue,
             "durable" if durable else "transient", str(tag), str(count)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            ready = consumer.stdout.readline()
            if "ready" not in ready:
                raise RabbitError(f"rabbitmq consumer: {ready}{consumer.stderr.read()}")
            produced = subprocess.run(
                [self.python, str(LOAD), "produce", str(self.port), queue,
                 "confirm" if durable else "transient", str(tag), str(count), str(size),
                 str(CONFIRM_WINDOW)], capture_output=True, text=True, timeout=600)
            if produced.returncode != 0:
                raise RabbitError(f"rabbitmq producer: {produced.stderr.strip()[-2000:]}")
            out, err = consumer.communicate(timeout=600)
            if consumer.returncode != 0:
                raise RabbitError(f"rabbitmq consumer: {err.strip()[-2000:]}")
        finally:
            if consumer.poll() is None:
                consumer.kill()
                consumer.wait()
        p = json.loads(produced.stdout.strip().splitlines()[-1])
        c = json.loads(out.strip().splitlines()[-1])
        return {"seconds": (c["last_ns"] - p["start_ns"]) / 1e9, "producer_ns": p["cpu_ns"],
                "consumer_ns": c["cpu_ns"]}

    def stop(self) -> None:
        """Stop the node (and the epmd it started on its own port)."""
        if self.proc.poll() is None:
            try:
                os.kill(self.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        subprocess.run(["epmd", "-kill"], env={**self.env}, capture_output=True, timeout=10)
