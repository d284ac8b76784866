"""A raw-socket RQP peer for the receiving MCA's integration tests.

Two halves in one file:

* the *peer process* (``python tests/rqp_peer.py``), started inside a testbed host with
  ``host.popen``: it holds TCP connections and touches the System V queues of THAT host (its
  IPC namespace), obeying JSON commands, one per stdin line, and answering one JSON line each
  on stdout (``{"ok": true, "result": ...}`` or ``{"ok": false, "error": "..."}``);
* :class:`Peer`, the test-side handle that starts one and calls it::

      peer = Peer.start(host)
      peer.connect("c1", receiver_address, 7460)
      peer.send("c1", [ask(0x52510001), msg(0x52510001, b"hi", key=1)])
      assert peer.recv("c1", 4)["data"] == QUEUE_YES + DELIVERED_YES

Frames are packed here with :mod:`struct` straight from the spec's layout (not with
:mod:`rqp.protocol.frames`), so the daemon is checked against the wire format, not against its own
codec. Bytes travel through JSON as hex. Every socket operation has a deadline.
"""

from __future__ import annotations

import json
import os
import queue
import select
import socket
import ssl
import struct
import subprocess
import sys
import threading
import time
import traceback

# --- the wire format (spec section 4) -----------------------------------------------------

(MESSAGE, DELIVERED_YES_CODE, DELIVERED_ERROR_CODE, QUEUE_ASK, QUEUE_YES_CODE,
 QUEUE_NO_CODE) = range(1, 7)
SURE, UNSURE = 0, 1

#: The answers a receiving MCA sends (always data = 0).
DELIVERED_YES = bytes((DELIVERED_YES_CODE, 0))
DELIVERED_ERROR = bytes((DELIVERED_ERROR_CODE, 0))
QUEUE_YES = bytes((QUEUE_YES_CODE, 0))
QUEUE_NO = bytes((QUEUE_NO_CODE, 0))
ANSWER_NAMES = {DELIVERED_YES: "DELIVERED_YES", DELIVERED_ERROR: "DELIVERED_ERROR",
                QUEUE_YES: "QUEUE_YES", QUEUE_NO: "QUEUE_NO"}

_HEADER = struct.Struct(">BBQQQ")  # code, message_type, key, queue_key, message_length
_ASK = struct.Struct(">BBQ")  # code, data, queue_key


def pack_message(message_type: int, key: int, queue_key: int, body: bytes,
                 length: int | None = None) -> bytes:
    """A MESSAGE frame; ``length`` overrides the message_length field (a lying header)."""
    return _HEADER.pack(MESSAGE, message_type, key, queue_key,
                        len(body) if length is None else length) + body


def pack_ask(queue_key: int, data: int = 0) -> bytes:
    return _ASK.pack(QUEUE_ASK, data, queue_key)


def answers(data: bytes) -> list[str]:
    """Two-octet answers by name (unknown pairs shown in hex)."""
    return [ANSWER_NAMES.get(data[i:i + 2], data[i:i + 2].hex()) for i in range(0, len(data), 2)]


# --- frame specs: what the test side sends to the peer process --------------------------------


def ask(queue_key: int, data: int = 0) -> dict:
    return {"ask": queue_key, "data": data}


def msg(queue_key: int, body: bytes = b"", *, key: int = 1, type: int = SURE,
        size: int | None = None, claim: int | None = None) -> dict:
    """A MESSAGE. ``size``: a body of that many b"m" bytes instead of ``body``; ``claim``: the
    message_length written in the header (then only ``body`` follows, e.g. nothing)."""
    return {"msg": {"type": type, "key": key, "queue_key": queue_key, "body": body.hex(),
                    "size": size, "claim": claim}}


def raw(data: bytes) -> dict:
    return {"raw": data.hex()}


def zeros(n: int) -> dict:
    """``n`` zero octets, streamed in 1 MiB writes (a message body after a ``claim`` header)."""
    return {"zeros": n}


# --- the peer process ----------------------------------------------------------------------------


def _frame_bytes(spec: dict) -> bytes:
    if "ask" in spec:
        return pack_ask(spec["ask"], spec.get("data", 0))
    if "raw" in spec:
        return bytes.fromhex(spec["raw"])
    m = spec["msg"]
    body = b"m" * m["size"] if m.get("size") is not None else bytes.fromhex(m["body"])
    return pack_message(m["type"], m["key"], m["queue_key"], body, m.get("claim"))


