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
import logging
import os
import socket
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Awaitable, Callable

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from rqp.protocol.errors import RQPError
from rqp.system.service import release_free_memory

__all__ = ["default_socket", "serve_control", "request", "Metric", "render", "serve_metrics",
           "Shared", "exposition", "ControlRefused",
           "ControlError"]

log = logging.getLogger("rqp.control")

MAX_REQUEST = 64 * 1024
#: Connections the control socket, and the metrics endpoint, serve at once; more are answered
#: "busy" (control) or 503 (metrics) and closed: a trial's 1,100 idle control connections took
#: the sending MCA's descriptors, and its connections to receivers failed.
MAX_CLIENTS = 64
#: Seconds a request may take to come, and an answer to be taken by its reader: then the
#: connection is dropped with what it holds (a trial's 200 clients that asked for status and
#: read nothing held 1.4 GB of answers in the sending MCA for good).
CLIENT_TIMEOUT = 5.0
#: How the answer to a client beyond MAX_CLIENTS begins (request() tells it from a refusal:
#: the agent runs).
BUSY = "busy:"
#: An answer is written this many bytes at a time, each taken by its reader before the next,
#: so that a transport's buffer never holds a copy of a whole answer (a trial's 64 clients
#: that read nothing held a copy each of an 8.8 MB exposition: 2.2 GB, kept by the C heap
#: after). The answer itself is shared by clients that ask together; one asking apart holds
#: its own until it is written, so at most MAX_CLIENTS answers at once.
ANSWER_CHUNK = 64 * 1024
#: After an answer this big, once no client is left, the memory is given back to the system.
BIG_ANSWER = 1 << 20


#: The longest path a Unix socket may have (sun_path: 108 bytes with its NUL).
SOCKET_PATH_MAX = 107


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


