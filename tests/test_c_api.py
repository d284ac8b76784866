"""rqp.h, the header-only C API: compiled here with gcc, run as real producers and consumers.

The record a C producer builds is checked byte by byte against the Python declaration; then a
C producer on host a sends through the real agents to host b, where a C consumer that knows
nothing of RQP (plain msgget/msgrcv) dispatches on mtype.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import rqp
from rqp.protocol.records import TRANSMISSION_HEADER_SIZE, TransmissionRecord
from tests.agents import Pair, dead_letters

Q1 = 0x52510001

BUILD = r"""
#include <stdio.h>
#include <stdlib.h>
#include <rqp.h>
/* build KIND QUEUE_KEY MTYPE PRIORITY EXPIRES_AT_MS PAYLOAD [CAP]: the record on stdout */
int main(int argc, char **argv) {
    unsigned char buf[1024];
    struct rqp_extras e = rqp_default_extras();
    size_t cap = argc > 7 ? strtoul(argv[7], NULL, 0) : sizeof buf;
    e.mtype = strtol(argv[3], NULL, 0);
    e.priority = atoi(argv[4]);
    e.expires_at_ms = strtoull(argv[5], NULL, 0);
    ssize_t n = rqp_build_record(buf, cap, atoi(argv[1]), (key_t)strtoul(argv[2], NULL, 0),
                                 argv[6], strlen(argv[6]), &e, 42);
    if (n < 0) { perror("rqp_build_record"); return 3; }
    fwrite(buf, 1, (size_t)n, stdout);
    return 0;
}
"""

PRODUCER = r"""
#include <stdio.h>
#include <stdlib.h>
#include <rqp.h>
/* producer QUEUE_KEY (MTYPE PAYLOAD)...: SURE messages through the default transmission queue */
int main(int argc, char **argv) {
    int xmit = rqp_open_transmission_queue(RQP_DEFAULT_TRANSMISSION_QUEUE);
    if (xmit < 0) { perror("rqp_open_transmission_queue"); return 1; }
    for (int i = 2; i + 1 < argc; i += 2) {
        struct rqp_extras e = rqp_default_extras();
        e.mtype = strtol(argv[i], NULL, 0);
        e.expires_at_ms = rqp_expiry_in(600000);  /* ten minutes */
        if (rqp_put(xmit, RQP_DEFAULT_TRANSMISSION_QUEUE, RQP_SURE_MSG,
                    (key_t)strtoul(argv[1], NULL, 0), argv[i + 1], strlen(argv[i + 1]), &e,
                    (uint64_t)i, 0) < 0) {
            perror("rqp_put");
            return 1;
        }
    }
    return 0;
}
"""

# A consumer as any System V program is written: it has never heard of RQP.
CONSUMER = r"""
#include <stdio.h>
#include <stdlib.h>
#include <sys/ipc.h>
#include <sys/msg.h>
/* consumer QUEUE_KEY MSGTYP...: one message per msgtyp, printed as "TYPE PAYLOAD" */
int main(int argc, char **argv) {
    struct { long mtype; char mtext[8192]; } m;
    int id = msgget((key_t)strtoul(argv[1], NULL, 0), 0);
    if (id < 0) { perror("msgget"); return 1; }
    for (int i = 2; i < argc; i++) {
        ssize_t n = msgrcv(id, &m, sizeof m.mtext, strtol(argv[i], NULL, 0), 0);
        if (n < 0) { perror("msgrcv"); return 1; }
        printf("%ld %.*s\n", m.mtype, (int)n, m.mtext);
    }
    return 0;
}
"""


@pytest.fixture(scope="module")
def cc(tmp_path_factory):
    """Compile a C program against the installed rqp.h, warnings as errors."""
    gcc = shutil.which("gcc")
    if gcc is None:  # scripts/test installs it; a bare pytest run must say so, not skip
        pytest.fail("gcc is missing: run scripts/test (it installs gcc) or apt-get install gcc")
    out = tmp_path_factory.mktemp("c")

    def build(name: str, source: str, flags: tuple = ("-std=gnu11",)) -> Path:
        src, exe = out / f"{name}.c", out / name
        src.write_text(source)
        done = subprocess.run([gcc, *flags, "-Wall", "-Wextra", "-Werror", "-O1",
                               f"-I{rqp.get_include()}", str(src), "-o", str(exe)],
                              capture_output=True, text=True)
        assert done.returncode == 0, f"gcc could not build {name}.c:\n{done.stderr}"
        return exe

    return build


def test_the_header_is_found_the_way_python_packages_hand_out_headers():
    out = subprocess.run([sys.executable, "-m", "rqp", "--include"], check=True,
                         capture_output=True, text=True).stdout.strip()
    assert out == rqp.get_include() and (Path(out) / "rqp.h").is_file()
    assert subprocess.run([sys.executable, "-m", "rqp"], capture_output=True).returncode == 2


@pytest.mark.parametrize("kind,mtype,priority,expires,payload", [
    (0, 1, 4, 0, "hello"),
    (1, 5, 9, 1_800_000_000_123, "typed"),
    (0, (1 << 63) - 1, 0, (1 << 64) - 1, ""),
])
def test_a_c_record_is_the_python_record_byte_for_byte(cc, kind, mtype, priority, expires,
                                                       payload):
    exe = cc("build", BUILD)
    raw = subprocess.run([exe, str(kind), hex(Q1), str(mtype), str(priority), str(expires),
                          payload], check=True, capture_output=True).stdout
    record = TransmissionRecord.from_bytes(raw)
    assert (record.message_type, record.queue_key, record.mtype, record.priority,
            record.expires_at_ms, record.payload, record.sequence) == \
        (kind, Q1, mtype, priority, expires, payload.encode(), 42)
    assert record.to_bytes() == raw and len(raw) == TRANSMISSION_HEADER_SIZE + len(payload)


@pytest.mark.parametrize("args,error", [
    (["2", hex(Q1), "1", "4", "0", "x"], "Invalid argument"),  # message_type
    (["0", hex(Q1), "0", "4", "0", "x"], "Invalid argument"),  # mtype 0
    (["0", hex(Q1), "-3", "4", "0", "x"], "Invalid argument"),
    (["0", hex(Q1), "1", "10", "0", "x"], "Invalid argument"),  # priority
    # expires_at_ms in seconds by mistake (a trial's time(NULL) + 60: dead-lettered at once)
    (["0", hex(Q1), "1", "4", "1800000000", "x"], "Invalid argument"),
    (["0", hex(Q1), "1", "4", "0", "toolong", "66"], "Message too long"),
    (["0", "0", "1", "4", "0", "x"], "Invalid argument"),  # queue key 0: IPC_PRIVATE
])
def test_a_c_record_out_of_range_is_refused_with_errno(cc, args, error):
    exe = cc("build", BUILD)
    done = subprocess.run([exe, *args], capture_output=True, text=True)
    assert done.returncode == 3 and f"rqp_build_record: {error}" in done.stderr


PUT_SIZE = r"""
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <rqp.h>
/* put_size N: rqp_put of an N-byte payload on a private queue, then on the queue removed:
 * "ok" or the errno's name, for each */