def _read(sock: socket.socket, n: int | None, timeout: float) -> dict:
    """Read ``n`` octets (None: until EOF) within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    data = bytearray()
    result = {"eof": False, "reset": False, "timeout": False}
    while n is None or len(data) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            result["timeout"] = True
            break
        sock.settimeout(left)
        try:
            chunk = sock.recv(65536 if n is None else n - len(data))
        except socket.timeout:
            result["timeout"] = True
            break
        except ConnectionResetError:
            result["reset"] = True
            break
        except ssl.SSLError as exc:  # e.g. the receiver refused this peer's certificate
            result["tls_error"] = exc.reason or str(exc)
            break
        if not chunk:
            result["eof"] = True
            break
        data += chunk
    result["data"] = bytes(data).hex()
    return result


class PeerProcess:
    def __init__(self) -> None:
        self.conns: dict[str, socket.socket] = {}

    # -- sockets --------------------------------------------------------------------------------

    def op_connect(self, name: str, host: str, port: int, timeout: float = 5.0,
                   tls: dict | None = None) -> dict:
        """``tls``: speak TLS, with ``ca`` (trusted for the receiver's certificate), optional
        ``cert``/``key`` (this peer's; none: no client certificate), ``server_hostname`` and
        ``alpn`` (default ["rqp/1"]; [] offers none)."""
        try:
            sock = socket.create_connection((host, port), timeout=timeout)
        except ConnectionRefusedError:
            return {"connected": False, "error": "refused"}
        except OSError as exc:
            return {"connected": False, "error": f"{type(exc).__name__}: {exc}"}
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if tls is not None:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
            context.load_verify_locations(tls["ca"])
            if tls.get("cert"):
                context.load_cert_chain(tls["cert"], tls["key"])
            if tls.get("alpn", ["rqp/1"]):
                context.set_alpn_protocols(tls.get("alpn", ["rqp/1"]))
            try:
                sock = context.wrap_socket(sock, server_hostname=tls["server_hostname"])
            except (ssl.SSLError, OSError) as exc:
                sock.close()
                return {"connected": False, "error": f"tls: {getattr(exc, 'reason', None) or exc}"}
        old = self.conns.pop(name, None)
        if old is not None:
            old.close()
        self.conns[name] = sock
        return {"connected": True, "local": list(sock.getsockname())}

    def op_send(self, name: str, frames: list[dict], timeout: float = 30.0) -> int:
        """Send the frames; consecutive whole frames go out in ONE write."""
        sock = self.conns[name]
        sock.settimeout(timeout)
        pending = bytearray()
        sent = 0
        for spec in frames:
            if "zeros" in spec:
                if pending:
                    sock.sendall(pending)
                    sent += len(pending)
                    pending.clear()
                left, chunk = spec["zeros"], bytes(1 << 20)
                while left:
                    part = chunk[:min(left, len(chunk))]
                    sock.sendall(part)
                    left -= len(part)
                    sent += len(part)
            else:
                pending += _frame_bytes(spec)
        if pending:
            sock.sendall(pending)
            sent += len(pending)
        return sent

    def op_recv(self, name: str, n: int, timeout: float = 5.0) -> dict:
        return _read(self.conns[name], n, timeout)

    def op_read_to_eof(self, name: str, timeout: float = 5.0) -> dict:
        return _read(self.conns[name], None, timeout)

    def op_shutdown(self, name: str) -> None:
        self.conns[name].shutdown(socket.SHUT_WR)

    def op_hung_up(self, name: str, timeout: float = 5.0) -> bool:
        """Whether the other side ended its stream (its FIN came) within ``timeout``,
        reading nothing: over TLS, what this side sends afterwards still goes (once an
        SSLSocket has read that end it writes no more)."""
        poll = select.poll()
        poll.register(self.conns[name], select.POLLRDHUP)
        return bool(poll.poll(timeout * 1000))

    def op_close(self, name: str) -> None:
        self.conns.pop(name).close()

    def op_blast(self, host: str, port: int, clients: int, per_client: int, queue_key: int,
                 timeout: float = 30.0) -> list[dict]:
        """``clients`` connections at once, each sending ``per_client`` UNSURE messages in one
        write (bodies ``c<client>-<seq>``), then reading every answer."""
        results: list[dict] = [{} for _ in range(clients)]
        start = threading.Barrier(clients)

        def client(c: int) -> None:
            try:
                frames = b"".join(
                    pack_message(UNSURE, (c << 32) | i, queue_key, f"c{c:03d}-{i:05d}".encode())
                    for i in range(per_client))
                sock = socket.create_connection((host, port), timeout=timeout)
                with sock:
                    start.wait(timeout)
                    sock.settimeout(timeout)
                    sock.sendall(frames)
                    got = _read(sock, 2 * per_client, timeout)
                results[c] = {"answers": got["data"], "eof": got["eof"], "timeout": got["timeout"]}
            except Exception as exc:  # reported to the test
                results[c] = {"error": f"{type(exc).__name__}: {exc}"}

        threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout + 5)
        return results

    # -- System V queues of this host -------------------------------------------------------------

    @staticmethod
    def _mq(key: int):
        import sysv_ipc

        return sysv_ipc.MessageQueue(key, 0, mode=0, max_message_size=1 << 20)

    def op_create(self, key: int, mode: int = 0o660, max_size: int | None = None) -> int:
        import sysv_ipc

        mq = sysv_ipc.MessageQueue(key, sysv_ipc.IPC_CREX, mode=mode)
        if max_size is not None:
            mq.max_size = max_size
        return mq.id

    def op_remove(self, key: int) -> None:
        self._mq(key).remove()

    def op_exists(self, key: int) -> bool:
        import sysv_ipc

        try:
            self._mq(key)
        except sysv_ipc.ExistentialError:
            return False
        return True

    def op_stat(self, key: int) -> dict:
        mq = self._mq(key)
        return {"messages": mq.current_messages, "max_size": mq.max_size, "mode": mq.mode & 0o777,
                "uid": mq.uid, "id": mq.id}

    def op_put(self, key: int, data: str, mtype: int = 1) -> None:
        self._mq(key).send(bytes.fromhex(data), block=False, type=mtype)

    def op_fill(self, key: int) -> dict:
        """Fill the queue until not even a 1-byte message fits; count what was put."""
        import sysv_ipc

        mq = self._mq(key)
        with open("/proc/sys/kernel/msgmax") as f:
            size = min(int(f.read()), mq.max_size)
        count = total = 0
        while size >= 1:
            try:
                mq.send(b"F" * size, block=False, type=1)
                count += 1
                total += size
            except sysv_ipc.BusyError:
                size //= 2
        return {"messages": count, "bytes": total}

    def op_drain(self, key: int, limit: int | None = None) -> list[dict]:
        """Take every message (at most ``limit``) off the queue, without blocking."""
        import sysv_ipc

        mq = self._mq(key)
        out = []
        while limit is None or len(out) < limit:
            try:
                data, mtype = mq.receive(block=False)
            except sysv_ipc.BusyError:
                break
            out.append({"mtype": mtype, "data": data.hex()})
        return out

    def op_dead_letters(self, key: int = 0x5251DEAD) -> list[dict]:
        """Drain DEAD.LETTER.Q and decode each record with rqp.protocol.records.DeadLetterRecord."""
        from rqp.protocol.records import DeadLetterRecord

        out = []
        for item in self.op_drain(key):
            rec = DeadLetterRecord.from_bytes(bytes.fromhex(item["data"]))
            out.append({
                "mtype": item["mtype"], "size": len(item["data"]) // 2,
                "reason": int(rec.reason), "message_type": rec.message_type,
                "flags": rec.flags, "agent": int(rec.agent), "queue_key": rec.queue_key,
                "message_key": rec.message_key, "timestamp_ns": rec.timestamp_ns,
                "attempts": rec.attempts, "original_length": rec.original_length,
                "host": rec.host, "source_host": rec.source_host,
                "destination_host": rec.destination_host, "detail": rec.detail,
                "spill_path": rec.spill_path, "payload": rec.payload.hex(),
                "record_mtype": rec.mtype, "priority": rec.priority,
                "expires_at_ms": rec.expires_at_ms,
            })
        return out

    # -- the command loop ----------------------------------------------------------------------

    def serve(self, stdin, stdout) -> None:
        for line in stdin:
            if not line.strip():
                continue
            try:
                command = json.loads(line)
                op = command.pop("op")
                reply = {"ok": True, "result": getattr(self, f"op_{op}")(**command)}
            except Exception as exc:
                reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}\n"
                                               f"{traceback.format_exc()}"}
            stdout.write(json.dumps(reply) + "\n")
            stdout.flush()


# --- the test side -------------------------------------------------------------------------------


class PeerError(AssertionError):
    """A command failed inside the peer process (the message has its traceback)."""


class Peer:
    """Test-side handle of a peer process running on a testbed host."""

    def __init__(self, host, proc: subprocess.Popen) -> None:
        self.host = host
        self.proc = proc
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    @classmethod
    def start(cls, host) -> "Peer":
        proc = host.popen([sys.executable, os.path.abspath(__file__)],
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        return cls(host, proc)

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def call(self, op: str, *, deadline: float = 30.0, **args):
        """Run one command; fail the test if it errors or takes over ``deadline`` seconds."""
        __tracebackhide__ = True
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()
        try:
            line = self._lines.get(timeout=deadline)
        except queue.Empty:
            raise PeerError(f"peer on {self.host.name}: {op} took over {deadline}s") from None
        if line is None:
            raise PeerError(f"peer on {self.host.name} exited during {op}: "
                            f"{self.host.output(self.proc, 'stderr')}")
        reply = json.loads(line)
        if not reply["ok"]:
            raise PeerError(f"peer on {self.host.name}: {op}({args!r}) failed: {reply['error']}")
        return reply["result"]

    # -- conveniences --------------------------------------------------------------------------

    def connect(self, name: str, host: str, port: int, timeout: float = 5.0,
                tls: dict | None = None) -> dict:
        return self.call("connect", name=name, host=host, port=port, timeout=timeout,
                         tls=tls, deadline=timeout + 10)

    def send(self, name: str, frames: list[dict], timeout: float = 30.0) -> int:
        return self.call("send", name=name, frames=frames, timeout=timeout, deadline=timeout + 10)

    def recv(self, name: str, n: int, timeout: float = 5.0) -> dict:
        got = self.call("recv", name=name, n=n, timeout=timeout, deadline=timeout + 10)
        got["data"] = bytes.fromhex(got["data"])
        return got

    def read_to_eof(self, name: str, timeout: float = 5.0) -> dict:
        got = self.call("read_to_eof", name=name, timeout=timeout, deadline=timeout + 10)
        got["data"] = bytes.fromhex(got["data"])
        return got

    def exchange(self, name: str, frames: list[dict], timeout: float = 5.0) -> bytes:
        """Send frames in one write and read one two-octet answer per request frame."""
        n = sum(1 for f in frames if "ask" in f or "msg" in f)
        self.send(name, frames, timeout=timeout)
        got = self.recv(name, 2 * n, timeout=timeout)
        assert len(got["data"]) == 2 * n, (
            f"expected {n} answers on {name}, got {answers(got['data'])} "
            f"(eof={got['eof']}, reset={got['reset']}, timeout={got['timeout']})")
        return got["data"]

    def shutdown(self, name: str) -> None:
        self.call("shutdown", name=name)

    def hung_up(self, name: str, timeout: float = 5.0) -> bool:
        return self.call("hung_up", name=name, timeout=timeout, deadline=timeout + 10)

    def close(self, name: str) -> None:
        self.call("close", name=name)

    def create(self, key: int, mode: int = 0o660, max_size: int | None = None) -> int:
        return self.call("create", key=key, mode=mode, max_size=max_size)

    def remove(self, key: int) -> None:
        self.call("remove", key=key)

    def exists(self, key: int) -> bool:
        return self.call("exists", key=key)

    def stat(self, key: int) -> dict:
        return self.call("stat", key=key)

    def depth(self, key: int) -> int:
        return self.stat(key)["messages"]

    def put(self, key: int, data: bytes, mtype: int = 1) -> None:
        self.call("put", key=key, data=data.hex(), mtype=mtype)

    def fill(self, key: int) -> dict:
        return self.call("fill", key=key)

    def drain(self, key: int, limit: int | None = None) -> list[tuple[int, bytes]]:
        return [(m["mtype"], bytes.fromhex(m["data"]))
                for m in self.call("drain", key=key, limit=limit, deadline=60)]

    def dead_letters(self, key: int = 0x5251DEAD) -> list[dict]:
        records = self.call("dead_letters", key=key)
        for r in records:
            r["payload"] = bytes.fromhex(r["payload"])
        return records

    def blast(self, host: str, port: int, *, clients: int, per_client: int, queue_key: int,
              timeout: float = 30.0) -> list[dict]:
        return self.call("blast", host=host, port=port, clients=clients, per_client=per_client,
                         queue_key=queue_key, timeout=timeout, deadline=timeout + 20)


if __name__ == "__main__":
    # The peer process: make `import rqp` work however we were started.
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    PeerProcess().serve(sys.stdin, sys.stdout)
