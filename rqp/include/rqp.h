/*
 * rqp.h -- put messages on an RQP transmission queue from C, and read them with their type.
 *
 * Header-only: every function is static inline, there is no library to link. Find the
 * directory with `python -m rqp --include` (or rqp.get_include()):
 *
 *     cc -I"$(python -m rqp --include)" producer.c -o producer
 *
 * A producer builds a transmission record (version 2, the layout in the README: 64-byte
 * header, then the payload; every integer big-endian, no padding) and puts it on the
 * transmission queue with System V type 1; the sending MCA takes it from there. The record
 * carries the System V `mtype` the message is put with at the destination, its priority
 * (0..9, default 4) and its expiry (Unix milliseconds, 0 = never).
 *
 * An atomic batch (rqp_batch_begin / _add / _commit / _rollback) is one record holding all its
 * messages, put with one msgsnd: every message of it enters the channel or none does.
 *
 * A consumer needs nothing of this: at the destination the message is the application's bytes
 * with its `mtype`, so msgrcv(id, &buf, size, TYPE, 0) reads it as for any System V queue.
 * rqp_receive() below is that, with the key looked up.
 *
 * Errors: functions return -1 and set errno (EINVAL: a value out of range, an expires_at_ms
 * before RQP_EXPIRES_MIN_MS (seconds by mistake), or a destination
 * that is one of the agents' own queues; EMSGSIZE: the record does not fit; anything
 * msgget/msgsnd/msgrcv set). As msgsnd and msgrcv, a call interrupted by a signal handler
 * fails with EINTR, whatever SA_RESTART says (nothing was put or taken: call it again).
 *
 * Threads and signals: no function keeps state between calls; they may be called from any
 * number of threads at once (a struct rqp_batch belongs to one thread at a time). They are
 * not async-signal-safe (rqp_put, rqp_receive and the batch functions call malloc).
 *
 * A record put while no sending MCA runs waits on the transmission queue until one does (the
 * Python API starts one; from C, run rqp-sender, or its systemd unit). If the transmission
 * queue is removed, rqp_put fails (EIDRM while it waited, then EINVAL for the stale id): get
 * a new id from rqp_open_transmission_queue().
 *
 * Builds as C99 or later and as C++ (strict -std=c99 -pedantic too: the wall clock is read
 * with gettimeofday, declared there without feature-test macros).
 */
#ifndef RQP_H
#define RQP_H

#include <errno.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ipc.h>
#include <sys/msg.h>
#include <sys/sem.h>
#include <sys/time.h>
#include <sys/types.h>
#include <unistd.h>

#define RQP_SURE_MSG 0
#define RQP_UNSURE_MSG 1
#define RQP_RECORD_VERSION 2
#define RQP_HEADER_SIZE 64
#define RQP_MIN_PRIORITY 0
#define RQP_MAX_PRIORITY 9
#define RQP_DEFAULT_PRIORITY 4
#define RQP_NEVER 0 /* expires_at_ms: the message does not expire */
/* The smallest expires_at_ms taken besides RQP_NEVER (1973 in milliseconds): a smaller one is
 * seconds by mistake (time(NULL) + 60), EINVAL rather than a message expired at once. */
#define RQP_EXPIRES_MIN_MS 100000000000ull
#define RQP_FLAG_BATCH 0x0004 /* transmission record flag: the payload is a batch's members */
#define RQP_MAX_BATCH 256
#define RQP_MEMBER_HEADER_SIZE 12 /* int64 mtype, uint32 length, before each member's bytes */
/* The transmission queue of a default .rqprc ("RQ" 0000) and DEAD.LETTER.Q ("RQ" DEAD). */
#define RQP_DEFAULT_TRANSMISSION_QUEUE ((key_t)0x52510000)
#define RQP_DEFAULT_DEAD_LETTER_QUEUE ((key_t)0x5251DEAD)
/* Semaphore 2 of the set with the transmission queue's key: the doorbell that producers of
 * earlier versions raised after a put. No longer used: an idle sending MCA waits in msgrcv on
 * its queue and wakes when a record arrives. */
#define RQP_DOORBELL 2

/* What a message carries besides its payload (spec section 6). */
struct rqp_extras {
    long mtype;             /* System V type at the destination, 1 or more (default 1) */
    int priority;           /* 0 (lowest) .. 9 (highest), default 4 */
    uint64_t expires_at_ms; /* Unix ms after which it is dead-lettered EXPIRED; 0 = never */
};

