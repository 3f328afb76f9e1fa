/*
 * core.h - what the units of the C core share: the segment's layout and
 * structs, the process-private view of it, the store macros, the inline
 * accessors, and the functions one unit calls in another (prefix shmw__).
 * Nothing here is part of the ABI: shmwheel.h is.
 *
 * The wheel: `levels` levels of W = 2^wheel_bits buckets; level l buckets
 * cover W^l ticks each, and a timer goes into the lowest level whose window
 * of W buckets ahead of that level's clock holds it.  With W = 256 and a
 * 1 ms tick:
 *
 *   level  a bucket covers   the level's window
 *     0    1 ms              255 ms
 *     1    256 ms            65 s
 *     2    65.5 s            4.6 h
 *     3    4.6 h             49 days
 *     4    49 days           34.7 years
 *     5    34.7 years        8,900 years
 *
 * A min-heap of the non-empty buckets (the delay-heap) lets the clock jump
 * between them.  Timers are entries of a slab, linked by slab index
 * (SHMW_NIL ends a list); each bucket keeps one list per lane, and each
 * lane has a magazine of free entries.
 *
 * A segment is S shards, each such a wheel of its own over its part of
 * the slab, with its own lock, so that producers on different CPUs share
 * no lock and no written cache line: a producer adds to the shard of its
 * producer id (shard_of_producer), in the lane of its id (lane_of); a
 * handle names its entry's index in the whole slab, which names the
 * shard.  The segment, from offset 0:
 *
 *   struct shmw_top                          identity, producer table, the futex words
 *   shard 0, shard 1, ... shard S-1          each `shard_size` bytes, 64-byte aligned:
 *     struct shmw_header                       parameters, clocks, counters, mutex, magazines
 *     struct shmw_bucket[B], uint32_t heap[B]  B = levels << wheel_bits (64-byte aligned)
 *     struct shmw_list[SHMW_LANES][B]          lane k's list of bucket b at k * B + b (64-byte aligned)
 *     slab[capacity]                           `stride` bytes an entry: struct shmw_entry, then the payload
 *   struct shmw_users                        its users' counters and note (64-byte aligned)
 *
 * Every function of the core that works on a wheel takes a shard's view
 * (shard_t) and locks only that shard; the public calls (shmw_t) pick the
 * shard, or go through them in turn.
 *
 * Everything in the segment is untrusted: any process that maps it can
 * scribble on it.  Parameters are copied to the views at open and bounds
 * are checked against the copies; every index read back is checked before
 * it is used; every walk is bounded.
 */
#ifndef SHMWHEEL_CORE_H
#define SHMWHEEL_CORE_H

#include "shmwheel.h"

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

typedef struct shard shard_t;   /* one shard's view (below) */

#define SHMW_NIL            0xffffffffU       /* no slab index: ends a list */
#define SHMW_NO_PRODUCER    0xffffU           /* an entry added by no attached process */
#define SHMW_LANES          8U                /* lists a bucket, magazines a segment */
#define SHMW_MAGAZINE       32U               /* free entries a magazine takes or gives back at a time */
#define SHMW_LOCK_WORK      4096U             /* entries moved or fired per lock hold */
#define SHMW_LOCK_SPINS     200U              /* looks at a busy lock before sleeping on it */
#define SHMW_TRY_SPINS      32U               /* looks at a busy lock before a try gives up (SHMW_EBUSY):
                                               * about one producer's hold, and the caller keeps the GIL */
#define SHMW_MAX_SLEEP_NS   100000000LL       /* the driver's clock wakes at least this often */
#define SHMW_BUSY_RETRY_NS  50000LL           /* the driver's first look again at a shard whose lock was busy,
                                               * doubled each time it still is, up to SHMW_MAX_SLEEP_NS */

/* Header flags. */
#define SHMW_F_DAMAGED  1   /* a lock holder died and a repair could not make sense of the
                             * segment: every operation fails with SHMW_ECORRUPT */

