/*
 * shmwheel.h - a hierarchical timing wheel that lives in one POSIX
 * shared-memory segment and is shared by every process that maps it: the
 * segment's structs, its constants and the C API.  The design, with its
 * reasons, is in docs/design.md.
 *
 * In short: `levels` levels of W = 2^wheel_bits buckets; level l buckets
 * cover W^l ticks each (W=256, 1 ms tick: 1 ms, 256 ms, 65.5 s, 4.6 h,
 * 49 days, 34.7 years), and a timer goes into the lowest level whose window
 * of W buckets ahead of that level's clock holds it.  A min-heap of the
 * non-empty buckets lets the clock jump between them.  Timers are slots of
 * a slab, linked by index (SHMW_NIL ends a list); each bucket keeps one list
 * per lane.  Byte layout from offset 0 (with its alignment in docs/design.md):
 *
 *   struct shmw_header                       parameters, clocks, counters, mutex
 *   struct shmw_bucket[B], uint32_t heap[B]  B = levels << wheel_bits
 *   struct shmw_list[SHMW_LANES][B]          lane k's list of bucket b at k * B + b
 *   slab[capacity]                           `stride` bytes a slot: entry, payload
 */
#ifndef SHMWHEEL_H
#define SHMWHEEL_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#define SHMW_MAGIC          0x6c656568776d6873ULL  /* "shmwheel", little-endian */
#define SHMW_LAYOUT_VERSION 6

/* Geometry. */
#define SHMW_MIN_WHEEL_BITS 4                 /* 16 buckets a level */
#define SHMW_MAX_WHEEL_BITS 12                /* 4096 buckets a level */
#define SHMW_MAX_LEVELS     16                /* enough for 1 us ticks at 16 a level */
#define SHMW_MIN_TICK_NS    1000LL            /* 1 us */
#define SHMW_MAX_TICK_NS    60000000000LL     /* 60 s */
#define SHMW_MAX_CAPACITY   0x7fffffffU       /* indices are uint32_t; NIL is reserved */
#define SHMW_MAX_PAYLOAD    65536U
#define SHMW_MAX_DELAY_NS   (1LL << 62)       /* about 146 years */
#define SHMW_NIL            0xffffffffU
#define SHMW_LOCK_WORK      4096U             /* entries moved or fired per lock hold */
#define SHMW_MAX_SLEEP_NS   100000000LL       /* the driver's clock wakes at least this often */
#define SHMW_MAX_PRODUCERS  1024U             /* attached processes the segment records */
#define SHMW_LOCK_TIMEOUT_NS 10000000000LL    /* a lock not taken in this long is jammed */
#define SHMW_LOCK_SPINS     200U              /* looks at a busy lock before sleeping on it */
#define SHMW_NO_PRODUCER    0xffffU
#define SHMW_LANES          8U                /* lists a bucket, magazines of free slots */
#define SHMW_MAGAZINE       32U               /* free slots a lane takes or gives back at a time */

/* Return codes.  0 is success; everything else is negative and is turned
 * into a Python exception in exactly one place (shmwheel/_binding.py). */
#define SHMW_OK          0
#define SHMW_EINVAL     -1   /* an argument is out of its domain */
#define SHMW_ETIME      -2   /* delay or deadline is NaN, infinite or negative */
#define SHMW_ERANGE     -3   /* delay beyond SHMW_MAX_DELAY_NS */
#define SHMW_EPAYLOAD   -4   /* payload longer than payload_size */
#define SHMW_EFULL      -5   /* no free entry (for a batch: not enough) */
#define SHMW_EHANDLE    -6   /* negative handle */
#define SHMW_ECORRUPT   -7   /* an invariant of the segment does not hold */
#define SHMW_EMAGIC     -8   /* not a shmwheel segment (or not initialised yet) */
#define SHMW_EVERSION   -9   /* another layout version */
#define SHMW_EABI       -10  /* built with other struct sizes */
#define SHMW_ESIZE      -11  /* segment smaller than its header says */
#define SHMW_ELOCK      -12  /* the mutex could not be taken */
#define SHMW_ENOMEM     -13  /* malloc failed (open only) */
#define SHMW_ECLOSED    -14  /* called with a closed (NULL) handle */
#define SHMW_EDRIVER    -15  /* a driver is registered (poll), or another took over */
#define SHMW_EIO        -16  /* writing to the driver's fd failed (errno is kept) */
#define SHMW_EPRODUCER  -17  /* this process has no producer slot (full table, or forked since) */
#define SHMW_EREMOVED   -18  /* the segment was removed from its name or replaced: adds are refused */