def peer_credentials(sock) -> tuple[int, int]:
    """``(pid, uid)`` of the process at the other end of a Unix socket (``SO_PEERCRED``: of
    a listening one, the process that called ``listen()``)."""
    pid, uid, _gid = struct.unpack("3i", sock.getsockopt(
        socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return pid, uid


def peer_uid(writer: asyncio.StreamWriter) -> int | None:
    """The uid of the process at the other end of a Unix socket (SO_PEERCRED), if known."""
    try:
        return peer_credentials(writer.get_extra_info("socket"))[1]
    except (OSError, AttributeError, struct.error):
        return None


async def serve_control(path: Path, handler: Callable[[dict], Awaitable[dict | bytes]],
                        refused: Callable[[dict, BaseException], None] | None = None,
                        privileged: tuple[str, ...] = ()):
    """Listen on ``path``; ``handler(request)`` answers each request: a dict, or its JSON line
    already made (shared by clients that ask together). ``refused(request, error)`` is told of
    each request the handler could not take (see :func:`_handle`; by default, a DEBUG line).
    The ``privileged`` commands are taken only from root or the agent's own user: the
    socket's group (the applications', rqp) may read (status, metrics, trace), not act (a
    trial: an application user stopped a route)."""
    path = Path(path)
    if len(os.fsencode(path)) > SOCKET_PATH_MAX:  # (a trial: "AF_UNIX path too long", no path)
        raise ControlError(f"control socket {path}: {len(os.fsencode(path))} bytes long, over "
                           f"the {SOCKET_PATH_MAX} a Unix socket's path may have: set "
                           "control_socket to a shorter path (or use a shorter state_dir, "
                           "where it is made by default)")
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists() or path.is_symlink():
        try:  # a socket left by an agent that was killed: nobody answers it any more
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
                probe.settimeout(0.5)
                probe.connect(str(path))
            raise ControlError(f"{path}: another agent answers on this control socket")
        except (ConnectionRefusedError, FileNotFoundError):
            path.unlink(missing_ok=True)

    clients = _Clients()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with clients.one(writer) as admitted:
            if not admitted:
                await clients.answer(writer, json.dumps(
                    {"error": f"{BUSY} {MAX_CLIENTS} control connections are open, try again"}
                ).encode() + b"\n")
                return
            try:
                line = await asyncio.wait_for(reader.readline(), CLIENT_TIMEOUT)
            except ValueError:  # (longer than the reader's limit: a trial's stopped the agent)
                answer: dict = {"error": f"bad request: longer than {MAX_REQUEST} bytes"}
            except (asyncio.TimeoutError, ConnectionError):
                return
            else:
                try:
                    req = json.loads(line or b"{}")
                except (ValueError, RecursionError) as exc:  # (a trial: '[' * 1100 stopped
                    answer = {"error": f"bad request: {exc}"}  # the agent, exit 70)
                else:
                    uid = peer_uid(writer) if isinstance(req, dict) and \
                        req.get("command") in privileged else 0
                    if uid not in (0, os.geteuid()):
                        answer = {"error": f"{req.get('command')}: not allowed for uid "
                                  f"{uid}: only root or the agent's own user may "
                                  f"({', '.join(privileged)}); status, metrics and trace are "
                                  "open to the socket's group"}
                    else:
                        answer = await _handle(handler, req, refused or _refused)
            await clients.answer(writer, answer if isinstance(answer, bytes)
                                 else json.dumps(answer, default=str).encode() + b"\n")

    server = await asyncio.start_unix_server(serve, str(path), limit=MAX_REQUEST)
    os.chmod(path, 0o660)
    return server


async def _handle(handler: Callable[[dict], Awaitable[dict | bytes]], req,
                  refused: Callable[[dict, BaseException], None]) -> dict | bytes:
    """The handler's answer to ``req``; a request it cannot take (a value of the wrong type, a
    trial's ``"action": []``) is answered "bad request", and ``refused`` is told: a local
    client must not stop the agent."""
    if not isinstance(req, dict):
        return {"error": "bad request: a request is a JSON object"}
    try:
        return await handler(req)
    except (ValueError, KeyError, TypeError, RecursionError) as exc:
        refused(req, exc)
        return {"error": f"bad request: {exc}"}


def _refused(req: dict, exc: BaseException) -> None:
    log.debug("control request %.200r refused: %s", req, exc, exc_info=exc)


class _Clients:
    """The connections a local endpoint serves: at most MAX_CLIENTS at once, each answer
    written within CLIENT_TIMEOUT or dropped, every connection closed at its end."""

    def __init__(self) -> None:
        self.open = 0
        self.big_done = False  # (a big answer was written since the memory was last trimmed)

    @contextlib.contextmanager
    def one(self, writer: asyncio.StreamWriter):
        admitted = self.open < MAX_CLIENTS
        self.open += admitted
        try:
            yield admitted
        finally:
            self.open -= admitted
            with contextlib.suppress(Exception):
                writer.close()
            self.after()

    async def answer(self, writer: asyncio.StreamWriter, *parts: bytes) -> None:
        """Write ``parts`` ANSWER_CHUNK at a time, each taken within CLIENT_TIMEOUT, else drop
        the connection; after a big answer, with no client left, give the memory back."""
        try:
            for data in parts:
                view = memoryview(data)
                for at in range(0, len(view), ANSWER_CHUNK):
                    writer.write(view[at:at + ANSWER_CHUNK])
                    await asyncio.wait_for(writer.drain(), CLIENT_TIMEOUT)
        except asyncio.TimeoutError:  # (a reader that takes nothing: its answer is let go)
            writer.transport.abort()
        except ConnectionError:
            pass
        finally:
            self.big_done = self.big_done or sum(map(len, parts)) >= BIG_ANSWER

    def after(self) -> None:
        """Once no client is left after a big answer: its copies' memory back to the system."""
        if self.big_done and self.open == 0:
            self.big_done = False
            release_free_memory()


#: How :func:`request` begins to say that no agent listens on a control socket.
NOT_RUNNING_HERE = "no agent is running here"


def request(path: str | os.PathLike, command: str, timeout: float = 5.0,
            peer_uids: frozenset[int] | None = None, **args) -> dict:
    """Ask the agent on ``path``; :class:`ControlError` says why it could not be asked.
    ``peer_uids``: the users the process that listens may run as (``SO_PEERCRED`` of the
    connection, not the owner of a path another user could swap: a re-check's). It is the
    user of the process that called ``listen()``: a root process that listens and hands the
    connections to another user's is trusted as root."""
    connected = False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout)
            sock.connect(str(path))
            connected = True
            pid, uid = peer_credentials(sock)
            if peer_uids is not None and uid not in peer_uids:
                raise ControlError(f"the process on {path} (pid {pid}) runs as uid {uid}, not "
                                   "as an agent's user: not asked")
            try:
                sock.sendall(json.dumps({"command": command, **args}).encode() + b"\n")
            except (BrokenPipeError, ConnectionResetError):
                pass  # (closed at once: a busy agent's answer came before the request went)
            data = b""
            try:
                while chunk := sock.recv(1 << 16):
                    data += chunk
            except ConnectionResetError:
                pass
            if not data:  # (it runs: it took the connection, and closed it unanswered)
                raise ControlNotAnswering(f"the agent on {path} closed the connection without "
                                          "an answer: it runs, but is busy or stopping")
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
    except BlockingIOError:  # (EAGAIN: the socket's backlog is full; a trial was told "not
        raise ControlNotAnswering(  # running" of a frozen agent, and might start another)
            f"the agent on {path} takes no more connections (its socket's backlog is full): "
            "it runs, but is frozen (SIGSTOP?), hung or flooded") from None
    except (socket.timeout, OSError) as exc:
        raise ControlError(f"cannot ask the agent on {path}: {exc}") from None
    try:
        answer = json.loads(data)
    except ValueError:
        raise ControlError(f"the agent on {path} gave an answer that is not JSON") from None
    if "error" in answer:
        if str(answer["error"]).startswith(BUSY):
            raise ControlNotAnswering(f"the agent on {path} is {answer['error']}")
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


class Shared:
    """An answer made once for what asks together: what asks while it is made shares it, and so
    does what asks within as long as it took to make; later, a new one (so it is never older
    than that). A trial's burst of 100 scrapes, with 5,000 queues, each took a second of the
    sending MCA's event loop and nothing was delivered for minutes; 64 status clients at once
    held delivery up 2 s at the median."""

    def __init__(self, make: Callable[[], Awaitable[bytes] | bytes], clock=time.monotonic) -> None:
        self._make_one, self._clock = make, clock
        self._made: tuple[float, bytes] | None = None  # (when it was made, what)
        self._took = 0.0
        self._making: asyncio.Task | None = None

    async def __call__(self) -> bytes:
        if self._making is None:
            now = self._clock()
            if self._made is not None and now - self._made[0] <= self._took:
                return self._made[1]
            self._making = asyncio.ensure_future(self._make(now))
        return await asyncio.shield(self._making)

    async def _make(self, started: float) -> bytes:
        try:
            made = self._make_one()
            if not isinstance(made, bytes):
                made = await made
            done = self._clock()
            self._made, self._took = (done, made), done - started
            return made
        finally:
            self._making = None


def exposition(collect: Callable[[], list[Metric]]) -> Callable[[], Awaitable[bytes]]:
    """What makes the metrics exposition: ``collect()`` (the figures, taken on the event loop)
    rendered in a thread, which took most of the time (0.5 s for 90,000 samples, a sending MCA
    with 4,096 busy queues)."""
    async def make() -> bytes:
        return (await asyncio.to_thread(render, collect())).encode()
    return make


async def _http_head(reader: asyncio.StreamReader) -> list[bytes] | None:
    """The lines of an HTTP request head up to its empty line, each ending in CRLF or a bare
    LF (a re-check's bare-LF head was answered only at the time-out); None when it is over
    MAX_REQUEST bytes."""
    lines, size = [], 0
    while True:
        try:
            line = await reader.readuntil(b"\n")
        except asyncio.LimitOverrunError:
            return None
        size += len(line)
        if size > MAX_REQUEST:
            return None
        if line in (b"\r\n", b"\n"):
            if not lines:  # (empty lines before the request line are passed over: RFC 9112)
                continue
            return lines
        lines.append(line.rstrip(b"\r\n"))


async def serve_metrics(host: str, port: int, produce: Callable[[], Awaitable[bytes]]):
    """A minimal HTTP/1.0 endpoint: ``GET /metrics`` answers ``await produce()`` (``HEAD``:
    without the body); else 404; 400 for a request head over 64 KiB; 503 while MAX_CLIENTS
    connections are open."""
    clients = _Clients()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        method = b""
        with clients.one(writer) as admitted:
            if not admitted:
                body, status, kind = (f"{BUSY} {MAX_CLIENTS} connections are open\n".encode(),
                                      b"503 Service Unavailable", b"text/plain")
            else:
                try:
                    head = await asyncio.wait_for(_http_head(reader), CLIENT_TIMEOUT)
                except (asyncio.TimeoutError, asyncio.IncompleteReadError, ConnectionError):
                    return
                first = head[0].split() if head else []
                method = first[0] if first else b""
                if head is None:
                    body, status, kind = (b"request head too long\n", b"400 Bad Request",
                                          b"text/plain")
                elif len(first) >= 2 and method in (b"GET", b"HEAD") and \
                        first[1].split(b"?")[0] == b"/metrics":
                    body = await produce()
                    status, kind = b"200 OK", b"text/plain; version=0.0.4; charset=utf-8"
                else:
                    body, status, kind = (b"not found: try /metrics\n", b"404 Not Found",
                                          b"text/plain")
            length = len(body)
            if method == b"HEAD":  # (its length, not its body)
                body = b""
            await clients.answer(writer, b"HTTP/1.0 " + status + b"\r\nContent-Type: " + kind
                                 + b"\r\nContent-Length: " + str(length).encode()
                                 + b"\r\nConnection: close\r\n\r\n", body)

    return await asyncio.start_server(serve, host, port, reuse_address=True)
