"""One side of the RabbitMQ workload of ``rqp-bench --against rabbitmq`` (issue 14).

Run with a Python that has ``pika`` (the benchmark makes a venv of its own for it); this file
imports nothing of the project. ``consume`` declares the queue, says ``ready`` and takes
``count`` messages, checking each one's tag and order (as the RQP consumer does); ``produce``
publishes them: ``confirm`` = persistent messages with publisher confirms, at most ``window``
unconfirmed (what SURE is compared with); ``transient`` = non-persistent, no confirms (UNSURE).
Each prints one JSON line: its start or last-message time (``time.monotonic_ns``, one clock
for every process of the host) and the CPU time of its loop. Either side stops with an error
when nothing moves for STALL seconds (rather than wait for the benchmark's time-out).
"""

from __future__ import annotations

import json
import struct
import sys
import time

HEAD = struct.Struct(">QQ")  # tag, sequence: the same head as the RQP payloads
#: Seconds without a message (consumer) or a confirm (producer) after which a round fails.
STALL = 60.0


class Confirms:
    """Publisher confirms as the broker sends them: an ack for one delivery tag, or (multiple)
    for every tag up to it, in any mix and order. Counting ``acked = tag if multiple else
    acked + 1`` lost count when a single ack came before a multiple one below it, until the
    producer thought its whole window in flight while nothing was: a round hung (seen with
    SURE 4 KiB, ~7,900 of 15,000 messages)."""

    def __init__(self) -> None:
        self.prefix = 0  # every tag up to this one is confirmed
        self.above: set[int] = set()  # and these beyond it

    def ack(self, tag: int, multiple: bool) -> None:
        if multiple:
            if tag > self.prefix:
                self.prefix = tag
                self.above = {t for t in self.above if t > tag}
        elif tag > self.prefix:
            self.above.add(tag)
        while self.prefix + 1 in self.above:
            self.prefix += 1
            self.above.remove(self.prefix)

    @property
    def count(self) -> int:
        return self.prefix + len(self.above)


def _params(port: int):
    import pika  # (only here: the tests check Confirms without it)
    return pika.ConnectionParameters("127.0.0.1", port, heartbeat=0,
                                     credentials=pika.PlainCredentials("guest", "guest"))


def consume(port: int, queue: str, durable: bool, tag: int, count: int) -> dict:
    import pika
    conn = pika.BlockingConnection(_params(port))
    ch = conn.channel()
    ch.queue_declare(queue, durable=durable)
    ch.basic_qos(prefetch_count=1000)
    print(json.dumps({"ready": True}), flush=True)
    expect, last, cpu = 0, 0, None
    for method, _props, body in ch.consume(queue, auto_ack=True, inactivity_timeout=STALL):
        if method is None:
            raise SystemExit(f"rabbitmq consumer: no message for {STALL:g}s, {expect} of "
                             f"{count} taken")
        if cpu is None:
            cpu = time.process_time_ns()
        got_tag, seq = HEAD.unpack_from(body)
        if got_tag != tag or seq != expect:
            raise SystemExit(f"rabbitmq consumer: message {seq} of tag {got_tag}, expected "
                             f"{expect} of tag {tag}")
        expect += 1
        if expect == count:
            last = time.monotonic_ns()
            break
    cpu = time.process_time_ns() - (cpu or time.process_time_ns())
    ch.cancel()
    conn.close()
    return {"last_ns": last, "cpu_ns": cpu}


def produce(port: int, queue: str, mode: str, tag: int, count: int, size: int,
            window: int) -> dict:
    import pika
    tail = bytes(max(0, size - HEAD.size))
    out: dict = {}
    # Both modes on pika's asynchronous connection (its fastest publisher): "confirm" keeps at
    # most `window` unconfirmed, "transient" publishes in slices of `window`, giving the I/O
    # loop a turn between them, and closes once everything is written.
    confirm = mode == "confirm"
    state = {"sent": 0, "acked": 0, "seen": (-1, 0)}  # seen: (acked, when) at the last look
    confirms = Confirms()
    props = pika.BasicProperties(delivery_mode=2 if confirm else 1)
    channel = []

    def publish_more() -> None:
        ch = channel[0]
        limit = state["acked"] + window if confirm else state["sent"] + window
        while state["sent"] < count and state["sent"] < limit:
            ch.basic_publish("", queue, HEAD.pack(tag, state["sent"]) + tail, props)
            state["sent"] += 1
        if not confirm:
            if state["sent"] < count:
                conn.ioloop.add_callback_threadsafe(publish_more)
            else:
                state["acked"] = count
                conn.close()

    def on_confirm(frame) -> None:
        method = frame.method
        if isinstance(method, pika.spec.Basic.Nack):
            raise SystemExit(f"rabbitmq producer: nack for {method.delivery_tag}")
        confirms.ack(method.delivery_tag, method.multiple)
        state["acked"] = confirms.count
        if state["acked"] >= count:
            conn.close()
        else:
            publish_more()

    def watch() -> None:  # every STALL/4 s: has anything been confirmed since the last look?
        if state["acked"] >= count:
            return
        if state["acked"] != state["seen"][0]:
            state["seen"] = (state["acked"], time.monotonic())
        elif time.monotonic() - state["seen"][1] >= STALL:
            state["stalled"] = True
            conn.close()
            return
        conn.ioloop.call_later(STALL / 4, watch)

    def on_channel(ch) -> None:
        channel.append(ch)
        if confirm:
            ch.confirm_delivery(on_confirm)
            watch()
        out["start_ns"], out["cpu0"] = time.monotonic_ns(), time.process_time_ns()
        publish_more()

    conn = pika.SelectConnection(_params(port), on_open_callback=lambda c: c.channel(
        on_open_callback=on_channel), on_close_callback=lambda c, r: c.ioloop.stop())
    conn.ioloop.start()
    out["cpu_ns"] = time.process_time_ns() - out.pop("cpu0")
    if state["acked"] < count:
        stalled = f" (no confirm for {STALL:g}s)" if state.get("stalled") else ""
        raise SystemExit(f"rabbitmq producer: {state['acked']} of {count} confirmed, "
                         f"{state['sent']} sent{stalled}")
    return out


def main(argv: list[str]) -> int:
    role, port, queue = argv[0], int(argv[1]), argv[2]
    if role == "consume":
        result = consume(port, queue, argv[3] == "durable", int(argv[4]), int(argv[5]))
    else:
        result = produce(port, queue, argv[3], int(argv[4]), int(argv[5]), int(argv[6]),
                         int(argv[7]))
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