/* Entry states. */
#define SHMW_FREE     0   /* on the shared free list or a magazine */
#define SHMW_PENDING  1   /* in a bucket */
#define SHMW_RETIRED  2   /* generations used up, or quarantined: never handed out again */
#define SHMW_INFLIGHT 3   /* fired by the driver, not yet acknowledged */

/* Entry flags: SHMW_REDELIVERED, SHMW_CANCEL_ON_EXIT and SHMW_KEPT (shmwheel.h), and */
#define SHMW_SENT     4   /* in flight and handed to the driver's dispatcher or writer, so
                           * that a rebuilt in-flight list does not hand it out again */

/* ---- cffi begin ----------------------------------------------------------
 * The white-box tests' module reads these structs (csrc/build_shmwheel.py
 * keeps the fields cffi can name and lets the compiler place them). */

/* A magazine: a LIFO of free entries that only its lane's processes take
 * from (and the driver's acks give to, in the driver's lane). */
struct shmw_magazine {
    uint32_t free_head;         /* first entry or NIL */
    uint32_t free_count;        /* entries on it, at most 2 * SHMW_MAGAZINE - 1 between operations */
} __attribute__((aligned(64)));

/* An attached process, so that stats can list it and the driver can cancel
 * the SHMW_CANCEL_ON_EXIT timers of one that is gone.  pid 0: a free id. */
struct shmw_producer {
    int32_t  pid;               /* as its own PID namespace numbers it */
    uint32_t pidns;             /* that namespace: the inode of /proc/PID/ns/pid (0: unknown) */
    int64_t  start;             /* its start time: /proc/PID/stat field 22, ticks since boot */
};

/* The segment's first bytes: what its shards share.  Written at create,
 * but for the producer table, whose row g is written under the lock of
 * shard g % shards (so that an attach locks only its own shard), and the
 * counters and futex words, which are changed with atomics. */
struct shmw_top {
    uint64_t magic;             /* SHMW_MAGIC, stored last at create */
    uint32_t version;           /* SHMW_LAYOUT_VERSION */
    uint32_t top_size;          /* ABI signature: sizeof(struct shmw_top) */
    uint32_t shards;            /* S, at least 1 */
    uint32_t shard_capacity;    /* slab entries a shard: the capacity is S times this */
    uint64_t shard_size;        /* bytes a shard: its header, wheel and slab */
    uint64_t segment_size;      /* bytes, as computed by shmw_segment_size */
    uint32_t next_shard;        /* an attach's shard, round robin (atomic) */
    uint32_t _pad;

    struct shmw_producer producers[SHMW_MAX_PRODUCERS];   /* by producer id */

    /* Futex words, each on a line of its own.  Changed with atomics under
     * a shard's mutex and waited on outside it; the waker calls
     * FUTEX_WAKE after unlocking, so no system call runs under a lock, and
     * no wake-up is lost because the waiter passes the value it read
     * before it looked at the shards to FUTEX_WAIT. */
    uint32_t wake_word __attribute__((aligned(64)));     /* a producer bumps it to wake the clock */
    uint32_t outbox_word __attribute__((aligned(64)));   /* the clock bumps it to wake the dispatcher or writer */
    uint32_t _pad2;
    int64_t  passed_ns;         /* CLOCK_MONOTONIC when the clock last passed over the shards:
                                 * its heartbeat (it locks only the shards it must) */
} __attribute__((aligned(64)));

/* What its users keep in a segment for each other (shmw_count,
 * shmw_set_note), after the last shard: the driver's process writes it,
 * never a producer's path, so it moves no shard from where it would be
 * without it (a shard's header lines sit where they did before it was
 * there: measured, a producer's path notices). */
struct shmw_users {
    uint64_t counters[SHMW_COUNTERS];   /* atomics */
    uint32_t note_len;          /* under shard 0's lock, as the note */
    uint32_t _pad;
    char     note[SHMW_NOTE_SIZE];
} __attribute__((aligned(64)));