/* The exit status of a process stopped by shmw_test_crash_after. */
#define SHMW_CRASH_EXIT 86

/* Header flags. */
#define SHMW_F_DAMAGED  1   /* a lock holder died and left the segment inconsistent:
                             * every operation fails with SHMW_ECORRUPT */

/* Entry states and flags. */
#define SHMW_FREE     0   /* on the free list */
#define SHMW_PENDING  1   /* in a bucket */
#define SHMW_RETIRED  2   /* generations used up: never handed out again */
#define SHMW_INFLIGHT 3   /* fired by the driver, not yet acknowledged */
#define SHMW_REDELIVERED 1 /* entry and fire flag: sent again after a driver died */
#define SHMW_CANCEL_ON_EXIT 2 /* entry and add flag: cancelled when its producer exits */
#define SHMW_SENT        4 /* entry flag: in flight and handed to the driver's dispatcher or
                            * writer, so a rebuilt in-flight list does not hand it out again */

/* Driver states. */
#define SHMW_DRIVER_NONE     0
#define SHMW_DRIVER_RUNNING  1
#define SHMW_DRIVER_STOPPING 2

/* A lane's magazine: a LIFO of free slots that only its own processes
 * take from (and the driver's acks give to, in the driver's lane). */
struct shmw_lane {
    uint32_t free_head;         /* first slot or NIL */
    uint32_t free_count;        /* slots on it, at most 2 * SHMW_MAGAZINE - 1 between operations */
} __attribute__((aligned(64)));

struct shmw_header {
    /* Identity: checked at open. */
    uint64_t magic;             /* SHMW_MAGIC, stored last at create */
    uint32_t version;           /* SHMW_LAYOUT_VERSION */
    uint32_t header_size;       /* ABI signature: sizeof(struct shmw_header) */
    uint32_t entry_size;        /*   sizeof(struct shmw_entry) */
    uint32_t bucket_size;       /*   sizeof(struct shmw_bucket) */
    uint32_t mutex_size;        /*   sizeof(pthread_mutex_t) */
    uint32_t _pad0;

    /* Parameters: fixed at create, copied to private memory at open. */
    uint64_t segment_size;      /* bytes, as computed by shmw_segment_size */
    int64_t  tick_ns;           /* length of a tick */
    uint32_t capacity;          /* slab slots */
    uint32_t payload_size;      /* payload bytes a slot */
    uint32_t wheel_bits;        /* W = 1 << wheel_bits buckets a level */
    uint32_t levels;            /* derived from tick_ns and wheel_bits */
    uint32_t slot_bits;         /* handle bits that hold the index */
    uint32_t stride;            /* bytes a slab slot */
    int64_t  created_ns;        /* CLOCK_MONOTONIC at create */
    int32_t  creator_pid;
    uint32_t _pad1;
    uint64_t handle_key;        /* XORed into the generation bits of every handle */

    /* Mutable state: read and written under the mutex only. */
    uint64_t elapsed;                      /* wheel clock, in ticks */
    uint64_t level_clock[SHMW_MAX_LEVELS]; /* elapsed rounded down to W^l */
    uint32_t retired;           /* slots whose generations ran out */
    uint32_t heap_len;          /* buckets in the delay-heap */
    uint32_t flags;             /* SHMW_F_* */
    uint32_t removed;           /* 1 once the segment is removed from its name or
                                 * replaced: adds fail with SHMW_EREMOVED, so that
                                 * producers attach to the wheel the name has now */
    uint64_t fired;             /* counters since create (added and */
    uint64_t resets;            /* cancelled are next to the mutex) */
    uint64_t quarantined;       /* entries a repair found nonsensical and retired */
    uint64_t repairs;           /* repairs after a check or an operation found corruption */