static const char *said(int rc) {
    return rc == 0 ? "ok" : errno == EMSGSIZE ? "EMSGSIZE" : errno == EINVAL ? "EINVAL"
        : "other";
}
int main(int argc, char **argv) {
    size_t n = argc > 1 ? strtoul(argv[1], NULL, 0) : 0;
    char *payload = calloc(1, n + 1);
    int id = msgget(IPC_PRIVATE, IPC_CREAT | 0600);
    if (payload == NULL || id < 0) { perror("set-up"); return 1; }
    const char *first = said(rqp_put(id, 0, RQP_UNSURE_MSG, (key_t)0x52510001, payload, n,
                                     NULL, 1, IPC_NOWAIT));
    if (msgctl(id, IPC_RMID, NULL) < 0) { perror("msgctl"); return 1; }
    printf("%s %s\n", first, said(rqp_put(id, 0, RQP_UNSURE_MSG, (key_t)0x52510001, payload,
                                          1, NULL, 2, IPC_NOWAIT)));
    return 0;
}
"""


def test_c_put_over_msgmax_is_emsgsize_and_a_removed_queue_einval(cc):
    """A trial: rqp_put of an 8,129-byte payload (a record of 8,193 bytes) failed with EINVAL,
    msgsnd's word for it, where the header promises EMSGSIZE for a record that does not fit."""
    exe = cc("put_size", PUT_SIZE)
    msgmax = int(Path("/proc/sys/kernel/msgmax").read_text())
    for size, first in ((msgmax - TRANSMISSION_HEADER_SIZE, "ok"),
                        (msgmax - TRANSMISSION_HEADER_SIZE + 1, "EMSGSIZE")):
        done = subprocess.run([exe, str(size)], capture_output=True, text=True, timeout=30)
        assert (done.returncode, done.stdout) == (0, f"{first} EINVAL\n"), done.stderr


