"""The agents' control socket and metrics endpoint under abuse (a monitoring trial): a request
too long, clients that never read their answers or hold connections open, a burst of scrapes.
The agent keeps serving, and gives back what such clients took."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
from pathlib import Path

import pytest

from rqp.system import control
from tests.agents import start_receiver
from tests.testbed import wait_for

RQPCTL = [sys.executable, "-m", "rqp.tools.ctl"]


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_an_answer_nobody_reads_is_let_go(tmp_path):
    """A trial: 200 clients asked for status (3.5 MB each, 4,096 queues) and read nothing; the
    sending MCA held 1.4 GB of answers for good. Real server, real socket, in this process."""
    path = tmp_path / "c.sock"
    big = {"text": "x" * (8 << 20)}  # (far beyond what the kernel buffers for a reader)

    async def main() -> None:
        async def handler(request: dict) -> dict:
            return big

        server = await control.serve_control(path, handler)
        try:
            before = _fds()
            client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            client.setblocking(False)
            await asyncio.get_running_loop().sock_connect(client, str(path))
            client.send(b'{"command": "status"}\n')
            # the server's end is open (writing), then closed once the answer has waited
            # CLIENT_TIMEOUT, though the client holds its end and never reads
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 10
            while _fds() < before + 2 and loop.time() < deadline:  # (accepted: the
                await asyncio.sleep(0.05)  # server's end too)
            assert _fds() == before + 2, "the server did not take the connection"
            deadline = loop.time() + control.CLIENT_TIMEOUT + 10
            while _fds() > before + 1 and loop.time() < deadline:
                await asyncio.sleep(0.05)
            assert _fds() == before + 1, "the server still holds the connection"
            got = b""
            try:
                while chunk := client.recv(1 << 20):
                    got += chunk
            except (BlockingIOError, ConnectionResetError):
                pass
            assert len(got) < len(json.dumps(big))  # dropped, not kept for the reader
            client.close()
        finally:
            server.close()

    asyncio.run(main())


def test_scrapes_that_come_together_share_one_made_off_the_loop(monkeypatch):
    """A trial's burst of 100 scrapes (5,000 queues) each took a second of the sending MCA's
    loop. Scrapes that ask while one is made share it; one that comes within as long as it
    took gets it too; a later one, new figures. The rendering runs in another thread."""
    import threading

    collected, rendered_in = [], []
    ticks = iter([0.0, 2.0,   # made from 0 to 2 (took 2 s)
                  3.0,        # asked at 3: within what it took, the same
                  5.0, 5.0, 5.5])  # asked at 5: made again (taking 0.5 s)

    def collect():
        collected.append(1)
        return [control.Metric("rqp_x", "gauge", "a figure").add(len(collected))]

    real_render = control.render

    def render(metrics):
        rendered_in.append(threading.current_thread() is threading.main_thread())
        return real_render(metrics)

    async def main():
        metrics = control.Shared(control.exposition(collect), clock=lambda: next(ticks))
        together = await asyncio.gather(*(metrics() for _ in range(5)))  # one made, shared
        later = [await metrics(), await metrics()]
        return together, later

    monkeypatch.setattr(control, "render", render)  # (the real one, watched)
    together, later = asyncio.run(main())
    assert [t.splitlines()[-1] for t in together] == [b"rqp_x 1.0"] * 5
    assert [t.splitlines()[-1] for t in later] == [b"rqp_x 1.0", b"rqp_x 2.0"]
    assert len(collected) == 2 and rendered_in == [False, False]


def test_a_request_the_handler_cannot_take_is_refused_and_the_server_serves_on(tmp_path):
    """A re-check: '[' * 1100 (RecursionError in json) and a route action that is a list
    (TypeError in the agent's handler) each stopped the agent with exit 70."""
    path = tmp_path / "c.sock"

    async def handler(request: dict) -> dict:
        return {"ok": {"a": 1}[request["command"]] if request.get("command") != "bad"
                else {}[[]]}  # (a TypeError, as an unhashable action was)

    async def main() -> list:
        server = await control.serve_control(path, handler)
        try:
            answers = []
            for line in (b"[" * 1100 + b"\n", b'{"command": "bad"}\n', b'[1]\n',
                         b'{"command": "a"}\n'):
                reader, writer = await asyncio.open_unix_connection(str(path))
                writer.write(line)
                answers.append(json.loads(await reader.readline()))
                writer.close()
            return answers
        finally:
            server.close()

    got = asyncio.run(main())
    assert [a.get("error", "").split(":")[0] for a in got[:3]] == ["bad request"] * 3, got
    assert "recursion" in got[0]["error"] and got[3] == {"ok": 1}


def test_a_busy_agent_is_never_taken_for_one_not_running(tmp_path, monkeypatch):
    """A re-check: a busy answer written and the connection closed before the client's request
    went made it 'not running: Broken pipe' 8 times in 20. Every time: not answering."""
    path = tmp_path / "c.sock"
    monkeypatch.setattr(control, "MAX_CLIENTS", 0)  # every connection is one too many

    async def handler(request: dict) -> dict:
        return {}

    async def main() -> list:
        server = await control.serve_control(path, handler)
        try:
            return await asyncio.gather(*(asyncio.to_thread(_ask, path) for _ in range(40)))
        finally:
            server.close()

    assert set(asyncio.run(main())) == {"ControlNotAnswering"}


def _ask(path) -> str:
    try:
        control.request(path, "status", command_padding="x" * 300_000)
    except control.ControlError as exc:
        return type(exc).__name__
    return "answered"


@pytest.fixture
def receiver(testbed):
    b = testbed.add_host("b")
    sock = b.workdir / "receiver.sock"
    rx = start_receiver(b, config=f"control_socket: {sock}\nmetrics_listen: '127.0.0.1:9747'\n")
    return b, rx, sock


def _status(b, sock: Path):
    return b.run([*RQPCTL, "status", "--agent", "receiver", "--socket", str(sock)],
                 check=False, timeout=60)


HOSTILE = r"""
import socket, sys
path, how = sys.argv[1], sys.argv[2]
def connect():
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)
    return s
if how == "long":
    s = connect()
    s.sendall(b"x" * 70000)
    s.shutdown(socket.SHUT_WR)
    print(s.makefile("rb").read().decode(), end="", flush=True)
elif how == "crowd":  # more than MAX_CLIENTS connections that send nothing
    held = [connect() for _ in range(int(sys.argv[3]))]
    answers = []
    for s in held[-5:]:  # the last ones: answered "busy" at once
        s.settimeout(3)
        answers.append(s.makefile("rb").readline().decode().strip())
    print("\n".join(answers), flush=True)
    sys.stdin.readline()
"""


def test_a_request_too_long_is_refused_and_the_agent_runs_on(receiver):
    """A trial: 70,000 bytes without a newline stopped either agent with exit status 70 (an
    uncaught ValueError of readline). Anyone who may read the status could do it."""
    b, rx, sock = receiver
    out = b.run([sys.executable, "-c", HOSTILE, str(sock), "long"], timeout=60)
    assert json.loads(out.stdout) == {"error": "bad request: longer than 65536 bytes"}
    assert rx.poll() is None
    assert _status(b, sock).returncode == 0


SCRAPE = r"""
import json, socket, sys
s = socket.create_connection(("127.0.0.1", 9747))
end = b"\n\n" if sys.argv[3:] == ["lf"] else b"\r\n\r\n"
s.sendall(sys.argv[1].encode() * int(sys.argv[2]) + end)
if sys.argv[3:] != ["lf"]:
    s.shutdown(socket.SHUT_WR)  # (a bare-LF client keeps its side open: it waits)
s.settimeout(3)  # (well within the server's own 5 s: an answer at its time-out fails)
head, _, body = s.makefile("rb").read().partition(b"\r\n\r\n")
lines = head.decode().split("\r\n")
length = [int(l.split(":")[1]) for l in lines if l.lower().startswith("content-length:")]
print(json.dumps([lines[0], length, len(body)]))
"""


def test_the_metrics_endpoint_answers_a_head_too_long_and_a_good_scrape(receiver):
    """A re-check: a request head over 64 KiB got no answer at all; a head ending in bare
    LFs was answered only at the time-out; HEAD /metrics was 404."""
    b, rx, sock = receiver

    def scrape(*args):
        return json.loads(b.run([sys.executable, "-c", SCRAPE, *args]).stdout)
    assert scrape("x", "70000")[0] == "HTTP/1.0 400 Bad Request"
    status, [length], size = scrape("GET /metrics HTTP/1.0", "1")
    assert status == "HTTP/1.0 200 OK" and length == size > 0
    status, [length], size = scrape("GET /metrics HTTP/1.0", "1", "lf")
    assert status == "HTTP/1.0 200 OK" and length == size > 0
    status, [length], size = scrape("\r\nGET /metrics HTTP/1.0", "1")  # (a leading CRLF)
    assert status == "HTTP/1.0 200 OK" and length == size > 0
    status, [length], size = scrape("HEAD /metrics HTTP/1.0", "1")
    assert status == "HTTP/1.0 200 OK" and length > 0 and size == 0
    assert rx.poll() is None


def test_a_crowd_on_the_control_socket_is_told_busy_and_status_says_it_runs(receiver):
    """A trial: 1,100 idle control connections took the sending MCA's descriptors (its
    connections to receivers failed: Too many open files). At most MAX_CLIENTS are served; the
    rest are answered busy at once, and rqpctl status says the agent runs (exit 3, not
    answering), never that it is not running."""
    b, rx, sock = receiver
    fds = lambda: len(os.listdir(f"/proc/{rx.pid}/fd"))  # noqa: E731
    before = fds()
    crowd = b.popen([sys.executable, "-c", HOSTILE, str(sock), "crowd",
                     str(control.MAX_CLIENTS + 40)], stdin=__import__("subprocess").PIPE)
    try:
        said = wait_for(lambda: len(lines := b.output(crowd, "stdout").splitlines()) == 5
                        and lines, timeout=30, message="the crowd was not answered")
        assert [json.loads(line) for line in said] == [
            {"error": f"busy: {control.MAX_CLIENTS} control connections are open, try again"}
        ] * 5
        assert fds() <= before + control.MAX_CLIENTS + 5  # (the busy ones are closed)
        out = _status(b, sock)
        assert out.returncode == 3, out.stdout + out.stderr
        assert "is busy: 64 control connections are open" in out.stdout + out.stderr
        assert "not running" not in out.stdout + out.stderr
        # and rqpctl queues cannot say what is offered: it says why, exit 3 (a re-check:
        # "no receiving MCA answers", exit 0)
        out = b.run([sys.executable, "-m", "rqp.tools.ctl", "queues", "--socket", str(sock)],
                    check=False, timeout=60)
        assert out.returncode == 3 and "unknown: the receiving MCA runs but does not " \
            "answer" in out.stdout, out.stdout + out.stderr
        # the crowd's idle connections time out (CLIENT_TIMEOUT): served again
        wait_for(lambda: _status(b, sock).returncode == 0, timeout=30,
                 message="the agent did not answer again after the crowd's time-out")
    finally:
        crowd.kill()
        crowd.wait(timeout=10)
    assert rx.poll() is None


def test_a_control_socket_path_too_long_is_named(tmp_path):
    """Trial C: a long state_dir stopped the agent with "AF_UNIX path too long", naming no
    path and no setting."""
    import asyncio

    path = tmp_path / ("d" * 120) / "receiver.sock"

    async def answer(_request):
        return {}
    with pytest.raises(control.ControlError, match=r"control socket .*receiver.sock: \d+ bytes "
                       r"long, over the 107 a Unix socket's path may have: set control_socket"):
        asyncio.run(control.serve_control(path, answer))