/* A shard's header: a whole wheel of its own, over its part of the slab. */
struct shmw_header {
    /* Identity: checked at open. */
    uint64_t magic;             /* SHMW_MAGIC, stored last at create */
    uint32_t version;           /* SHMW_LAYOUT_VERSION */
    uint32_t header_size;       /* ABI signature: sizeof(struct shmw_header) */
    uint32_t entry_size;        /*   sizeof(struct shmw_entry) */
    uint32_t bucket_size;       /*   sizeof(struct shmw_bucket) */
    uint32_t mutex_size;        /*   sizeof(pthread_mutex_t) */
    uint32_t refused;           /* fires the driver's handler refused to act on (their
                                 * records named a process it may not signal),
                                 * saturating; under the mutex.  (0 in a segment made
                                 * before it was counted: the same layout) */

    /* Parameters: fixed at create, copied to private memory at open. */
    uint64_t segment_size;      /* bytes of this shard: the top's shard_size */
    int64_t  tick_ns;           /* length of a tick */
    uint32_t capacity;          /* slab entries of this shard */
    uint32_t payload_size;      /* payload bytes an entry */
    uint32_t wheel_bits;        /* W = 1 << wheel_bits buckets a level */
    uint32_t levels;            /* derived from tick_ns and wheel_bits */
    uint32_t index_bits;        /* handle bits that hold the slab index: of the whole slab's */
    uint32_t stride;            /* bytes a slab entry */
    int64_t  created_ns;        /* CLOCK_MONOTONIC at create */
    int32_t  creator_pid;
    uint32_t reserve;           /* the last free entries, for SHMW_RESERVED adds (0 in a
                                 * segment made before there was a reserve: the same layout) */
    uint64_t handle_key;        /* XORed into the generation bits of every handle: the same in every shard */
    uint32_t shard;             /* this shard's place: its entries are slab indices
                                 * [shard * capacity, (shard + 1) * capacity) */
    uint32_t shards;            /* as the top's */

    /* Mutable state: read and written under the mutex only. */
    uint64_t elapsed;                      /* wheel clock, in ticks */
    uint64_t level_clock[SHMW_MAX_LEVELS]; /* elapsed rounded down to W^l */
    uint32_t retired;           /* entries whose generations ran out, or quarantined */
    uint32_t heap_len;          /* buckets in the delay-heap */
    uint32_t flags;             /* SHMW_F_* */
    uint32_t removed;           /* 1 once the segment is removed from its name or
                                 * replaced: adds fail with SHMW_EREMOVED, so that
                                 * producers attach to the wheel the name has now */
    uint64_t fired;             /* counters since create (added and */
    uint64_t resets;            /* cancelled are next to the mutex) */
    uint64_t quarantined;       /* entries a repair found nonsensical and retired */
    uint64_t repairs;           /* repairs after a check or an operation found corruption */

    /* The driver (under the mutex).  A fired timer stays in its entry, in
     * state SHMW_INFLIGHT on a FIFO list, until its handler has run and it
     * is acknowledged; `inflight_unsent` is the first entry not yet handed
     * out (to the dispatcher, or written to the consumer's fd).  A driver
     * that takes over from a dead one marks every entry in flight
     * redelivered and sends them all again. */
    int32_t  driver_pid;        /* 0: no driver registered */
    uint32_t driver_state;      /* SHMW_DRIVER_* */
    int64_t  driver_start;      /* its start time, as a producer's */
    uint64_t sleep_until;       /* tick the clock sleeps until; 0 while awake */
    int64_t  advanced_ns;       /* CLOCK_MONOTONIC when the clock last advanced */
    uint32_t inflight_head;     /* oldest entry in flight or NIL */
    uint32_t inflight_tail;     /* newest entry in flight or NIL */
    uint32_t inflight_unsent;   /* first entry not yet handed out, or NIL */
    uint32_t inflight;          /* entries in flight */
    uint64_t acked;
    uint64_t redelivered;
    uint64_t handler_errors;
    uint64_t recoveries;        /* repairs after a lock holder died */

