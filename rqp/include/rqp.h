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
 * A consumer needs nothing of this: at the destination the message is the application's bytes
 * with its `mtype`, so msgrcv(id, &buf, size, TYPE, 0) reads it as for any System V queue.
 * rqp_receive() below is that, with the key looked up.
 *
 * Errors: functions return -1 and set errno (EINVAL: a value out of range; EMSGSIZE: the
 * record does not fit; anything msgget/msgsnd/msgrcv set).
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
#include <time.h>
#include <unistd.h>

#define RQP_SURE_MSG 0
#define RQP_UNSURE_MSG 1
#define RQP_RECORD_VERSION 2
#define RQP_HEADER_SIZE 64
#define RQP_MIN_PRIORITY 0
#define RQP_MAX_PRIORITY 9
#define RQP_DEFAULT_PRIORITY 4
#define RQP_NEVER 0 /* expires_at_ms: the message does not expire */
/* The transmission queue of a default .rqprc ("RQ" 0000) and DEAD.LETTER.Q ("RQ" DEAD). */
#define RQP_DEFAULT_TRANSMISSION_QUEUE ((key_t)0x52510000)
#define RQP_DEFAULT_DEAD_LETTER_QUEUE ((key_t)0x5251DEAD)
/* The semaphore producers raise after a put (the sending MCA's doorbell), in the set with the
 * transmission queue's key. Ringing it is optional: an idle sending MCA looks every 50 ms. */
#define RQP_DOORBELL 2

/* What a message carries besides its payload (spec section 6). */
struct rqp_extras {
    long mtype;             /* System V type at the destination, 1 or more (default 1) */
    int priority;           /* 0 (lowest) .. 9 (highest), default 4 */
    uint64_t expires_at_ms; /* Unix ms after which it is dead-lettered EXPIRED; 0 = never */
};

/* The defaults: mtype 1, priority 4, no expiry. */
static inline struct rqp_extras rqp_default_extras(void) {
    struct rqp_extras e = {1, RQP_DEFAULT_PRIORITY, RQP_NEVER};
    return e;
}

/* The wall clock in Unix milliseconds plus `ttl_ms`: an expires_at_ms for "this long from now". */
static inline uint64_t rqp_expiry_in(uint64_t ttl_ms) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u + ttl_ms;
}

static inline void rqp_be_(unsigned char *p, uint64_t v, int n) {
    for (int i = n - 1; i >= 0; i--) {
        p[i] = (unsigned char)(v & 0xFF);
        v >>= 8;
    }
}

/* Write the record of one message into buf (cap bytes): its length, or -1 (errno EINVAL for a
 * bad message_type, mtype or priority; EMSGSIZE if cap is too small). queue_key is the
 * destination key_t; sequence is any per-producer number (0 if unused). */
static inline ssize_t rqp_build_record(void *buf, size_t cap, int message_type, key_t queue_key,
                                       const void *payload, size_t len,
                                       const struct rqp_extras *extras, uint64_t sequence) {
    struct rqp_extras e = extras ? *extras : rqp_default_extras();
    unsigned char *p = (unsigned char *)buf;
    struct timespec ts;
    if ((message_type != RQP_SURE_MSG && message_type != RQP_UNSURE_MSG) || e.mtype < 1 ||
        e.priority < RQP_MIN_PRIORITY || e.priority > RQP_MAX_PRIORITY ||
        (len && payload == NULL)) {
        errno = EINVAL;
        return -1;
    }
    if (cap < RQP_HEADER_SIZE || len > cap - RQP_HEADER_SIZE) {
        errno = EMSGSIZE;
        return -1;
    }
    clock_gettime(CLOCK_REALTIME, &ts);
    memcpy(p, "RQPX", 4);
    p[4] = RQP_RECORD_VERSION;
    p[5] = (unsigned char)message_type;
    rqp_be_(p + 6, 0, 2);                                  /* flags */
    rqp_be_(p + 8, (uint64_t)(uint32_t)queue_key, 8);      /* key_t in the low 32 bits */
    rqp_be_(p + 16, (uint64_t)(uint32_t)getpid(), 4);      /* producer_pid */
    rqp_be_(p + 20, sequence, 8);
    rqp_be_(p + 28, (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec, 8);
    rqp_be_(p + 36, (uint64_t)(int64_t)e.mtype, 8);
    rqp_be_(p + 44, e.expires_at_ms, 8);
    p[52] = (unsigned char)e.priority;
    memset(p + 53, 0, 11);                                 /* reserved */
    if (len)
        memcpy(p + RQP_HEADER_SIZE, payload, len);
    return (ssize_t)(RQP_HEADER_SIZE + len);
}

/* The transmission queue with key `xmit_key` (created if missing, mode 0660, as the agents
 * do): its id for rqp_put(), or -1. */
static inline int rqp_open_transmission_queue(key_t xmit_key) {
    return msgget(xmit_key, IPC_CREAT | 0660);
}

/* Tell the sending MCA of `xmit_key` there is work (best effort: 0 even if none runs). */
static inline int rqp_ring_doorbell(key_t xmit_key) {
    struct sembuf op = {RQP_DOORBELL, 1, IPC_NOWAIT};
    int id = semget(xmit_key, 3, 0);
    if (id >= 0)
        (void)semop(id, &op, 1); /* full (at its maximum) or gone: the sender looks anyway */
    return 0;
}

/* Put one message for queue `queue_key` on transmission queue `xmit_id` (from
 * rqp_open_transmission_queue) and ring the doorbell of `xmit_key`. msgflg as for msgsnd:
 * 0 waits while the transmission queue is full, IPC_NOWAIT fails with EAGAIN. */
static inline int rqp_put(int xmit_id, key_t xmit_key, int message_type, key_t queue_key,
                          const void *payload, size_t len, const struct rqp_extras *extras,
                          uint64_t sequence, int msgflg) {
    size_t size = RQP_HEADER_SIZE + len;
    long *msg = (long *)malloc(sizeof(long) + size);
    ssize_t n;
    int rc, saved;
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
    do {
        rc = msgsnd(xmit_id, msg, (size_t)n, msgflg);
    } while (rc < 0 && errno == EINTR);
    saved = errno;
    free(msg);
    if (rc < 0) {
        errno = saved;
        return -1;
    }
    return rqp_ring_doorbell(xmit_key);
}

/* Take one message from local queue `queue_key` as msgrcv's msgtyp selects it (0: the first;
 * > 0: the first of that type; < 0: the first of the lowest type up to -msgtyp) into buf (cap
 * bytes); its length, and its type in *mtype if not NULL; or -1 (ENOMSG with IPC_NOWAIT and
 * nothing there, ENOENT: no such queue). */
static inline ssize_t rqp_receive(key_t queue_key, void *buf, size_t cap, long msgtyp,
                                  long *mtype, int msgflg) {
    long *msg;
    ssize_t n;
    int saved, id = msgget(queue_key, 0);
    if (id < 0)
        return -1;
    msg = (long *)malloc(sizeof(long) + cap);
    if (msg == NULL)
        return -1;
    do {
        n = msgrcv(id, msg, cap, msgtyp, msgflg);
    } while (n < 0 && errno == EINTR);
    saved = errno;
    if (n >= 0) {
        memcpy(buf, msg + 1, (size_t)n);
        if (mtype)
            *mtype = msg[0];
    }
    free(msg);
    errno = saved;
    return n;
}

#endif /* RQP_H */