    /* The driver (under the mutex).  A fired timer stays in its slot, in
     * state SHMW_INFLIGHT on a FIFO list, until its handler has run and it
     * is acknowledged; `inflight_unsent` is the first entry not yet handed
     * out (to the dispatcher, or written to the consumer's fd).  A driver that takes over from a dead one
     * marks every entry in flight redelivered and sends them all again. */
    int32_t  driver_pid;        /* 0: no driver registered */
    uint32_t driver_state;      /* SHMW_DRIVER_* */
    int64_t  driver_start;      /* its start time: /proc/PID/stat field 22, ticks since boot */
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

    /* Attached processes, (pid, start time) - start time as for the
     * driver - so that stat can list them and the driver can cancel the
     * SHMW_CANCEL_ON_EXIT timers of one that is gone.  pid 0: a free slot. */
    struct {
        int32_t  pid;           /* as its own PID namespace numbers it */
        uint32_t pidns;         /* that namespace: the inode of /proc/PID/ns/pid (0: unknown) */
        int64_t  start;
    } producers[SHMW_MAX_PRODUCERS];

    /* Futex words.  Changed with atomics under the mutex and waited on
     * outside it; the waker calls FUTEX_WAKE after unlocking, so no system
     * call runs under the lock, and no wake-up is lost because the waiter
     * passes the value it read under the lock to FUTEX_WAIT. */
    uint32_t wake_word;         /* a producer bumps it to wake the clock */
    uint32_t outbox_word;       /* the clock bumps it to wake the dispatcher or writer */

    /* Process-shared, robust, and on one 64-byte line with everything an
     * add or a cancel writes in the header every time (40 + 24 bytes with
     * glibc on x86-64), so that a producer pulls one header line from the
     * last one's CPU, not four.  (heap_len, on another line, is written
     * too when an add makes a bucket non-empty or a cancel empties one.)
     * What used to be counted on every operation besides - timers
     * pending, in all and per level - is worked out when asked for:
     * pending = capacity - free - retired - in flight, and the levels from
     * the counts of the non-empty buckets. */
    pthread_mutex_t mutex __attribute__((aligned(64)));
    uint32_t free_head;         /* the shared free list: first slot or NIL */
    uint32_t free_count;        /* free slots in all: the shared list and the magazines */
    uint64_t added;             /* counters since create */
    uint64_t cancelled;

    /* Each lane's magazine of free slots, on a line of its own. */
    struct shmw_lane lanes[SHMW_LANES];
};

/* What the lanes of a bucket share: written only when the bucket, or one
 * of its lane lists, turns empty or non-empty. */
struct shmw_bucket {
    uint64_t expires;           /* tick the bucket comes due at, while non-empty */
    uint32_t heap_pos;          /* index in the delay-heap or NIL when empty */
    uint32_t lanes;             /* bit k: lane k's list is non-empty; 0: the bucket is empty */
};

/* One lane's list of one bucket. */
struct shmw_list {
    uint32_t head;              /* first entry or NIL */
    uint32_t tail;              /* last entry or NIL: appends keep add order */
    uint32_t count;             /* entries in the list */
};

struct shmw_entry {
    int64_t  deadline_ns;       /* exactly as asked, CLOCK_MONOTONIC */
    uint64_t generation;        /* handle = generation << slot_bits | index */
    int64_t  fired_at_ns;       /* when the driver fired it (in flight) */
    uint32_t next;              /* bucket, free or in-flight list; NIL ends */
    uint32_t prev;              /* bucket or in-flight list */
    uint32_t bucket;            /* bucket index while pending, else NIL */
    uint8_t  state;             /* SHMW_FREE, _PENDING, _RETIRED or _INFLIGHT */
    uint8_t  flags;             /* SHMW_REDELIVERED, SHMW_CANCEL_ON_EXIT, SHMW_SENT */
    uint16_t producer;          /* the adder's slot in the producer table, or SHMW_NO_PRODUCER;
                                 * its lane (producer % SHMW_LANES) is the entry's lane */
    int32_t  owner_pid;         /* process that added the timer */
    uint32_t payload_len;       /* bytes of payload in use */
    /* payload_size bytes of payload follow */
};

/* ---- cffi begin ----------------------------------------------------------
 * From here to "cffi end", csrc/build_shmwheel.py hands the declarations to
 * cffi's cdef as they stand (array sizes become "..."), so the Python side
 * can never drift from them. */