/* Whether extras' priority and expiry are in range (mtype: checked by the caller). */
static inline int rqp_extras_ok_(const struct rqp_extras *e) {
    return e->priority >= RQP_MIN_PRIORITY && e->priority <= RQP_MAX_PRIORITY &&
           (e->expires_at_ms == RQP_NEVER || e->expires_at_ms >= RQP_EXPIRES_MIN_MS);
}

/* The defaults: mtype 1, priority 4, no expiry. */
static inline struct rqp_extras rqp_default_extras(void) {
    struct rqp_extras e = {1, RQP_DEFAULT_PRIORITY, RQP_NEVER};
    return e;
}

/* The wall clock in Unix nanoseconds (microsecond resolution). */
static inline uint64_t rqp_now_ns_(void) {
    struct timeval tv;
    gettimeofday(&tv, NULL);
    return (uint64_t)tv.tv_sec * 1000000000u + (uint64_t)tv.tv_usec * 1000u;
}

/* The wall clock in Unix milliseconds plus `ttl_ms`: an expires_at_ms for "this long from now"
 * (milliseconds, as the field: time(NULL) + 60 is 1970 and expires at once). */
static inline uint64_t rqp_expiry_in(uint64_t ttl_ms) {
    return rqp_now_ns_() / 1000000u + ttl_ms;
}

static inline void rqp_be_(unsigned char *p, uint64_t v, int n) {
    for (int i = n - 1; i >= 0; i--) {
        p[i] = (unsigned char)(v & 0xFF);
        v >>= 8;
    }
}

/* The 64-byte header (values already checked). */
static inline void rqp_header_(unsigned char *p, int message_type, unsigned flags,
                               key_t queue_key, const struct rqp_extras *e, uint64_t sequence) {
    memcpy(p, "RQPX", 4);
    p[4] = RQP_RECORD_VERSION;
    p[5] = (unsigned char)message_type;
    rqp_be_(p + 6, flags, 2);
    rqp_be_(p + 8, (uint64_t)(uint32_t)queue_key, 8);      /* key_t in the low 32 bits */
    rqp_be_(p + 16, (uint64_t)(uint32_t)getpid(), 4);      /* producer_pid */
    rqp_be_(p + 20, sequence, 8);
    rqp_be_(p + 28, rqp_now_ns_(), 8);
    rqp_be_(p + 36, (uint64_t)(int64_t)e->mtype, 8);
    rqp_be_(p + 44, e->expires_at_ms, 8);
    p[52] = (unsigned char)e->priority;
    memset(p + 53, 0, 11);                                 /* reserved */
}

/* Write the record of one message into buf (cap bytes): its length, or -1 (errno EINVAL for a
 * bad message_type, mtype or priority; EMSGSIZE if cap is too small). queue_key is the
 * destination key_t; sequence is any per-producer number (0 if unused). */
static inline ssize_t rqp_build_record(void *buf, size_t cap, int message_type, key_t queue_key,
                                       const void *payload, size_t len,
                                       const struct rqp_extras *extras, uint64_t sequence) {
    struct rqp_extras e = extras ? *extras : rqp_default_extras();
    unsigned char *p = (unsigned char *)buf;
    if ((message_type != RQP_SURE_MSG && message_type != RQP_UNSURE_MSG) || e.mtype < 1 ||
        !rqp_extras_ok_(&e) || (len && payload == NULL) ||
        queue_key == 0 /* IPC_PRIVATE names no queue */) {
        errno = EINVAL;
        return -1;
    }
    if (cap < RQP_HEADER_SIZE || len > cap - RQP_HEADER_SIZE) {
        errno = EMSGSIZE;
        return -1;
    }
    rqp_header_(p, message_type, 0, queue_key, &e, sequence);
    if (len)
        memcpy(p + RQP_HEADER_SIZE, payload, len);
    return (ssize_t)(RQP_HEADER_SIZE + len);
}


/* The transmission queue with key `xmit_key` (created if missing, mode 0660, as the agents
 * do): its id for rqp_put(), or -1. */
static inline int rqp_open_transmission_queue(key_t xmit_key) {
    return msgget(xmit_key, IPC_CREAT | 0660);
}

/* Nothing: kept so that programs written for earlier versions, which rang the sending MCA's
 * doorbell, still build. The msgsnd of a record wakes the sending MCA. Returns 0. */
static inline int rqp_ring_doorbell(key_t xmit_key) {
    (void)xmit_key;
    return 0;
}

