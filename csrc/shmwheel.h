/*
 * shmwheel.h - the C API of shmwheel: a hierarchical timing wheel that lives
 * in one POSIX shared-memory segment and is shared by every process that
 * maps it.  This is the whole public ABI - the parameters, the fire record,
 * the stats, the return codes and the functions - and the only header the
 * shipped module's cffi definitions are read from.  The segment's own
 * layout is private (core/core.h); the design, with its reasons, is in
 * docs/design.md.
 */
#ifndef SHMWHEEL_H
#define SHMWHEEL_H

#include <stdint.h>

#define SHMW_MAGIC          0x6c656568776d6873ULL  /* a segment's first 8 bytes: "shmwheel", little-endian */
#define SHMW_LAYOUT_VERSION 8                      /* the 4 bytes after them */
/* The functions' signatures, one more each time one changes: shmwheel._fast
 * calls the cffi module's functions by address, and refuses to load beside
 * a module built from another version of this header. */
#define SHMW_API_VERSION    2

/* What create accepts. */
#define SHMW_MIN_WHEEL_BITS 4                 /* 16 buckets a level */
#define SHMW_MAX_WHEEL_BITS 12                /* 4096 buckets a level */
#define SHMW_MAX_LEVELS     16                /* enough for 1 us ticks at 16 a level */
#define SHMW_MIN_TICK_NS    1000LL            /* 1 us */
#define SHMW_MAX_TICK_NS    60000000000LL     /* 60 s */
#define SHMW_MAX_CAPACITY   0x7fffffffU       /* slab indices are uint32_t; one value is reserved */
#define SHMW_MAX_PAYLOAD    65536U
#define SHMW_MAX_DELAY_NS   (1LL << 62)       /* about 146 years */
#define SHMW_MAX_PRODUCERS  1024U             /* attached processes a segment records */
#define SHMW_COUNTERS       64U               /* counters a segment keeps for its users (shmw_count) */
#define SHMW_NOTE_SIZE      1024U             /* bytes of note it keeps for them (shmw_set_note) */
#define SHMW_SNAPSHOT_WORK  256U              /* entries shmw_snapshot looks at under one hold of a lock */
#define SHMW_MAX_SHARDS     128U              /* wheels of their own, each with its own lock, in a segment:
                                               * each has producer ids of its own (SHMW_MAX_PRODUCERS / 8) */
#define SHMW_LOCK_TIMEOUT_NS 10000000000LL    /* a lock not taken in this long is jammed */

/* Return codes.  0 is success; everything else is negative, means one
 * thing, and is turned into a Python exception in exactly one place
 * (shmwheel/_binding.py). */
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
#define SHMW_ELOCK      -12  /* the lock was not taken within the lock timeout */
#define SHMW_ENOMEM     -13  /* malloc failed (open only) */
#define SHMW_ECLOSED    -14  /* called with a closed (NULL) handle */
#define SHMW_EDRIVER    -15  /* a driver is registered, so poll is not allowed */
#define SHMW_EIO        -16  /* writing to the driver's fd failed (errno is kept) */
#define SHMW_EPRODUCERS -17  /* the producer table is full */
#define SHMW_EREMOVED   -18  /* the segment was removed from its name or replaced: adds are refused */
#define SHMW_ENOTATTACHED -19 /* this process has no producer id of its own: not attached, or forked since */
#define SHMW_ENOTDRIVER -20  /* the registration is not the one the caller named (another driver took over) */
#define SHMW_ESTALE     -21  /* the producer id no longer holds the process the caller named */
#define SHMW_EBUSY      -22  /* another holds the lock, and the caller asked not to wait for it
                              * (SHMW_TRYLOCK, shmw_try_cancel): nothing was done */