AS_MSGRCV = r"""
#define _POSIX_C_SOURCE 200809L /* (for sigaction: rqp.h itself needs no such macro) */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/sem.h>
#include <time.h>
#include <rqp.h>
/* What a System V programmer expects, each printed as "what: rc errno-name" */
static void on_alarm(int sig) { (void)sig; }
static void show(const char *what, long rc) {
    int e = errno;
    printf("%s: %ld %s\n", what, rc, rc >= 0 ? "-" : e == EINTR ? "EINTR" : e == EINVAL ?
           "EINVAL" : e == EMSGSIZE ? "EMSGSIZE" : e == EAGAIN ? "EAGAIN" : "other");
}
int main(void) {
    key_t xk = (key_t)0x52519990, dest = (key_t)0x52519991;
    int xmit = rqp_open_transmission_queue(xk), full;
    struct rqp_batch b;
    struct sigaction sa;
    char buf[64];
    long mtype = 0;
    struct { long t; char c[1]; } m = {1, {0}};
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_alarm;
    sa.sa_flags = SA_RESTART; /* msgsnd and msgrcv are never restarted: EINTR all the same */
    sigaction(SIGALRM, &sa, NULL);
    /* the agents' own queues are no destination (swapped keys put records no host takes) */
    show("swapped", rqp_put(xmit, xk, RQP_SURE_MSG, xk, "a", 1, NULL, 0, IPC_NOWAIT));
    show("dead-letter queue", rqp_put(xmit, xk, RQP_SURE_MSG, RQP_DEFAULT_DEAD_LETTER_QUEUE,
                                      "a", 1, NULL, 0, IPC_NOWAIT));
    semget((key_t)0x52519992, 3, IPC_CREAT | 0600); /* another transmission queue's set */
    show("another's", rqp_put(xmit, xk, RQP_SURE_MSG, (key_t)0x52519992, "a", 1, NULL, 0,
                              IPC_NOWAIT));
    show("size wraps", rqp_put(xmit, xk, RQP_SURE_MSG, dest, "a", (size_t)-65, NULL, 0,
                               IPC_NOWAIT));
    b.msg = (long *)&b; /* garbage */
    show("begin refused", rqp_batch_begin(&b, 8192, 7, dest, NULL));
    printf("then msg: %s\n", b.msg == NULL ? "NULL" : "garbage");
    rqp_batch_rollback(&b);
    show("begin for the DLQ", rqp_batch_begin(&b, 8192, 0, RQP_DEFAULT_DEAD_LETTER_QUEUE,
                                              NULL));
    {   /* an expiry in seconds by mistake: refused, not a batch expired at once */
        struct rqp_extras e = rqp_default_extras();
        e.expires_at_ms = (uint64_t)time(NULL) + 60;
        show("begin expiring in s", rqp_batch_begin(&b, 8192, 0, dest, &e));
    }
    /* a blocked receive and a blocked put end with EINTR, as msgrcv and msgsnd do */
    full = msgget(dest, IPC_CREAT | 0600);
    alarm(1);
    show("receive", rqp_receive(dest, buf, sizeof buf, 0, &mtype, 0));
    while (rqp_put(xmit, xk, RQP_UNSURE_MSG, dest, buf, sizeof buf, NULL, 0, IPC_NOWAIT) == 0)
        ;
    show("full", -1);
    alarm(1);
    show("put", rqp_put(xmit, xk, RQP_UNSURE_MSG, dest, buf, sizeof buf, NULL, 0, 0));
    msgsnd(full, &m, 0, 0); /* an empty message, read into no buffer at all */
    show("receive empty", rqp_receive(dest, NULL, 0, 0, NULL, IPC_NOWAIT));
    msgctl(full, IPC_RMID, NULL);
    msgctl(xmit, IPC_RMID, NULL);
    semctl(semget((key_t)0x52519992, 0, 0), 0, IPC_RMID);
    return 0;
}
"""