/* msgsnd of a record on transmission queue `xmit_id` (EINTR as msgsnd: not retried). msgsnd
 * says EINVAL both for a queue id that names no queue and for a message over the kernel's
 * msgmax: the second is EMSGSIZE here, as rqp_build_record says it (the queue is there: its
 * IPC_STAT works, or is refused for want of read permission; the type is 1). */
static inline int rqp_send_record_(int xmit_id, const long *msg, size_t size, int msgflg) {
    int rc = msgsnd(xmit_id, msg, size, msgflg);
    struct msqid_ds ds;
    if (rc < 0 && errno == EINVAL) {
        int there = msgctl(xmit_id, IPC_STAT, &ds) == 0 || errno == EACCES;
        errno = there ? EMSGSIZE : EINVAL;
    }
    return rc;
}

/* Whether `queue_key` names one of the agents' own queues, never a destination: the
 * transmission queue given, the default ones, or any whose agent semaphores (a transmission
 * queue's) or marker (DEAD.LETTER.Q's) exist on this host, as the Python API decides it. */
static inline int rqp_agent_queue_(key_t queue_key, key_t xmit_key) {
    return queue_key == xmit_key || queue_key == RQP_DEFAULT_TRANSMISSION_QUEUE ||
           queue_key == RQP_DEFAULT_DEAD_LETTER_QUEUE || semget(queue_key, 0, 0) >= 0;
}

/* Put one message for queue `queue_key` on transmission queue `xmit_id` (from
 * rqp_open_transmission_queue): one msgsnd, which wakes the sending MCA. `xmit_key`: that
 * queue's key (a queue_key equal to it, or naming another of the agents' queues, is EINVAL:
 * the two swapped put records that no host would ever take). msgflg as for msgsnd: 0 waits
 * while the transmission queue is full, IPC_NOWAIT fails with EAGAIN, a signal handler with
 * EINTR. EMSGSIZE: the record (64 bytes and the payload) is over the kernel's msgmax. */
static inline int rqp_put(int xmit_id, key_t xmit_key, int message_type, key_t queue_key,
                          const void *payload, size_t len, const struct rqp_extras *extras,
                          uint64_t sequence, int msgflg) {
    size_t size = RQP_HEADER_SIZE + len;
    long *msg;
    ssize_t n;
    int rc, saved;
    if (len > (size_t)-1 - sizeof(long) - RQP_HEADER_SIZE) { /* (no size wraps round) */
        errno = EMSGSIZE;
        return -1;
    }
    if (queue_key != 0 && rqp_agent_queue_(queue_key, xmit_key)) {
        errno = EINVAL;
        return -1;
    }
    msg = (long *)malloc(sizeof(long) + size);
    if (msg == NULL)
        return -1;
    msg[0] = 1; /* every transmission record has System V type 1 */
    n = rqp_build_record((char *)(msg + 1), size, message_type, queue_key, payload, len, extras,
                         sequence);
    if (n < 0) {
        saved = errno;
        free(msg);
        errno = saved;
        return -1;
    }
    rc = rqp_send_record_(xmit_id, msg, (size_t)n, msgflg);
    saved = errno;
    free(msg);
    (void)xmit_key;
    if (rc < 0) {
        errno = saved;
        return -1;
    }
    return 0;
}

/* An atomic batch being built: every message of it for one queue, with one message type,
 * priority and expiry (each with its own mtype). */
struct rqp_batch {
    long *msg;           /* System V message: type 1, then the record */
    size_t cap;          /* the largest record (the kernel's msgmax) */
    size_t len;          /* the record so far */
    int count;           /* messages in it */
    int message_type;
    key_t queue_key;
    struct rqp_extras extras;
};

/* Start a batch whose record may be up to `cap` bytes: the kernel's msgmax
 * (/proc/sys/kernel/msgmax, 8192 by default; a bigger cap lets rqp_batch_commit fail with
 * EMSGSIZE). extras: priority and expiry for the whole batch (its mtype is ignored; NULL:
 * defaults). 0, or -1 (EINVAL, also for one of the agents' own queues, as rqp_put; ENOMEM);
 * after a failure b->msg is NULL, so that rqp_batch_rollback(b) is safe. After commit or
 * rollback, begin again before adding; begin on a batch still open would lose its buffer
 * (commit or roll it back first). */