    /* Process-shared, robust, and on one 64-byte line with everything an
     * add or a cancel writes in the header every time (40 + 24 bytes with
     * glibc on x86-64), so that a producer pulls one header line from the
     * last one's CPU, not four.  (heap_len, on another line, is written
     * too when an add makes a bucket non-empty or a cancel empties one.)
     * Timers pending, in all and per level, are worked out when asked for:
     * pending = capacity - free - retired - in flight, and the levels from
     * the counts of the non-empty buckets. */
    pthread_mutex_t mutex __attribute__((aligned(64)));
    uint32_t free_head;         /* the shared free list: first entry or NIL */
    uint32_t free_count;        /* free entries in all: the shared list and the magazines */
    uint64_t added;             /* counters since create */
    uint64_t cancelled;

    /* Each lane's magazine of free entries, on a line of its own. */
    struct shmw_magazine magazines[SHMW_LANES];
};

/* What the lanes of a bucket share: written only when the bucket, or one
 * of its lane lists, turns empty or non-empty. */
struct shmw_bucket {
    uint64_t expires;           /* tick the bucket comes due at, while non-empty */
    uint32_t heap_pos;          /* index in the delay-heap or NIL when empty */
    uint32_t lane_mask;         /* bit k: lane k's list is non-empty; 0: the bucket is empty */
};

/* One lane's list of one bucket. */
struct shmw_list {
    uint32_t head;              /* first entry or NIL */
    uint32_t tail;              /* last entry or NIL: appends keep add order */
    uint32_t count;             /* entries in the list */
};

struct shmw_entry {
    int64_t  deadline_ns;       /* exactly as asked, CLOCK_MONOTONIC */
    uint64_t generation;        /* handle = (generation ^ key) << index_bits | index */
    int64_t  fired_at_ns;       /* when the driver fired it (in flight) */
    uint32_t next;              /* bucket, free or in-flight list; NIL ends */
    uint32_t prev;              /* bucket or in-flight list */
    uint32_t bucket;            /* bucket index while pending, else NIL */
    uint8_t  state;             /* SHMW_FREE, _PENDING, _RETIRED or _INFLIGHT */
    uint8_t  flags;             /* SHMW_REDELIVERED, SHMW_CANCEL_ON_EXIT, SHMW_SENT, SHMW_KEPT */
    uint16_t producer;          /* the adder's producer id, or SHMW_NO_PRODUCER;
                                 * its lane is the entry's lane */
    int32_t  owner_pid;         /* process that added the timer */
    uint32_t payload_len;       /* bytes of payload in use */
    /* payload_size bytes of payload follow */
};

/* ---- cffi end ------------------------------------------------------------ */

/* Division of a slab index by a constant divisor d (1 <= d < 2^31), by
 * a multiply and a shift (Granlund and Montgomery's, for 32-bit
 * dividends: m = ceil(2^(32 + l) / d) with l = ceil(log2 d) is exact for
 * every n < 2^32, and n * m < 2^64 for n < 2^31): a division takes some
 * 25 cycles on the request path, this 4. */
struct shmw_divisor {
    uint64_t magic;
    uint32_t shift;
};

static inline void shmw__divisor(struct shmw_divisor *v, uint32_t d)
{
    uint32_t l = 0;

    while ((1ULL << l) < d)
        l++;
    v->shift = 32 + l;
    v->magic = (uint64_t)((((unsigned __int128)1 << v->shift) + d - 1) / d);
}

static inline uint32_t shmw__divide(uint32_t n, const struct shmw_divisor *v)
{
    return (uint32_t)((n * v->magic) >> v->shift);
}

/* A process's view of one shard of an open segment.  Private copies of
 * the parameters: bounds are checked against these, never against the
 * segment.  Its slab indices are its own, from 0; a handle holds the
 * index in the whole slab, index_base more (handle_of, handle_index). */