def test_c_calls_behave_as_msgsnd_and_msgrcv_do_and_refuse_the_agents_queues(cc):
    """A trial, as a System V programmer: rqp_receive and rqp_put retried EINTR, so a blocked
    call never returned to an alarm() time-out; a put to the transmission queue's own key (its
    two key arguments swapped) was taken and retried for ever; a size near SIZE_MAX wrapped
    and overflowed the heap; a refused rqp_batch_begin left a garbage pointer that rollback
    freed; rqp_receive of an empty message into NULL called memcpy(NULL). Built strict C99
    with the undefined-behaviour sanitizer, run in its own IPC namespace."""
    exe = cc("as_msgrcv", AS_MSGRCV, ("-std=c99", "-pedantic", "-fsanitize=undefined",
                                      "-fno-sanitize-recover=all"))
    done = subprocess.run(["unshare", "--ipc", str(exe)], capture_output=True, text=True,
                          timeout=30)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert done.stdout.splitlines() == [
        "swapped: -1 EINVAL", "dead-letter queue: -1 EINVAL", "another's: -1 EINVAL",
        "size wraps: -1 EMSGSIZE", "begin refused: -1 EINVAL", "then msg: NULL",
        "begin for the DLQ: -1 EINVAL", "begin expiring in s: -1 EINVAL", "receive: -1 EINTR", "full: -1 EAGAIN",
        "put: -1 EINTR", "receive empty: 0 -"], done.stdout


def test_c_producer_to_c_consumer_dispatching_on_mtype(cc, testbed_factory):
    producer, consumer = cc("producer", PRODUCER), cc("consumer", CONSUMER)
    p = Pair(testbed_factory(), Q1)
    a, b = p.a, p.b
    a.run([producer, hex(Q1), "2", "two", "3", "three", "1", "one", "3", "three-again"])
    got = b.run([consumer, hex(Q1), "3", "3", "-2", "0"], timeout=30).stdout.splitlines()
    # type 3 first (in order), then the lowest type up to 2 (1), then what is left (2)
    assert got == ["3 three", "3 three-again", "1 one", "2 two"]
    assert dead_letters(a) == [] and dead_letters(b) == []


def test_python_receive_selects_by_type_and_returns_it(testbed_factory):
    p = Pair(testbed_factory(), Q1)
    a, b, rqprc = p.a, p.b, p.rqprc
    a.python(r"""
import sys, rqp
h = rqp.openConnection(int(sys.argv[2]), rqprc=sys.argv[1], start_sender=False)
for mtype, text in ((7, b"seven"), (2, b"two"), (7, b"seven-b")):
    rqp.sendMessage(h, text, mtype=mtype)
rqp.closeConnection(h)
""", str(rqprc), str(Q1))
    out = b.python(r"""
import sys, rqp
q = int(sys.argv[1])
print(rqp.receiveMessage(q, 30, mtype=7, with_type=True))
print(rqp.receiveMessage(q, 30, mtype=-5, with_type=True))
print(rqp.receiveMessage(q, 30))
try:
    rqp.receiveMessage(q, 0.05, mtype=9)
except rqp.QueueEmpty as e:
    print(e)
""", str(Q1))
    assert out.splitlines() == ["(b'seven', 7)", "(b'two', 2)", "b'seven-b'",
                                f"queue {Q1:#010x}: no message of type 9 after 0.05 s"]