/* Flags of an add, and of a fire record. */
#define SHMW_REDELIVERED    1   /* fire: sent again after a driver died */
#define SHMW_CANCEL_ON_EXIT 2   /* add: cancelled when its producer exits */
#define SHMW_KEPT           8   /* fire: its handler ran and kept it in flight (shmw_keep_many),
                                 * for work that outlives the handler; a driver that takes over
                                 * sends it again with this mark still on */
#define SHMW_TRYLOCK      256   /* add: SHMW_EBUSY after a short spin if another holds the lock,
                                 * rather than wait for it (a caller that keeps Python's GIL
                                 * through the call must not block); never stored */
#define SHMW_RESERVED     512   /* add: may take the last shmw_params.reserve free entries, which
                                 * every other add leaves: for the timers that must get through
                                 * a wheel its producers have filled; never stored */
#define SHMW_FIRED         16   /* snapshot record: fired and in flight (without it: pending) */

/* Driver states. */
#define SHMW_DRIVER_NONE     0
#define SHMW_DRIVER_RUNNING  1
#define SHMW_DRIVER_STOPPING 2

/* ---- cffi begin ----------------------------------------------------------
 * From here to "cffi end", csrc/build_shmwheel.py hands the declarations to
 * cffi's cdef as they stand (array sizes become "..."), so the Python side
 * can never drift from them. */

/* A fire record, as shmw_poll and shmw_driver_take return them and the
 * driver's writer writes them to an external consumer: this struct, then
 * payload_size bytes rounded up to 8, of which payload_len are the
 * payload.  shmw_record_size() gives the stride. */
struct shmw_fire {
    int64_t  handle;
    int64_t  deadline_ns;
    int64_t  fired_at_ns;       /* when the clock fired it */
    int32_t  owner_pid;
    uint32_t payload_len;
    uint32_t flags;             /* SHMW_REDELIVERED, SHMW_KEPT */
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
    uint64_t reserve;           /* free entries only an add with SHMW_RESERVED may take */
    uint64_t refused;           /* fires the driver's handler refused to act on */
    uint64_t shards;
};

/* What create is asked for. */
struct shmw_params {
    uint32_t capacity;
    uint32_t payload_size;
    uint32_t wheel_bits;
    int64_t  tick_ns;
    uint32_t reserve;           /* entries only an add with SHMW_RESERVED may take; < capacity */
    uint32_t shards;            /* wheels of their own, each with its own lock and an equal share of
                                 * the capacity (rounded up to a multiple of them); 0 is 1 */
};

/* Process-private view of an open segment (opaque). */
typedef struct shmw shmw_t;

/* Pure arithmetic: no segment, no side effects, tested at every boundary.
 * A tick t goes into wheel slot shmw_slot_for(t, level) of the level
 * shmw_level_for gives; a handle holds a slab index in its low
 * shmw_index_bits(capacity) bits. */
uint64_t shmw_ticks_ceil(int64_t ns, int64_t tick_ns);
uint32_t shmw_level_for(uint64_t elapsed, uint64_t t, uint32_t wheel_bits);
uint32_t shmw_slot_for(uint64_t t, uint32_t level, uint32_t wheel_bits);
uint64_t shmw_bucket_expiry(uint64_t t, uint32_t level, uint32_t wheel_bits);
uint32_t shmw_levels_for(int64_t tick_ns, uint32_t wheel_bits);
uint32_t shmw_index_bits(uint32_t capacity);
int      shmw_seconds_to_ns(double seconds, int64_t *out);
int64_t  shmw_now_ns(void);

/* Segment lifetime.  The caller maps the memory; these format and open it. */
int  shmw_segment_size(const struct shmw_params *p, uint64_t *size);
int  shmw_init(void *base, uint64_t size, const struct shmw_params *p, int64_t now_ns);
int  shmw_open(void *base, uint64_t size, shmw_t **out);
void shmw_close(shmw_t *w);
int  shmw_record_size(shmw_t *w);
/* Marks the segment removed (before its name is unlinked or given to another
 * segment): every later add fails with SHMW_EREMOVED.  Timers already in it
 * stay, and cancel, reset and the driver go on working on them. */