struct shard {
    char                *base;          /* the shard's first byte: its header */
    struct shmw_header  *hdr;
    struct shmw_top     *top;
    struct shmw_bucket  *buckets;
    uint32_t            *heap;
    struct shmw_list    *lists;
    char                *slab;
    uint32_t            *wake_word;     /* the top's */
    uint32_t            *outbox_word;   /* the top's */
    uint64_t             size;
    int64_t              tick_ns;
    uint32_t             capacity;      /* this shard's */
    uint32_t             payload_size;
    uint32_t             wheel_bits;
    uint32_t             wheel_mask;
    uint32_t             levels;
    uint32_t             nbuckets;
    uint32_t             index_bits;
    uint32_t             stride;
    uint32_t             reserve;       /* the header's, checked to be below capacity */
    uint32_t             index_base;    /* shard * capacity */
    uint32_t             shard;
    uint32_t             shards;
    uint64_t             max_generation;
    uint64_t             handle_key;    /* the header's, masked to the generation bits */
    int64_t              lock_timeout_ns;
    uint32_t             producer;      /* this process's producer id, or SHMW_NO_PRODUCER */
    pid_t                producer_pid;  /* the pid that id was taken for (fork changes it) */
    uint32_t             fire_lane;     /* the clock's: the lane a due bucket's next entry is
                                         * looked for from, each lane in turn (see advance) */
    uint64_t             due;           /* the clock's: the tick its earliest bucket was due at
                                         * when it last looked, UINT64_MAX for none */
    int64_t              clock_retry_ns;  /* the clock's: its lock was busy; not looked at before this */
    int64_t              clock_backoff_ns;
    int64_t              take_retry_ns;   /* the same, the dispatcher's */
    int64_t              take_backoff_ns;
    int64_t              busy_since_ns;   /* the clock's: when its lock was first found busy, 0 since taken */
    int64_t              take_busy_since_ns; /* the same, the dispatcher's */
    int64_t              timed_out_ns;    /* when a lock of this process last timed out on this shard */
    uint32_t             wake_after_unlock; /* a repair under the lock moved the heap: FUTEX_WAKE the clock */
};

/* A process's view of an open segment: the shmw_t of the public calls. */
struct shmw {
    struct shmw_top     *top;
    struct shmw_users   *users;         /* after the last shard */
    uint64_t             size;
    uint32_t             shards;
    uint32_t             capacity;      /* shards * shard_capacity */
    uint32_t             shard_capacity;
    uint32_t             payload_size;
    uint32_t             index_bits;
    uint64_t             index_mask;    /* (1 << index_bits) - 1 */
    struct shmw_divisor  by_shard;      /* a slab index by shard_capacity: its shard */
    uint32_t             producer;      /* as each shard's view has it */
    pid_t                producer_pid;
    shard_t             *home;          /* producer's shard */
    uint32_t             take_from;     /* the dispatcher's: the shard its next take looks at first */
    struct shard         shard[];       /* `shards` of them */
};

#define ALIGN_UP(x, a) (((x) + (uint64_t)(a) - 1) & ~((uint64_t)(a) - 1))

/* ---- stores ----------------------------------------------------------------
 * Every store to the segment goes through STORE, or COMMIT for the store
 * that commits an entry or a producer id (its state, its pid).  COMMIT is a
 * release store: everything written before it - the entry's own fields -
 * reaches memory first, which is what makes a half-made change repairable
 * after a real SIGKILL.  The other stores are links and counters that the
 * repair rebuilds, so their order does not matter and the compiler may keep
 * them in registers.  The core built for the tests (SHMW_TESTING) has a
 * crash point before each store (csrc/testing.c): a test can stop an
 * operation at every step and check what the next locker makes of it. */

#ifdef SHMW_TESTING
extern long shmw__crash_countdown;
void shmw__crash_now(void);
#define CRASH_POINT() do {                                                      \
        if (__builtin_expect(shmw__crash_countdown > 0, 0) && --shmw__crash_countdown == 0) \
            shmw__crash_now();                                                  \
    } while (0)
#else
#define CRASH_POINT() ((void)0)
#endif

/* The clock's longest sleep: SHMW_MAX_SLEEP_NS, but in the tests' build a
 * variable that shard_test_clock_cap (testing.h) may stretch, so that a test
 * can tell a clock that a producer woke from one that its cap woke. */
#ifdef SHMW_TESTING
extern int64_t shmw__clock_cap_ns;
#define CLOCK_CAP_NS() __atomic_load_n(&shmw__clock_cap_ns, __ATOMIC_RELAXED)
#else
#define CLOCK_CAP_NS() SHMW_MAX_SLEEP_NS
#endif