/* A fire record, as shmw_poll and shmw_drive_take return them and the
 * driver's writer writes them to an external consumer: this struct, then
 * payload_size bytes rounded up to 8, of which payload_len are the
 * payload.  shmw_record_size() gives the stride. */
struct shmw_fire {
    int64_t  handle;
    int64_t  deadline_ns;
    int64_t  fired_at_ns;       /* when the clock fired it */
    int32_t  owner_pid;
    uint32_t payload_len;
    uint32_t flags;             /* SHMW_REDELIVERED */
    uint32_t _pad;
};

/* Everything stats() reports, read under the lock in one go. */
struct shmw_stats {
    uint64_t capacity;
    uint64_t pending;
    uint64_t free;
    uint64_t retired;
    uint64_t added;
    uint64_t cancelled;
    uint64_t fired;
    uint64_t resets;
    uint64_t elapsed;           /* wheel clock, ticks */
    int64_t  tick_ns;
    uint64_t payload_size;
    uint64_t wheel_size;
    uint64_t levels;
    uint64_t buckets_in_heap;
    int64_t  next_expiry_ns;    /* earliest non-empty bucket, -1 if none */
    uint64_t level_pending[SHMW_MAX_LEVELS];
    int64_t  driver_pid;        /* 0 if none */
    int64_t  driver_start;
    uint64_t driver_state;
    uint64_t inflight;
    uint64_t acked;
    uint64_t redelivered;
    uint64_t handler_errors;
    int64_t  advanced_ns;       /* when the clock last advanced */
    int64_t  clock_ns;          /* the wheel clock, elapsed * tick_ns */
    uint64_t recoveries;
    uint64_t repairs;
    uint64_t quarantined;
    uint64_t removed;           /* 1: removed from its name or replaced */
};

/* What create is asked for. */
struct shmw_params {
    uint32_t capacity;
    uint32_t payload_size;
    uint32_t wheel_bits;
    int64_t  tick_ns;
};

/* Process-private view of an open segment (opaque). */
typedef struct shmw shmw_t;

/* Pure arithmetic: no segment, no side effects, tested at every boundary. */
uint64_t shmw_ticks_ceil(int64_t ns, int64_t tick_ns);
uint32_t shmw_level_for(uint64_t elapsed, uint64_t t, uint32_t wheel_bits);
uint32_t shmw_slot_for(uint64_t t, uint32_t level, uint32_t wheel_bits);
uint64_t shmw_bucket_expiry(uint64_t t, uint32_t level, uint32_t wheel_bits);
uint32_t shmw_levels_for(int64_t tick_ns, uint32_t wheel_bits);
uint32_t shmw_slot_bits(uint32_t capacity);
int      shmw_seconds_to_ns(double seconds, int64_t *out);
int64_t  shmw_now_ns(void);

/* Segment lifetime.  The caller maps the memory; these format and open it. */
int  shmw_segment_size(const struct shmw_params *p, uint64_t *size);
int  shmw_init(void *base, uint64_t size, const struct shmw_params *p, int64_t now_ns);
int  shmw_open(void *base, uint64_t size, shmw_t **out);
void shmw_close(shmw_t *w);
/* Marks the segment removed (before its name is unlinked or given to another
 * segment): every later add fails with SHMW_EREMOVED.  Timers already in it
 * stay, and cancel, reset and the driver go on working on them. */
int  shmw_mark_removed(shmw_t *w);
/* 1 if marked removed, 0 if not; a load without the lock, for a producer
 * to look now and then (an add tells for certain: SHMW_EREMOVED). */
int  shmw_is_removed(shmw_t *w);
int  shmw_layout(shmw_t *w, uint64_t *buckets_off, uint64_t *heap_off, uint64_t *lists_off,
                 uint64_t *slab_off);

/* The lock.  A lock not taken within the timeout (SHMW_LOCK_TIMEOUT_NS
 * unless set) fails with SHMW_ELOCK; lock_holder then names the thread
 * that holds it, as the robust mutex records it (0: none, or not known). */
int     shmw_set_lock_timeout(shmw_t *w, int64_t timeout_ns);
int32_t shmw_lock_holder(shmw_t *w);

/* Operations.  Add returns a handle (>= 0) or a negative code; cancel and
 * reset return 1 (done), 0 (not pending) or a negative code. */