static inline int rqp_batch_begin(struct rqp_batch *b, size_t cap, int message_type,
                                  key_t queue_key, const struct rqp_extras *extras) {
    struct rqp_extras e = extras ? *extras : rqp_default_extras();
    e.mtype = 1;
    b->msg = NULL;
    if ((message_type != RQP_SURE_MSG && message_type != RQP_UNSURE_MSG) ||
        !rqp_extras_ok_(&e) || queue_key == 0 ||
        cap < RQP_HEADER_SIZE + RQP_MEMBER_HEADER_SIZE || cap > (size_t)-1 - sizeof(long) ||
        rqp_agent_queue_(queue_key, 0)) {
        errno = EINVAL;
        return -1;
    }
    b->msg = (long *)malloc(sizeof(long) + cap);
    if (b->msg == NULL)
        return -1;
    b->cap = cap;
    b->len = RQP_HEADER_SIZE;
    b->count = 0;
    b->message_type = message_type;
    b->queue_key = queue_key;
    b->extras = e;
    return 0;
}

/* Add a message, put with `mtype` (1 or more) at the destination. 0, or -1: EINVAL (mtype),
 * E2BIG (already RQP_MAX_BATCH messages), EMSGSIZE (the record would pass cap; the batch is
 * unchanged). */
static inline int rqp_batch_add(struct rqp_batch *b, const void *data, size_t len, long mtype) {
    unsigned char *p;
    if (b->msg == NULL) { /* committed or rolled back: not begun */
        errno = EINVAL;
        return -1;
    }
    p = (unsigned char *)(b->msg + 1) + b->len;
    if (mtype < 1 || (len && data == NULL) || len > 0xFFFFFFFFu) {
        errno = EINVAL;
        return -1;
    }
    if (b->count >= RQP_MAX_BATCH) {
        errno = E2BIG;
        return -1;
    }
    if (RQP_MEMBER_HEADER_SIZE + len > b->cap - b->len) {
        errno = EMSGSIZE;
        return -1;
    }
    rqp_be_(p, (uint64_t)(int64_t)mtype, 8);
    rqp_be_(p + 8, (uint64_t)len, 4);
    if (len)
        memcpy(p + RQP_MEMBER_HEADER_SIZE, data, len);
    b->len += RQP_MEMBER_HEADER_SIZE + len;
    b->count++;
    return 0;
}

/* Drop the batch (nothing of it was put) and free it. */
static inline void rqp_batch_rollback(struct rqp_batch *b) {
    free(b->msg);
    b->msg = NULL;
    b->count = 0;
}

/* Put the whole batch with one msgsnd on transmission queue `xmit_id` (a queue_key equal to
 * `xmit_key` is EINVAL, as for rqp_put); then free it. An empty batch puts nothing. 0, or -1:
 * EINVAL if it was not begun (or was committed or rolled back already), else errno from
 * msgsnd, EINTR included (the batch is kept: commit again or roll back). */
static inline int rqp_batch_commit(struct rqp_batch *b, int xmit_id, key_t xmit_key,
                                   uint64_t sequence, int msgflg) {
    int rc;
    if (b->msg == NULL || b->queue_key == xmit_key) {
        errno = EINVAL;
        return -1;
    }
    if (b->count == 0) {
        rqp_batch_rollback(b);
        return 0;
    }
    b->msg[0] = 1;
    rqp_header_((unsigned char *)(b->msg + 1), b->message_type, RQP_FLAG_BATCH, b->queue_key,
                &b->extras, sequence);
    rc = rqp_send_record_(xmit_id, b->msg, b->len, msgflg);
    (void)xmit_key;
    if (rc < 0)
        return -1;
    rqp_batch_rollback(b);
    return 0;
}

/* Take one message from local queue `queue_key` as msgrcv's msgtyp selects it (0: the first;
 * > 0: the first of that type; < 0: the first of the lowest type up to -msgtyp) into buf (cap
 * bytes); its length, and its type in *mtype if not NULL; or -1 (ENOMSG with IPC_NOWAIT and
 * nothing there, ENOENT: no such queue, EINTR: a signal handler ran, as for msgrcv). */
static inline ssize_t rqp_receive(key_t queue_key, void *buf, size_t cap, long msgtyp,
                                  long *mtype, int msgflg) {
    long *msg;
    ssize_t n;
    int saved, id = msgget(queue_key, 0);
    if (id < 0)
        return -1;
    if (cap > (size_t)-1 - sizeof(long)) {
        errno = EINVAL;
        return -1;
    }
    msg = (long *)malloc(sizeof(long) + cap);
    if (msg == NULL)
        return -1;
    n = msgrcv(id, msg, cap, msgtyp, msgflg);
    saved = errno;
    if (n >= 0) {
        if (n > 0)
            memcpy(buf, msg + 1, (size_t)n);
        if (mtype)
            *mtype = msg[0];
    }
    free(msg);
    errno = saved;
    return n;
}

#endif /* RQP_H */