int  shmw_mark_removed(shmw_t *w);
/* 1 if marked removed, 0 if not; a load without the lock, for a producer
 * to look now and then (an add tells for certain: SHMW_EREMOVED). */
int  shmw_is_removed(shmw_t *w);

/* The lock.  A lock not taken within the timeout (SHMW_LOCK_TIMEOUT_NS
 * unless set) fails with SHMW_ELOCK; lock_holder then names the thread
 * that holds it, as the robust mutex records it (0: none, or not known). */
int     shmw_set_lock_timeout(shmw_t *w, int64_t timeout_ns);
int32_t shmw_lock_holder(shmw_t *w);

/* Timers.  Add returns a handle (>= 0) or a negative code; cancel and
 * reset return 1 (done), 0 (not pending) or a negative code.  Poll, for a
 * wheel without a driver, fires what is due into `records`. */
int64_t shmw_add(shmw_t *w, double delay_s, const char *payload, uint32_t len, uint32_t flags);
int64_t shmw_add_at(shmw_t *w, double deadline_s, const char *payload, uint32_t len, uint32_t flags);
/* shmw_add_at for a deadline in nanoseconds on CLOCK_MONOTONIC, as a
 * caller that reads the clock itself has it: no conversion from seconds. */
int64_t shmw_add_at_ns(shmw_t *w, int64_t deadline_ns, const char *payload, uint32_t len, uint32_t flags);
int     shmw_add_many(shmw_t *w, const double *delays, uint32_t n,
                      const char *payloads, const uint32_t *lens, int64_t *handles);
int     shmw_cancel(shmw_t *w, int64_t handle);
/* shmw_cancel that returns SHMW_EBUSY, having done nothing, after a short
 * spin if another holds the lock (see SHMW_TRYLOCK). */
int     shmw_try_cancel(shmw_t *w, int64_t handle);
int     shmw_cancel_many(shmw_t *w, const int64_t *handles, uint32_t n);
int     shmw_reset(shmw_t *w, int64_t handle, double delay_s);
int     shmw_reset_at(shmw_t *w, int64_t handle, double deadline_s);
int     shmw_poll(shmw_t *w, double now_s, int use_clock, uint32_t max, char *records, int *more);
int     shmw_pending(shmw_t *w);

/* The driver.  Register takes over only if the registration is still the
 * one the caller saw (expect_*), whose process the caller found dead; a
 * pid of 0 releases it.  driver_clock and driver_writer loop, without the
 * GIL, until *stop is set and shmw_wake is called.  driver_take hands the
 * fires the clock has moved in flight to a dispatcher in the driver's own
 * process, up to `cap` records into `buf`, and returns how many, or 0
 * once *stop is set and none are left (driver_writer is driver_take and
 * write(2)).  All of them return SHMW_ENOTDRIVER as soon as the
 * registration names another process.  ack_many frees fired timers whose
 * handlers have run and counts handler errors; keep_many marks those a
 * handler keeps in flight (SHMW_KEPT) until it acknowledges them itself,
 * and returns how many it marked. */
int     shmw_driver_register(shmw_t *w, int32_t pid, int64_t start,
                             int32_t expect_pid, int64_t expect_start);
int     shmw_driver_set_state(shmw_t *w, int32_t pid, uint32_t state);
int     shmw_driver_clock(shmw_t *w, const volatile int *stop, uint32_t batch);
int     shmw_driver_take(shmw_t *w, const volatile int *stop, char *buf, uint32_t cap);
int     shmw_driver_writer(shmw_t *w, int fd, const volatile int *stop, char *buf, uint32_t cap);
int     shmw_ack_many(shmw_t *w, const int64_t *handles, uint32_t n, uint32_t errors, uint32_t refused);
int     shmw_keep_many(shmw_t *w, const int64_t *handles, uint32_t n);
/* For a dispatcher: takes out of a batch that driver_take copied (n
 * records in buf) those of the processes in `owners`, whose timers its
 * handler refuses unread, except those it must read all the same: kept,
 * or whose payload begins with a byte in `spare`.  Their handles and
 * owners go to `handles` and `pids` (room for n each), the rest close up
 * in order.  Touches no segment and takes no lock: the caller
 * acknowledges what it took out.  Returns how many records are left. */