int64_t shmw_add(shmw_t *w, double delay_s, const char *payload, uint32_t len, uint32_t flags);
int64_t shmw_add_at(shmw_t *w, double deadline_s, const char *payload, uint32_t len, uint32_t flags);
int     shmw_add_many(shmw_t *w, const double *delays, uint32_t n,
                      const char *payloads, const uint32_t *lens, int64_t *handles);
int     shmw_cancel(shmw_t *w, int64_t handle);
int     shmw_cancel_many(shmw_t *w, const int64_t *handles, uint32_t n);
int     shmw_reset(shmw_t *w, int64_t handle, double delay_s);
int     shmw_reset_at(shmw_t *w, int64_t handle, double deadline_s);
int     shmw_poll(shmw_t *w, double now_s, int use_clock, uint32_t max, char *records, int *more);
int     shmw_record_size(shmw_t *w);

/* The driver.  Register takes over only if the registration is still the
 * one the caller saw (expect_*), whose process the caller found dead; a
 * pid of 0 releases it.  drive_clock and drive_writer loop, without the
 * GIL, until *stop is set and shmw_wake is called.  drive_take hands the
 * fires the clock has moved in flight to a dispatcher in the driver's own
 * process, up to `cap` records into `buf`, and returns how many, or 0
 * once *stop is set and none are left (drive_writer is drive_take and
 * write(2)).  All three return SHMW_EDRIVER as soon as the registration
 * names another process.  ack_many frees fired timers whose handlers have
 * run and counts handler errors. */
int     shmw_driver_register(shmw_t *w, int32_t pid, int64_t start,
                             int32_t expect_pid, int64_t expect_start);
int     shmw_driver_set_state(shmw_t *w, int32_t pid, uint32_t state);
int     shmw_drive_clock(shmw_t *w, const volatile int *stop, uint32_t batch);
int     shmw_drive_take(shmw_t *w, const volatile int *stop, char *buf, uint32_t cap);
int     shmw_drive_writer(shmw_t *w, int fd, const volatile int *stop, char *buf, uint32_t cap);
void    shmw_wake(shmw_t *w);

/* The producer table.  attach takes (or finds) this process's slot; the
 * table lists them; reap cancels, in slots [from, from + count), the
 * SHMW_CANCEL_ON_EXIT timers of a producer the caller found dead, and
 * release frees its slot - both only if the slot still holds that pid and
 * start, so a stale caller changes nothing.  Reap returns the number
 * cancelled. */
int     shmw_producer_attach(shmw_t *w, int32_t pid, int64_t start, uint32_t pidns);
int     shmw_producers(shmw_t *w, int32_t *pids, int64_t *starts, uint32_t *pidns, uint32_t max);
int     shmw_producer_reap(shmw_t *w, uint32_t slot, int32_t pid, int64_t start, uint32_t from, uint32_t count);
int     shmw_producer_release(shmw_t *w, uint32_t slot, int32_t pid, int64_t start);

/* Tests only: _exit(SHMW_CRASH_EXIT) before this process's n-th store to
 * any segment from now on (0: never). */
void    shmw_test_crash_after(long n);
/* Tests only: the same, but the process stops itself (SIGSTOP) there, holding
 * the lock, and carries on when it is continued. */
void    shmw_test_stop_after(long n);
int     shmw_ack_many(shmw_t *w, const int64_t *handles, uint32_t n, uint32_t errors);
int     shmw_stats(shmw_t *w, struct shmw_stats *out);
int     shmw_check(shmw_t *w, char *reason, uint32_t reason_len);
/* Checks the segment as shmw_check does, and the wheel clock against now_ns;
 * if anything fails, rebuilds it as after a dead lock holder, retiring every
 * entry whose own fields make no sense (counted in `quarantined`) and setting
 * a clock that ran ahead of now_ns back.  Returns 0 if it was sound, 1 if it
 * was repaired (reason says what was wrong first), or a negative code. */
int     shmw_repair(shmw_t *w, int64_t now_ns, char *reason, uint32_t reason_len);
int     shmw_pending(shmw_t *w);

/* ---- cffi end ------------------------------------------------------------ */

#endif /* SHMWHEEL_H */