#define STORE(lhs, rhs) do {                    \
        CRASH_POINT();                          \
        (lhs) = (rhs);                          \
    } while (0)

#define COMMIT(lhs, rhs) do {                                   \
        CRASH_POINT();                                          \
        __atomic_store_n(&(lhs), (rhs), __ATOMIC_RELEASE);      \
    } while (0)

/* ---- accessors ------------------------------------------------------------ */

/* This process's pid, cached (getpid() is a system call on current glibc)
 * and refreshed in the child after fork (segment.c). */
extern pid_t shmw__pid;

static inline struct shmw_entry *entry_at(const shard_t *w, uint32_t i)
{
    return (struct shmw_entry *)(w->slab + (uint64_t)i * w->stride);
}

/* A producer's lane in its shard, and its shard: ids come in blocks of
 * SHMW_LANES, block b in shard b modulo the shards (attach hands the
 * blocks round them), so that a shard's first producers each have a lane
 * of their own and the request path never divides. */
static inline uint32_t lane_of(uint32_t producer)
{
    return producer % SHMW_LANES;
}

static inline uint32_t shard_of_producer(uint32_t shards, uint32_t producer)
{
    return producer / SHMW_LANES % shards;
}

static inline struct shmw_list *list_of(const shard_t *w, uint32_t lane, uint32_t b)
{
    return &w->lists[(uint64_t)lane * w->nbuckets + b];
}

/* The producer id this process's timers are filed under: its own, or none
 * in a child forked since attach (it shares no id with its parent). */
static inline uint16_t my_producer(const shard_t *w)
{
    return (uint16_t)(w->producer_pid == shmw__pid ? w->producer : SHMW_NO_PRODUCER);
}

/* A handle from a slab index and the generation bits, and back.  The
 * caller has checked that the entry's generation is at most max_generation
 * (shmw__entry_sane), which keeps the handle below 2^63. */
static inline int64_t handle_of(const shard_t *w, uint32_t i)
{
    return (int64_t)((entry_at(w, i)->generation ^ w->handle_key) << w->index_bits | (i + w->index_base));
}

/* The shard's slab index a handle names (maybe out of bounds, or of
 * another shard, which wraps to one: the caller checks). */
static inline uint32_t handle_index(const shard_t *w, int64_t handle)
{
    return (uint32_t)((uint64_t)handle & ((1ULL << w->index_bits) - 1)) - w->index_base;
}

/* The shard a handle names, or NULL if none: the caller checks the rest
 * (of one shard, the index too).  No division for a wheel of one. */
static inline shard_t *shard_of(shmw_t *w, int64_t handle)
{
    uint32_t k;

    if (w->shards == 1)
        return &w->shard[0];
    k = shmw__divide((uint32_t)((uint64_t)handle & w->index_mask), &w->by_shard);
    return k < w->shards ? &w->shard[k] : NULL;
}

/* The shard this process adds to: its producer id's (set at attach), or
 * else (not attached, or a child forked since) its pid's. */
static inline shard_t *home_of(shmw_t *w)
{
    if (w->producer_pid == shmw__pid)
        return w->home;
    return &w->shard[(uint32_t)shmw__pid % w->shards];
}

/* The generation a handle expects at its index. */
static inline uint64_t handle_generation(const shard_t *w, int64_t handle)
{
    return ((uint64_t)handle >> w->index_bits) ^ w->handle_key;
}

/* Bytes a fire record takes: struct shmw_fire, then the payload rounded up to 8. */
static inline uint32_t record_stride(const shard_t *w)
{
    return (uint32_t)(sizeof(struct shmw_fire) + ALIGN_UP(w->payload_size, 8));
}

/* A tick as a CLOCK_MONOTONIC time, saturated: a tick read back from the
 * segment may be anything, and a product that wrapped negative would read
 * as "no deadline" to a futex wait. */
static inline int64_t ticks_to_ns(const shard_t *w, uint64_t t)
{
    return t > (uint64_t)INT64_MAX / (uint64_t)w->tick_ns ? INT64_MAX : (int64_t)(t * (uint64_t)w->tick_ns);
}