uint32_t shmw_sift(const shmw_t *w, char *buf, uint32_t n, const int32_t *owners, uint32_t n_owners,
                   const char *spare, uint32_t n_spare, int64_t *handles, int32_t *pids, uint32_t *taken);
void    shmw_wake(shmw_t *w);

/* The producer table.  attach takes (or finds) this process's producer id;
 * the table lists them by id; reap cancels, in slab indices [from,
 * from + count), the SHMW_CANCEL_ON_EXIT timers of a producer the caller
 * found dead, and release frees its id - both only if the id still holds
 * that pid and start (SHMW_ESTALE otherwise), so a stale caller changes
 * nothing.  Reap returns the number cancelled. */
int     shmw_producer_attach(shmw_t *w, int32_t pid, int64_t start, uint32_t pidns);
int     shmw_producers(shmw_t *w, int32_t *pids, int64_t *starts, uint32_t *pidns, uint32_t max);
int     shmw_producer_reap(shmw_t *w, uint32_t id, int32_t pid, int64_t start, uint32_t from, uint32_t count);
int     shmw_producer_release(shmw_t *w, uint32_t id, int32_t pid, int64_t start);

/* What the segment holds and whether it is sound. */
int     shmw_stats(shmw_t *w, struct shmw_stats *out);
/* The timers pending or in flight, a few at a time: from slab entry *at
 * on, within its shard, at most SHMW_SNAPSHOT_WORK entries looked at under
 * one hold of that shard's lock, so that the producers never wait long;
 * up to `max` (at least 1) fire records into `records` (SHMW_FIRED on
 * those in flight).
 * *at is left at the next entry to look at, the capacity once all have
 * been.  Returns how many records it wrote, or a negative code.  A timer
 * that stays where it is through a walk is seen once; one added, fired or
 * cancelled meanwhile may be seen or not. */
int     shmw_snapshot(shmw_t *w, uint32_t *at, uint32_t max, char *records);
int     shmw_check(shmw_t *w, char *reason, uint32_t reason_len);
/* What its users keep in a segment for each other, which the core never
 * reads: SHMW_COUNTERS counters, added to with atomics and read without a
 * lock (the request-timeout driver's, which its metrics report), and a
 * note of up to SHMW_NOTE_SIZE bytes, written and read whole under shard
 * 0's lock (what the counters are of).  shmw_note returns the note's
 * length, having copied as much of it as `cap` holds. */
int     shmw_count(shmw_t *w, uint32_t counter, uint64_t n);
int     shmw_counters(shmw_t *w, uint64_t *out, uint32_t n);
int     shmw_set_note(shmw_t *w, const char *note, uint32_t len);
int     shmw_note(shmw_t *w, char *out, uint32_t cap);
/* Checks the segment as shmw_check does, and the wheel clock against now_ns;
 * if anything fails, rebuilds it as after a dead lock holder, retiring every
 * entry whose own fields make no sense (counted in `quarantined`) and setting
 * a clock that ran ahead of now_ns back.  Returns 0 if it was sound, 1 if it
 * was repaired (reason says what was wrong first), or a negative code. */
int     shmw_repair(shmw_t *w, int64_t now_ns, char *reason, uint32_t reason_len);

