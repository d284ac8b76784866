"""One side of the RabbitMQ workload of ``rqp-bench --against rabbitmq`` (issue 14).

Run with a Python that has ``pika`` (the benchmark makes a venv of its own for it); this file
imports nothing of the project. ``consume`` declares the queue, says ``ready`` and takes
``count`` messages, checking each one's tag and order (as the RQP consumer does); ``produce``
publishes them: ``confirm`` = persistent messages with publisher confirms, at most ``window``
unconfirmed (what SURE is compared with); ``transient`` = non-persistent, no confirms (UNSURE).
Each prints one JSON line: its start or last-message time (``time.monotonic_ns``, one clock
for every process of the host) and the CPU time of its loop.
"""

from __future__ import annotations

import json
import struct
import sys
import time

import pika

HEAD = struct.Struct(">QQ")  # tag, sequence: the same head as the RQP payloads


def _params(port: int) -> pika.ConnectionParameters:
    return pika.ConnectionParameters("127.0.0.1", port, heartbeat=0,
                                     credentials=pika.PlainCredentials("guest", "guest"))


def consume(port: int, queue: str, durable: bool, tag: int, count: int) -> dict:
    conn = pika.BlockingConnection(_params(port))
    ch = conn.channel()
    ch.queue_declare(queue, durable=durable)
    ch.basic_qos(prefetch_count=1000)
    print(json.dumps({"ready": True}), flush=True)
    expect, last, cpu = 0, 0, None
    for method, _props, body in ch.consume(queue, auto_ack=True):
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
    tail = bytes(max(0, size - HEAD.size))
    out: dict = {}
    # Both modes on pika's asynchronous connection (its fastest publisher): "confirm" keeps at
    # most `window` unconfirmed, "transient" publishes in slices of `window`, giving the I/O
    # loop a turn between them, and closes once everything is written.
    confirm = mode == "confirm"
    state = {"sent": 0, "acked": 0}
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
        state["acked"] = method.delivery_tag if method.multiple else state["acked"] + 1
        if state["acked"] >= count:
            conn.close()
        else:
            publish_more()

    def on_channel(ch) -> None:
        channel.append(ch)
        if confirm:
            ch.confirm_delivery(on_confirm)
        out["start_ns"], out["cpu0"] = time.monotonic_ns(), time.process_time_ns()
        publish_more()

    conn = pika.SelectConnection(_params(port), on_open_callback=lambda c: c.channel(
        on_open_callback=on_channel), on_close_callback=lambda c, r: c.ioloop.stop())
    conn.ioloop.start()
    out["cpu_ns"] = time.process_time_ns() - out.pop("cpu0")
    if state["acked"] < count:
        raise SystemExit(f"rabbitmq producer: {state['acked']} of {count} confirmed")
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
