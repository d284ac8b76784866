"""The agents' local control socket (``rqpctl status``) and their Prometheus metrics.

Control protocol: a Unix stream socket (mode 0660: the file system decides who may ask); the
client writes one JSON object on one line, ``{"command": "status"}`` or
``{"command": "metrics"}``, and reads one JSON object back; then the connection closes.
The socket is ``$RUNTIME_DIRECTORY/control.sock`` under systemd (``RuntimeDirectory=``), else
``<state_dir>/<agent>.sock``, or the config's ``control_socket``.

Metrics: the Prometheus text exposition format (version 0.0.4, written by ``prometheus_client``
from the agents' :class:`Metric` lists), served on ``GET /metrics`` by
a minimal HTTP endpoint when ``metrics_listen`` is set (off by default; a host given without
address means 127.0.0.1), and always through the control socket (``rqpctl metrics``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Awaitable, Callable

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from rqp.protocol.errors import RQPError

__all__ = ["default_socket", "serve_control", "request", "Metric", "render", "serve_metrics",
           "ControlRefused",
           "ControlError"]

MAX_REQUEST = 64 * 1024


class ControlError(RQPError):
    """The agent could not be asked (not running, no permission, bad answer)."""


class ControlRefused(ControlError):
    """The agent answered, refusing the request (a bad argument): it is running."""


class ControlNotAnswering(ControlError):
    """The agent's socket took the connection, but no answer came: it runs, frozen or hung."""


def default_socket(state_dir: str | os.PathLike, name: str) -> Path:
    runtime = os.environ.get("RUNTIME_DIRECTORY")
    if runtime:
        return Path(runtime.split(":")[0]) / "control.sock"
    return Path(state_dir) / f"{name}.sock"


async def serve_control(path: Path, handler: Callable[[dict], Awaitable[dict]]):
    """Listen on ``path``; ``handler(request)`` answers each request."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists() or path.is_symlink():
        try:  # a socket left by an agent that was killed: nobody answers it any more
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
                probe.settimeout(0.5)
                probe.connect(str(path))
            raise ControlError(f"{path}: another agent answers on this control socket")
        except (ConnectionRefusedError, FileNotFoundError):
            path.unlink(missing_ok=True)

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            line = await asyncio.wait_for(reader.readline(), 5)
            try:
                req = json.loads(line[:MAX_REQUEST] or b"{}")
                if not isinstance(req, dict):
                    raise ValueError("a request is a JSON object")
                answer = await handler(req)
            except (ValueError, KeyError) as exc:
                answer = {"error": f"bad request: {exc}"}
            writer.write(json.dumps(answer, default=str).encode() + b"\n")
            await writer.drain()
        except (asyncio.TimeoutError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_unix_server(serve, str(path))
    os.chmod(path, 0o660)
    return server


#: How :func:`request` begins to say that no agent listens on a control socket.
NOT_RUNNING_HERE = "no agent is running here"


def request(path: str | os.PathLike, command: str, timeout: float = 5.0, **args) -> dict:
    """Ask the agent on ``path``; :class:`ControlError` says why it could not be asked."""
    connected = False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout)
            sock.connect(str(path))
            connected = True
            sock.sendall(json.dumps({"command": command, **args}).encode() + b"\n")
            data = b""
            while chunk := sock.recv(1 << 16):
                data += chunk
    except socket.timeout:
        if connected:  # (not "not running": a second agent must not be started beside it)
            raise ControlNotAnswering(
                f"the agent on {path} took the connection but gave no answer within "
                f"{timeout:g} s: it runs, but is frozen (SIGSTOP?) or hung") from None
        raise ControlError(f"cannot ask the agent on {path}: connecting timed out") from None
    except FileNotFoundError:
        raise ControlError(f"{NOT_RUNNING_HERE} ({path} does not exist)") from None
    except ConnectionRefusedError:
        raise ControlError(f"{NOT_RUNNING_HERE} (nothing answers on {path})") from None
    except PermissionError:
        raise ControlError(f"no permission to ask the agent on {path} (be in its group)") \
            from None
    except (socket.timeout, OSError) as exc:
        raise ControlError(f"cannot ask the agent on {path}: {exc}") from None
    try:
        answer = json.loads(data)
    except ValueError:
        raise ControlError(f"the agent on {path} gave an answer that is not JSON") from None
    if "error" in answer:
        raise ControlRefused(f"the agent on {path}: {answer['error']}")
    return answer


# --- Prometheus text format ------------------------------------------------------------------

@dataclass
class Metric:
    name: str
    kind: str  # "counter" or "gauge"
    help: str
    samples: list = field(default_factory=list)  # (labels: dict, value)

    def add(self, value: float, **labels) -> "Metric":
        self.samples.append((labels, value))
        return self


def render(metrics: list[Metric]) -> str:
    """The Prometheus text exposition of ``metrics``, written by ``prometheus_client`` (a
    registry of one collector that yields them as they are now)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(metrics))
    return generate_latest(registry).decode()


class _Collector:
    def __init__(self, metrics: list[Metric]) -> None:
        self.metrics = metrics

    def collect(self):
        for metric in self.metrics:
            names = sorted({name for labels, _ in metric.samples for name in labels})
            family = (CounterMetricFamily if metric.kind == "counter" else GaugeMetricFamily)(
                metric.name, metric.help, labels=names)
            for labels, value in metric.samples:
                family.add_metric([str(labels.get(name, "")) for name in names], value)
            yield family


async def serve_metrics(host: str, port: int, produce: Callable[[], str]):
    """A minimal HTTP/1.0 endpoint: ``GET /metrics`` answers ``produce()``; anything else 404."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            first = head.split(b"\r\n", 1)[0].split()
            if len(first) >= 2 and first[0] == b"GET" and first[1].split(b"?")[0] == b"/metrics":
                body = produce().encode()
                status, kind = b"200 OK", b"text/plain; version=0.0.4; charset=utf-8"
            else:
                body, status, kind = b"not found: try /metrics\n", b"404 Not Found", b"text/plain"
            writer.write(b"HTTP/1.0 " + status + b"\r\nContent-Type: " + kind
                         + b"\r\nContent-Length: " + str(len(body)).encode()
                         + b"\r\nConnection: close\r\n\r\n" + body)
            await writer.drain()
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError,
                ConnectionError):
            pass
        finally:
            with contextlib.suppress(Exception):
                writer.close()

    return await asyncio.start_server(serve, host, port, reuse_address=True)