/* ---- between the units ----------------------------------------------------
 * Every function here expects the lock held unless its comment says not. */

/* segment.c */
void shmw__pid_init(void);                      /* once a process, before the pid is read; no lock */

/* lock.c: take the lock (repairing after a holder that died); shmw__lock
 * also refuses a segment flagged damaged.  `wait` is SHMW_LOCK_WAIT, or
 * SHMW_LOCK_TRY (the _try forms: SHMW_EBUSY after SHMW_TRY_SPINS looks at
 * a lock another holds) or SHMW_LOCK_SPIN (the same after SHMW_LOCK_SPINS). */
#define SHMW_LOCK_TRY  0
#define SHMW_LOCK_WAIT 1
#define SHMW_LOCK_SPIN 2
int  shmw__lock_raw(shard_t *w, int wait);
int  shmw__lock_mode(shard_t *w, int wait);
static inline int shmw__lock(shard_t *w) { return shmw__lock_mode(w, 1); }
void shmw__unlock(shard_t *w);
/* A call on many handles (wheel.c): op(shard, handle, arg) for each
 * handle, shard by shard, each shard's lock taken once for the handles it
 * holds; the sum of what op returned, or the first error, which ends the
 * call (the caller tries again: what was done stays done).  SHMW_EHANDLE
 * before any lock if a handle is negative (no handle is). */
int  shmw__by_shard(shmw_t *w, const int64_t *handles, uint32_t n, int (*op)(shard_t *, int64_t, void *), void *arg);
int  shmw__wake_for(shard_t *w, uint64_t expires);
void shmw__futex_wake_all(uint32_t *word);                  /* no lock */
void shmw__futex_wait_until(uint32_t *word, uint32_t seen, int64_t deadline_ns);   /* no lock */

/* slab.c: entries and magazines. */
uint32_t shmw__lookup(const shard_t *w, int64_t handle, uint8_t state);
int  shmw__entry_sane(const shard_t *w, const struct shmw_entry *e);
int  shmw__slab_take(shard_t *w, uint32_t lane, int reserved, uint32_t *out);
void shmw__slab_free(shard_t *w, uint32_t i, uint64_t *count);

/* wheel.c: buckets and the advance. */
int  shmw__place(const shard_t *w, uint64_t elapsed, uint64_t t, uint32_t *bucket, uint64_t *expires);
int  shmw__bucket_append(shard_t *w, uint32_t b, uint64_t expires, uint32_t i);
int  shmw__list_unlink(shard_t *w, uint32_t *head, uint32_t *tail, uint32_t i);
int  shmw__cancel_entry(shard_t *w, uint32_t i);
void shmw__set_elapsed(shard_t *w, uint64_t t, int64_t now_ns);
int  shmw__advance(shard_t *w, uint64_t now_tick, int64_t now_ns, uint32_t max, char *records,
                   uint32_t *fired, int *more);

/* driver.c: the in-flight FIFO; and (no lock held on entry) a shard's
 * registration left by one cut short, cleared if shard 0 names no driver. */
int  shmw__clear_leftover(shmw_t *w, shard_t *s);
int  shmw__inflight_can_take(const shard_t *w);
void shmw__inflight_append(shard_t *w, uint32_t i);
int  shmw__inflight_audit(const shard_t *w, char *reason, uint32_t reason_len);
int  shmw__ack_entry(shard_t *w, uint32_t i);
int  shmw__inflight_drain(shard_t *w, uint32_t max, char *records, uint32_t *n);
void shmw__write_record(const shard_t *w, uint32_t i, char *rec);

/* stats.c */
uint32_t shmw__pending_locked(const shard_t *w);

/* recovery.c and check.c */
int  shmw__repair_locked(shard_t *w, int64_t clock_limit_ns, char *reason, uint32_t reason_len);
int  shmw__check_locked(shard_t *w, char *reason, uint32_t reason_len);
/* What a shard's check or repair said, with the shard named if there are many. */
void shmw__name_shard(const shmw_t *w, uint32_t k, const char *said, char *reason, uint32_t reason_len);

#endif /* SHMWHEEL_CORE_H */