/* A worker's stack signal: from now on, signal signum writes one record
 * (below) to fd, which should be non-blocking, and does nothing
 * else of its own, as an asynchronous signal handler must; SA_RESTART, so
 * that the process's system calls go on undisturbed.  A thread that reads
 * fd then acts, in Python, whatever the main thread is doing - even where
 * it never runs Python (uWSGI's).  A handler the signal has that is the
 * default or ignore is replaced; one at address `chainable` (CPython's
 * own, which runs a signal.signal() handler and does nothing else) is
 * kept and called after the byte is written, for every signal, with its
 * flags and mask, so that both work; any other (faulthandler's, which
 * raises the signal again, a C library's) is left alone and nothing is
 * installed.  fd -1 puts back the handler it found, or the default.
 * Returns 0 (installed), 1 (installed, and it calls the one it found), 2
 * (left to another's handler), -errno (the signal cannot be caught). */
int     shmw_signal_to_fd(int signum, int fd, uint64_t chainable);

/* Each signal writes one record of SHMW_SIGNAL_RECORD bytes to the pipe:
 * the signal's number, then the value the sender queued with it (8 bytes,
 * little-endian; 0 for a plain kill).  One that did not fit (the pipe was
 * full) sets a flag, which this returns and clears: 1 if one was lost. */
#define SHMW_SIGNAL_RECORD 9
int     shmw_signal_overflowed(void);

/* pidfd_send_signal(2) of signum with `value` queued (SI_QUEUE), as the
 * driver asks a worker about one request; 0 or -errno. */
int     shmw_pidfd_sigqueue(int pidfd, int signum, int64_t value);

/* Whose handler signum has now: 0 the default action, 1 ignored, 2 the
 * one shmw_signal_to_fd() installs, 3 another; -errno on error. */
int     shmw_signal_owner(int signum);

/* The address of signum's handler now (0 the default action, 1 ignored),
 * to tell one handler from another; 0 on error. */
uint64_t shmw_signal_handler(int signum);

/* A gate before the handler signum has (faulthandler's dump of every
 * thread, which reads the other threads' frames with no lock and can
 * crash a process in which Python runs): from now on, for a signal queued
 * with a value (the driver's), it is called only if a stack signal is
 * there that the reporter thread has not taken, and the reporter woke
 * (shmw_signal_wait) and has not run Python since
 * (shmw_signal_reporter_runs) for min_gil_wait_ns and twenty of the
 * GIL's switch intervals (an unsigned long of microseconds at
 * gil_interval), while the GIL's count of handoffs at gil_switches (an
 * unsigned long's address; both are shmwheel._gil's) stayed as it was and
 * the process spent at least half that time on a CPU: a C call holds the
 * GIL, and no bytecode runs.  Else one line on stderr says the dump was
 * not done; always, with either address 0.  A plain signal (an
 * operator's kill) reaches it as before.  0, -ENOENT (signum has no
 * handler to gate), or -errno.  Called again, it sets what it was given. */
int     shmw_signal_gate_dump(int signum, int64_t min_gil_wait_ns, uint64_t gil_switches, uint64_t gil_interval);

/* Whether signum has the gate of shmw_signal_gate_dump() now. */
int     shmw_signal_gated(int signum);

/* The reporter thread's wait for the pipe the stack signals write to:
 * poll(2) of fd for up to timeout_ms (-1: for ever); 1 ready, 0 timed
 * out, -EBADF (fd closed), -EPIPE (no writer left), -errno.  Its end is
 * noted: the reporter then waits for the GIL. */
int     shmw_signal_wait(int fd, int timeout_ms);

/* Whether the reporter is in its wait now (a reporter stuck before its
 * first wait, its process stuck as it started, gives no evidence). */
int     shmw_signal_waiting(void);

/* The reporter runs Python (it holds the GIL, or did a moment ago), and
 * takes what the pipe holds next. */
void    shmw_signal_reporter_runs(void);

/* ---- cffi end ------------------------------------------------------------ */

#endif /* SHMWHEEL_H */
