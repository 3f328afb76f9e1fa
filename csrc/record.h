/*
 * record.h - the request record: what a worker puts in each request's
 * timer and the request-timeout driver reads back.  The one place its
 * layout, kinds, flags and limits are written: shmwheel._fast packs it
 * from here, and Python takes these numbers from the cffi module, which
 * is built with this header (shmwheel/contrib/_record.py; its struct's
 * offsets are checked against these by tests/test_layout.py).
 *
 * A record is the head below, then the method, the request id and the
 * path (UTF-8, the path cut to fit), little-endian, in a payload of at
 * most SHMW_REQ_PAYLOAD_SIZE bytes.
 */
#ifndef SHMWHEEL_RECORD_H
#define SHMWHEEL_RECORD_H

#include <stddef.h>
#include <stdint.h>

struct shmw_request_head {
    uint8_t  kind;              /* SHMW_REQ_KIND_*: a request, a follow-up of the driver's, a worker's word */
    uint8_t  method_len;        /* bytes */
    uint8_t  request_id_len;    /* bytes */
    uint8_t  flags;             /* SHMW_REQ_TRUNCATED ... SHMW_REQ_INTERRUPT */
    uint32_t pid;               /* the worker's */
    uint64_t start;             /* the worker's start time, clock ticks since boot (/proc/PID/stat) */
    int64_t  started_ns;        /* the request's start, CLOCK_MONOTONIC */
    uint64_t thread;            /* the OS thread that runs it (the original, not gevent's patched one) */
    uint64_t task;              /* its asyncio task or greenlet, id(), or 0.  A request whose client sent
                                 * no id has none here: the worker's pid and the request's start stand in */
    uint8_t  stack_signal;      /* the worker writes the request's own stack on it (0: it cannot be asked);
                                 * a real-time one where one is free, on which the driver's asks queue,
                                 * each with its value, else the traceback signal, on which one that comes
                                 * while another is pending is merged with it */
    uint8_t  dump_signal;       /* faulthandler writes every thread's stack on it, when no Python can run
                                 * in the worker (0: none) */
    uint16_t magic;             /* SHMW_REQ_MAGIC: a payload of another kind is never read as a request */
    uint32_t timeout_ms;        /* the timeout, after the start (0: this timer is the timeout); a WARN
                                 * timer's driver adds the timeout stage for then */
    uint32_t queued_ms;         /* how long it queued before its worker took it, by the proxy's
                                 * X-Request-Start, rounded up: started_ns is that much earlier than the
                                 * worker's own start.  The driver times a kill from the worker's own
                                 * start, so that no header makes it sooner */
} __attribute__((packed));

#define SHMW_REQ_PAYLOAD_SIZE    256    /* bytes a timer of a request wheel carries: a path of about 180 */
#define SHMW_REQ_HEAD_SIZE       52
#define SHMW_REQ_MAGIC           0x7273 /* "sr" */
#define SHMW_REQ_MAX_METHOD      32
#define SHMW_REQ_MAX_REQUEST_ID  64
#define SHMW_REQ_MAX_TIMEOUT_MS  0xFFFFFFFFu   /* a longer timeout is written as this, about 49 days */

/* Kinds. */
#define SHMW_REQ_KIND_REQUEST    1      /* a request's own timer, added by its worker */
#define SHMW_REQ_KIND_KILL       2      /* the driver's follow-up: SIGKILL, kill_after after kill_signal */
#define SHMW_REQ_KIND_GRACEFUL   3      /* the driver's follow-up: kill_signal, once the stack is written */
#define SHMW_REQ_KIND_CHECK      4      /* the driver's follow-up: did the worker write the stack it was asked for? */
#define SHMW_REQ_KIND_ANSWER     5      /* the worker's: it has written the stack of the request this names */
#define SHMW_REQ_KIND_FINISHED   6      /* the worker's: the request this names has finished, after its timer fired */
#define SHMW_REQ_KIND_TIMEOUT    7      /* the driver's follow-up: the timeout stage of a request warned first */
#define SHMW_REQ_KIND_GRACE      8      /* the driver's follow-up: has the request it interrupted ended? */
#define SHMW_REQ_KIND_RELEASED   9      /* the worker's: the request this names was given a new timer, or none,
                                         * after this one fired */
#define SHMW_REQ_KIND_LATE       10     /* the worker's, to a driver it has not told before: the request this
                                         * names still runs past its timeout, which a driver that died asked about */
#define SHMW_REQ_KIND_END        11     /* an operator's (shmwheel end): end the request this names now, as its
                                         * timeout would; the wheel's owner or root, which the driver checks */
#define SHMW_REQ_KIND_END_KILL   12     /* the same, and its worker's kill stage if it has not ended in its grace */

/* Flags. */
#define SHMW_REQ_TRUNCATED       1      /* the path was cut to fit */
#define SHMW_REQ_TASK            2      /* `task` is an asyncio task's id */
#define SHMW_REQ_GREENLET        4      /* `task` is a greenlet's id */
#define SHMW_REQ_WARN            8      /* the timer is the warn_after stage: the timeout is timeout_ms after the start */
#define SHMW_REQ_INTERRUPT       16     /* at its timeout, the worker ends the request itself when asked */

/* Where the fields are, for Python's struct (the compiler's word). */
#define SHMW_REQ_AT_FLAGS        offsetof(struct shmw_request_head, flags)
#define SHMW_REQ_AT_STARTED      offsetof(struct shmw_request_head, started_ns)
#define SHMW_REQ_AT_THREAD       offsetof(struct shmw_request_head, thread)
#define SHMW_REQ_AT_TASK         offsetof(struct shmw_request_head, task)
#define SHMW_REQ_AT_STACK_SIGNAL offsetof(struct shmw_request_head, stack_signal)
#define SHMW_REQ_AT_MAGIC        offsetof(struct shmw_request_head, magic)
#define SHMW_REQ_AT_TIMEOUT      offsetof(struct shmw_request_head, timeout_ms)
#define SHMW_REQ_AT_QUEUED       offsetof(struct shmw_request_head, queued_ms)

_Static_assert(sizeof(struct shmw_request_head) == SHMW_REQ_HEAD_SIZE, "the request record's head");
_Static_assert(SHMW_REQ_HEAD_SIZE + SHMW_REQ_MAX_METHOD + SHMW_REQ_MAX_REQUEST_ID < SHMW_REQ_PAYLOAD_SIZE,
               "room for a path");

#endif
