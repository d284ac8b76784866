"""A receiving MCA written with plain ``struct`` and sockets, independent of ``rqp``.

Run on a simulated host to face a real sending MCA with misbehaviour on demand. It prints one
JSON line per frame it receives. How it answers is read, at every frame, from the file given
as its second argument (default "yes"):

    yes       QUEUE_YES / DELIVERED_YES
    no        QUEUE_NO to every ask
    error     QUEUE_YES to asks, DELIVERED_ERROR to messages
    silent    reads everything, answers nothing
    mute      QUEUE_YES to asks, no answer to messages
    garbage   answers a MESSAGE with an unknown code (09 00)
    early N   answers an ask with QUEUE_YES and N DELIVERED_YES in one packet (answers before
              their questions), then nothing more on that connection

It is a plain RQP/1 peer: it ignores the data octet of QUEUE_ASK and answers with 0, and any
code but 1 and 4 (MESSAGE_EX too) is UNEXPECTED. Each frame line has its bytes ("raw", hex).
It prints {"confirmed": BODY} for each MESSAGE it answers with DELIVERED_YES.
    hold N    answers an ask at once; otherwise answers nothing until N frames are outstanding,
              then answers them all (yes);
              prints {"outstanding": N} so a test can see how big the sender's window was
    close-once  at the next MESSAGE, ends its side of that connection in order (shutdown) and
              reads on, answering nothing, until the sender's end, as a receiving MCA closing
              at its idle time-out does (the frame and those after it print with "late");
              the mode becomes "yes" for every later frame
    close-each D  so at every connection's first MESSAGE, for ever; answers asks with
              QUEUE_YES after D seconds
    stall     QUEUE_YES to asks; at the first MESSAGE prints {"stalled": true} and reads
              nothing more (what the sender writes waits in the kernels' buffers, as on a
              link gone dark) until the mode is "drain": then reads on, answering nothing,
              and prints {"ended": "eof"} or {"ended": "reset"} (the sender reset the
              connection: what its kernel held never came)
"""

import json
import os
import socket
import struct
import sys
import threading
import time

HEADER = struct.Struct(">BBQQQ")  # code, type, key, queue_key, length


def mode(path):
    try:
        with open(path) as f:
            return f.read().split() or ["yes"]
    except FileNotFoundError:
        return ["yes"]


def read_exact(conn, n):
    buf = b""
    while len(buf) < n:
        chunk = conn.recv(n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return buf


def set_mode(path, how):
    with open(path + ".tmp", "w") as f:
        f.write(how)
    os.replace(path + ".tmp", path)


def serve(conn, mode_path, lock):
    pending = []
    early = closing = stalled = False
    try:
        while True:
            code = read_exact(conn, 1)[0]
            if code == 1:
                rest = read_exact(conn, HEADER.size - 1)
                _, mtype, key, qkey, length = HEADER.unpack(bytes([code]) + rest)
                body = read_exact(conn, length)
                frame = {"frame": "MESSAGE", "type": mtype, "key": key, "queue_key": qkey,
                         "body": body.decode(errors="replace"),
                         "raw": (bytes([code]) + rest + body).hex()}
            elif code == 4:
                rest = read_exact(conn, 9)
                data, qkey = struct.unpack(">BQ", rest)
                frame = {"frame": "QUEUE_ASK", "queue_key": qkey, "data": data,
                         "raw": (bytes([code]) + rest).hex()}
            else:
                frame = {"frame": "UNEXPECTED", "code": code}
            with lock:
                print(json.dumps(frame), flush=True)
            how = mode(mode_path)
            if how[0] in ("close-once", "close-each") and code == 1 and not closing:
                if how[0] == "close-once":
                    set_mode(mode_path, "yes")
                conn.shutdown(socket.SHUT_WR)
                closing = True
            if closing:
                with lock:
                    print(json.dumps({"late": frame}), flush=True)
                continue
            if how[0] == "stall" and code == 1:
                with lock:
                    print(json.dumps({"stalled": True}), flush=True)
                while mode(mode_path)[0] == "stall":  # (the mode file is the test's lever)
                    time.sleep(0.05)
                stalled = True
            if how[0] in ("silent", "drain") or early or stalled:
                continue
            if how[0] == "early" and code == 4:
                conn.sendall(b"\x05\x00" + b"\x02\x00" * int(how[1]))
                early = True
                continue
            if how[0] == "hold":
                if code == 4 and not pending:
                    conn.sendall(b"\x05\x00")
                    continue
                pending.append(code)
                if len(pending) < int(how[1]):
                    continue
                with lock:
                    print(json.dumps({"outstanding": len(pending)}), flush=True)
                conn.sendall(b"".join(b"\x05\x00" if c == 4 else b"\x02\x00" for c in pending))
                pending.clear()
                continue
            if code == 4 and how[0] == "close-each":
                time.sleep(float(how[1]))  # (a slow peer: the delay is the behaviour tested)
            if code == 4:
                conn.sendall(b"\x06\x00" if how[0] == "no" else b"\x05\x00")
            elif how[0] == "mute":
                continue
            elif how[0] == "garbage":
                conn.sendall(b"\x09\x00")
            elif how[0] == "error":
                conn.sendall(b"\x03\x00")
            else:
                conn.sendall(b"\x02\x00")
                with lock:
                    print(json.dumps({"confirmed": frame["body"]}), flush=True)
    except EOFError:
        if stalled:
            with lock:
                print(json.dumps({"ended": "eof"}), flush=True)
    except ConnectionResetError:
        if stalled:
            with lock:
                print(json.dumps({"ended": "reset"}), flush=True)
    except OSError:
        pass
    finally:
        with lock:
            print(json.dumps({"closed": True}), flush=True)
        conn.close()


def main():
    host, port = sys.argv[1].rsplit(":", 1)
    mode_path = sys.argv[2]
    lock = threading.Lock()
    srv = socket.create_server((host, int(port)), reuse_port=False)
    print(json.dumps({"listening": True}), flush=True)
    while True:
        conn, _ = srv.accept()
        with lock:
            print(json.dumps({"connected": True}), flush=True)
        threading.Thread(target=serve, args=(conn, mode_path, lock), daemon=True).start()


if __name__ == "__main__":
    main()
