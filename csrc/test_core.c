/*
 * test_core.c - the C core on its own, for a build with AddressSanitizer and
 * UndefinedBehaviorSanitizer (.ci/run; tests/test_sanitizers.py):
 *
 *     gcc -std=gnu11 -g -O1 -fsanitize=address,undefined -fno-sanitize-recover=all \
 *         -Icsrc csrc/test_core.c csrc/core/[a-z]*.c -lm -lpthread -o test_core
 *
 * Part one drives a wheel in private memory with random add_at / cancel /
 * reset_at / poll against a small model (the pending timers and their
 * deadlines) on a fake clock, with deadlines across every level, and runs
 * the invariant checker after every step.  Each operation goes through one
 * of several handles on the segment, each attached as a producer of its
 * own (and one not attached), so that timers, cancels and free slots cross
 * lanes, and the wheel is filled to the last slot, which a lane can only
 * reach by taking from another's magazine.  Part two scribbles random bytes
 * over a populated segment (never the mutex) and runs every operation: the
 * return codes do not matter, only that nothing reads or writes out of
 * bounds, overflows or loops; then shmw_repair, after which the checker
 * must find the segment sound unless the scribble hit the parameters,
 * which no repair rewrites.  Part three holds the lock from another thread
 * and checks that the try forms (SHMW_TRYLOCK, shmw_try_cancel) give up
 * with SHMW_EBUSY having changed nothing, and work once it is free.  Part
 * four sifts a dispatcher's batch (shmw_sift).  Exit status 0 on success; a sanitizer
 * report and a non-zero status otherwise.
 */
#include "core/core.h"    /* white-box: the scribbles spare the header's mutex */

#include <pthread.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define CAPACITY 256
#define RESERVE 3     /* of them, only for SHMW_RESERVED adds */
#define HANDLES  4          /* producers 0, 1, 2 and one not attached */
#define STEPS    20000
#define SCRIBBLES 3000

static uint64_t rng_state = 0x9e3779b97f4a7c15ULL;

static uint64_t rnd(void)                   /* xorshift64* */
{
    rng_state ^= rng_state >> 12;
    rng_state ^= rng_state << 25;
    rng_state ^= rng_state >> 27;
    return rng_state * 0x2545f4914f6cdd1dULL;
}

static int failures;
static int full_adds;       /* adds refused by a full wheel: the model reached CAPACITY */

#define EXPECT(cond, ...) do {                                  \
        if (!(cond)) {                                          \
            fprintf(stderr, "test_core: " __VA_ARGS__);         \
            fputc('\n', stderr);                                \
            failures++;                                         \
            return;                                             \
        }                                                       \
    } while (0)

struct model {
    int64_t handle[CAPACITY];
    int64_t deadline_ns[CAPACITY];
    int n;
};

static int64_t to_ns(double s)
{
    int64_t ns = -1;
    shmw_seconds_to_ns(s, &ns);
    return ns;
}

static void *make(struct shmw_params *p, uint64_t *size, shmw_t **w, int64_t start_ns)
{
    void *base;

    if (shmw_segment_size(p, size) || !(base = calloc(1, *size)))
        abort();
    if (shmw_init(base, *size, p, start_ns) || shmw_open(base, *size, w))
        abort();
    return base;
}

/* Which shard of `shards` a handle's entry is in, and whether every shard
 * has at most `keep` entries free: an add that may not take them fails. */
static uint32_t shard_of_handle(int64_t h, uint32_t shard_capacity)
{
    return (uint32_t)((uint64_t)h & ((1ULL << shmw_index_bits(CAPACITY)) - 1)) / shard_capacity;
}

static int all_full(const struct model *m, uint32_t shards, uint32_t keep)
{
    uint32_t used[16] = { 0 }, k;
    int j;

    for (j = 0; j < m->n; j++)
        used[shard_of_handle(m->handle[j], CAPACITY / shards)]++;
    for (k = 0; k < shards; k++)
        if (used[k] < CAPACITY / shards - keep)
            return 0;
    return 1;
}

/* A walk of shmw_snapshot, a few records at a time: every timer the model
 * has pending, once, with its deadline, and nothing else. */
static void snapshot_is_the_model(shmw_t *w, const struct model *m, char *records, size_t rec)
{
    uint32_t at = 0, last = 0;
    int n, i, k, seen = 0, found[CAPACITY] = { 0 };

    while (at < CAPACITY) {
        n = shmw_snapshot(w, &at, 7, records);
        EXPECT(n >= 0 && at > last, "snapshot gave %d and moved from %u to %u", n, last, at);
        if (n < 0 || at <= last)
            return;
        last = at;
        for (i = 0; i < n; i++) {
            const struct shmw_fire *f = (const struct shmw_fire *)(records + (size_t)i * rec);
            for (k = 0; k < m->n && m->handle[k] != f->handle; k++)
                ;
            EXPECT(k < m->n && !found[k]++ && m->deadline_ns[k] == f->deadline_ns && !(f->flags & SHMW_FIRED),
                   "snapshot gave timer %lld, not one pending once as the model has it", (long long)f->handle);
        }
        seen += n;
    }
    EXPECT(seen == m->n, "snapshot gave %d timers, the model has %d", seen, m->n);
    EXPECT(shmw_snapshot(w, &at, 7, records) == 0 && shmw_snapshot(w, &at, 0, records) == SHMW_EINVAL,
           "snapshot past the end, or of 0 records, did not say so");
}

/* The model: every operation's result against a list of what must be
 * pending, on a wheel of `shards` shards (CAPACITY and RESERVE divide
 * among them: adds spill from a full shard into the next). */
static void model_run(uint32_t shards)
{
    struct shmw_params p = { CAPACITY, 8, 4, 1000000, RESERVE * shards, shards };   /* W = 16, 1 ms tick */
    struct model m = { .n = 0 };
    uint64_t size;
    shmw_t *ws[HANDLES], *w;
    int64_t now_ns = 1000000000LL;                       /* the fake clock */
    void *base = make(&p, &size, &ws[0], now_ns);
    size_t rec = (size_t)shmw_record_size(ws[0]);
    char *records = malloc(rec * CAPACITY);
    char reason[256];
    int step, k;

    /* The same pid with another start time is another producer slot. */
    for (k = 0; k < HANDLES; k++) {
        if (k > 0 && shmw_open(base, size, &ws[k]))
            abort();
        if (k < HANDLES - 1 && shmw_producer_attach(ws[k], (int32_t)getpid(), k + 1, 0) < 0)
            abort();
    }
    for (step = 0; step < STEPS; step++) {
        /* One stretch in five is adds and cancels only, which fills the wheel. */
        uint64_t r = (step / 500) % 5 == 4 ? rnd() % 50 : rnd() % 100;
        /* Half the adds may take the reserve. */
        uint32_t flags = (rnd() & 1) ? SHMW_RESERVED : 0;
        w = ws[rnd() % HANDLES];
        if (r < 40 && all_full(&m, shards, flags ? 0 : RESERVE)) {
            EXPECT(shmw_add(w, 1.0, NULL, 0, flags) == SHMW_EFULL, "an add to a full wheel did not fail");
            full_adds++;
        } else if (r < 40) {
            /* A deadline around a level boundary, or anywhere in 2^40 ticks. */
            int level = (int)(rnd() % 10);
            int64_t ticks = (rnd() & 1) ? (int64_t)(rnd() % (1ULL << 40))
                                        : (int64_t)(1LL << (4 * level)) + (int64_t)(rnd() % 5) - 2;
            /* Half in seconds, half in nanoseconds (as shmwheel._fast adds). */
            int64_t at_ns = now_ns + ticks * 1000000LL + (int64_t)(rnd() % 1000000);
            double at = (double)at_ns / 1e9;
            int by_ns = (int)(rnd() & 1);
            int64_t h = by_ns ? shmw_add_at_ns(w, at_ns, "payload", 7, flags) : shmw_add_at(w, at, "payload", 7, flags);
            EXPECT(h > 0, "add_at failed: %lld", (long long)h);
            m.handle[m.n] = h;
            m.deadline_ns[m.n++] = by_ns ? at_ns : to_ns(at);
        } else if (r < 60 && m.n > 0) {
            int k = (int)(rnd() % (uint64_t)m.n);
            EXPECT(shmw_cancel(w, m.handle[k]) == 1, "cancel of a pending timer failed");
            EXPECT(shmw_cancel(w, m.handle[k]) == 0, "a second cancel succeeded");
            m.handle[k] = m.handle[--m.n];
            m.deadline_ns[k] = m.deadline_ns[m.n];
        } else if (r < 75 && m.n > 0) {
            int k = (int)(rnd() % (uint64_t)m.n);
            double at = (double)(now_ns + (int64_t)(rnd() % 100000000000ULL)) / 1e9;
            EXPECT(shmw_reset_at(w, m.handle[k], at) == 1, "reset of a pending timer failed");
            m.deadline_ns[k] = to_ns(at);
        } else {
            /* Advance by a little, or by a lot. */
            int64_t step_ns = (rnd() & 3) ? (int64_t)(rnd() % 50000000ULL)
                                          : (int64_t)(rnd() % (1ULL << 50));
            int more, got, k, i, due = 0;
            now_ns += step_ns;
            now_ns = to_ns((double)now_ns / 1e9);
            for (k = 0; k < m.n; k++)
                due += m.deadline_ns[k] <= now_ns - now_ns % 1000000;   /* its tick is <= now's */
            got = 0;
            do {
                int n = shmw_poll(w, (double)now_ns / 1e9, 0, CAPACITY, records, &more);
                EXPECT(n >= 0, "poll failed: %d", n);
                for (i = 0; i < n; i++) {
                    const struct shmw_fire *f = (const struct shmw_fire *)(records + (size_t)i * rec);
                    EXPECT(f->deadline_ns <= f->fired_at_ns, "a timer fired before its deadline");
                    for (k = 0; k < m.n && m.handle[k] != f->handle; k++)
                        ;
                    EXPECT(k < m.n, "an unknown or cancelled timer fired");
                    EXPECT(m.deadline_ns[k] == f->deadline_ns, "a fire with the wrong deadline");
                    m.handle[k] = m.handle[--m.n];
                    m.deadline_ns[k] = m.deadline_ns[m.n];
                }
                got += n;
            } while (more);
            EXPECT(got == due, "poll fired %d of %d due timers", got, due);
        }
        EXPECT(shmw_pending(w) == m.n, "pending %d, model %d", shmw_pending(w), m.n);
        EXPECT(shmw_check(w, reason, sizeof(reason)) == 0, "check: %s", reason);
        if (step % 97 == 0)
            snapshot_is_the_model(w, &m, records, rec);
    }
    for (k = 0; k < HANDLES; k++)
        shmw_close(ws[k]);
    free(records);
    free(base);
}

static void scribble_run(uint32_t shards)
{
    struct shmw_params p = { 64, 8, 4, 1000000, 0, shards };
    uint64_t size, top_size = ALIGN_UP(sizeof(struct shmw_top), 64), mutex_lo, mutex_hi;
    char reason[256], records[64 * 64];
    int round;

    /* The mutexes: a scribble there is a jammed lock, which test_hostile
     * covers.  The parameters: the top's, and every shard's header's. */
    mutex_lo = offsetof(struct shmw_header, mutex);
    mutex_hi = mutex_lo + sizeof(pthread_mutex_t);
    for (round = 0; round < SCRIBBLES; round++) {
        int64_t now_ns = 1000000000LL;
        shmw_t *w;
        char *base = make(&p, &size, &w, now_ns);
        int k, more, params_hit = 0, rc;
        int64_t handles[8];
        for (k = 0; k < 8; k++)
            handles[k] = shmw_add_at_ns(w, now_ns + (1LL << (3 * k)) * 1000000LL, "x", 1, 0);
        for (k = 0; k < 1 + (int)(rnd() % 6); k++) {
            uint64_t users = size - ALIGN_UP(sizeof(struct shmw_users), 64), off = rnd() % size;
            uint64_t in_shard = off < top_size || off >= users ? 0 : (off - top_size) % ((users - top_size) / shards);
            int shard_byte = off >= top_size && off < users;
            if (shard_byte && in_shard >= mutex_lo && in_shard < mutex_hi)
                continue;
            params_hit |= off < offsetof(struct shmw_top, producers)
                || (shard_byte && in_shard < offsetof(struct shmw_header, elapsed));
            base[off] = (char)rnd();
        }
        /* Every operation; any result is fine, a sanitizer report is not. */
        (void)shmw_add(w, 0.01, "y", 1, 0);
        (void)shmw_cancel(w, handles[rnd() % 8]);
        (void)shmw_reset(w, handles[rnd() % 8], 2.0);
        (void)shmw_cancel_many(w, handles, 8);
        (void)shmw_keep_many(w, handles, 8);
        (void)shmw_ack_many(w, handles, 8, 0, 0);
        (void)shmw_poll(w, (double)(now_ns + (int64_t)(rnd() % (1ULL << 45))) / 1e9, 0, 64, records, &more);
        (void)shmw_pending(w);
        {
            uint64_t counters[SHMW_COUNTERS];
            (void)shmw_count(w, (uint32_t)(rnd() % SHMW_COUNTERS), 1);
            (void)shmw_counters(w, counters, SHMW_COUNTERS);
            (void)shmw_note(w, reason, sizeof(reason));
        }
        {
            uint32_t at = 0;
            while (at < 64 && shmw_snapshot(w, &at, 64, records) >= 0)     /* at moves on each time */
                ;
        }
        {
            struct shmw_stats st;
            (void)shmw_stats(w, &st);
        }
        (void)shmw_check(w, reason, sizeof(reason));
        rc = shmw_repair(w, now_ns + (1LL << 45), reason, sizeof(reason));
        if (!params_hit) {
            EXPECT(rc == 0 || rc == 1, "repair failed: %d", rc);
            EXPECT(shmw_check(w, reason, sizeof(reason)) == 0, "check after repair: %s", reason);
        }
        shmw_close(w);
        free(base);
    }
}

/* Part three: a holder in another thread, as another process would be. */
struct holder {
    pthread_mutex_t *m;
    pthread_mutex_t gate;       /* locked while the holder is to keep the lock */
    volatile int holding;
};

static void *hold(void *arg)
{
    struct holder *h = arg;

    pthread_mutex_lock(h->m);
    __atomic_store_n(&h->holding, 1, __ATOMIC_SEQ_CST);
    pthread_mutex_lock(&h->gate);       /* until the main thread lets go */
    pthread_mutex_unlock(&h->gate);
    pthread_mutex_unlock(h->m);
    return NULL;
}

static void trylock_checks(shmw_t *w)
{
    struct holder h = { .holding = 0 };
    pthread_t t;
    int64_t kept, got;
    int rc;

    EXPECT(shmw_producer_attach(w, getpid(), 1, 0) >= 0, "attach failed");
    kept = shmw_add(w, 30.0, "k", 1, SHMW_TRYLOCK);
    EXPECT(kept >= 0, "a try-add on a free lock failed: %lld", (long long)kept);
    EXPECT(shmw_add(w, 30.0, "x", 1, SHMW_TRYLOCK | 4) == SHMW_EINVAL, "an unknown add flag was taken");
    h.m = &home_of(w)->hdr->mutex;
    pthread_mutex_init(&h.gate, NULL);
    pthread_mutex_lock(&h.gate);
    if (pthread_create(&t, NULL, hold, &h))
        abort();
    while (!__atomic_load_n(&h.holding, __ATOMIC_SEQ_CST))
        usleep(100);
    got = shmw_add(w, 30.0, "y", 1, SHMW_TRYLOCK | SHMW_CANCEL_ON_EXIT);
    rc = shmw_try_cancel(w, kept);
    pthread_mutex_unlock(&h.gate);
    pthread_join(t, NULL);
    pthread_mutex_destroy(&h.gate);
    EXPECT(got == SHMW_EBUSY, "a try-add on a held lock returned %lld, not SHMW_EBUSY", (long long)got);
    EXPECT(rc == SHMW_EBUSY, "a try-cancel on a held lock returned %d, not SHMW_EBUSY", rc);
    EXPECT(shmw_pending(w) == 1, "a try that gave up changed the wheel: %d pending", shmw_pending(w));
    EXPECT(shmw_try_cancel(w, kept) == 1, "a try-cancel on a free lock did not cancel");
    EXPECT(shmw_try_cancel(w, kept) == 0, "a try-cancel cancelled a timer twice");
    EXPECT(shmw_try_cancel(w, -1) == SHMW_EHANDLE, "a try-cancel took a negative handle");
    EXPECT(shmw_try_cancel(NULL, kept) == SHMW_ECLOSED, "a try-cancel took a closed handle");
    EXPECT(shmw_add(NULL, 1.0, "", 0, SHMW_TRYLOCK) == SHMW_ECLOSED, "a try-add took a closed handle");
    EXPECT(shmw_pending(w) == 0, "%d pending after the last cancel", shmw_pending(w));
}

/* Part four: shmw_sift on a dispatcher's batch, whose records the caller
 * may have garbled: it reads nothing outside them. */
static void sift_checks(shmw_t *w, uint32_t payload_size)
{
    uint32_t stride = (uint32_t)shmw_record_size(w), k, left, taken;
    char *buf = malloc((size_t)stride * 6);
    int64_t handles[6];
    int32_t pids[6], owners[2] = { 7, 9 };
    /* owner, flags, first payload byte: 7 and 9 refused, "w" read anyway */
    static const struct { int32_t owner; uint32_t flags; char first; } in[6] = {
        { 7, 0, 'x' }, { 5, 0, 'x' }, { 9, SHMW_KEPT, 'x' }, { 9, 0, 'w' }, { 7, SHMW_REDELIVERED, 'x' }, { 7, 0, 'w' },
    };

    if (!buf)
        abort();
    for (k = 0; k < 6; k++) {
        struct shmw_fire *f = (struct shmw_fire *)(buf + (size_t)k * stride);
        memset(f, 0, stride);
        f->handle = k;
        f->owner_pid = in[k].owner;
        f->flags = in[k].flags;
        f->payload_len = payload_size ? 1 : 1000;       /* a garbled length past a record without payload */
        if (payload_size)
            buf[(size_t)k * stride + sizeof(*f)] = in[k].first;
    }
    left = shmw_sift(w, buf, 6, owners, 2, "w", 1, handles, pids, &taken);
    if (payload_size) {
        EXPECT(left == 4 && taken == 2, "sift left %u and took %u, not 4 and 2", left, taken);
        EXPECT(handles[0] == 0 && handles[1] == 4 && pids[0] == 7 && pids[1] == 7, "sift took the wrong records");
        for (k = 0; k < left; k++)
            EXPECT(((struct shmw_fire *)(buf + (size_t)k * stride))->handle == (int64_t)"\1\2\3\5"[k],
                   "sift left record %u out of order", k);
    } else {
        EXPECT(left == 2 && taken == 4, "sift, no payloads: left %u and took %u, not 2 and 4", left, taken);
    }
    EXPECT(shmw_sift(w, buf, left, owners, 0, "w", 1, handles, pids, &taken) == left && taken == 0,
           "sift with no owners took %u", taken);
    free(buf);
}

static void sift_run(void)
{
    uint32_t payload_size;

    for (payload_size = 0; payload_size <= 8; payload_size += 8) {
        struct shmw_params p = { 64, payload_size, 4, 1000000, 0, 1 };
        uint64_t size;
        shmw_t *w;
        char *base = make(&p, &size, &w, shmw_now_ns());

        sift_checks(w, payload_size);
        shmw_close(w);
        free(base);
    }
}

static void trylock_run(void)
{
    struct shmw_params p = { 64, 8, 4, 1000000, 0, 2 };
    uint64_t size;
    shmw_t *w;
    char *base = make(&p, &size, &w, shmw_now_ns());

    trylock_checks(w);
    shmw_close(w);
    free(base);
}

/* Part six: one shard's lock held (by a thread, as by a process stopped in
 * it; the lock timeout cut to 100 ms) while a call goes through them all.
 * A batch that cannot reach a shard fails and is tried again whole; an
 * attach takes an id in a shard it can lock; the dispatcher, stopping,
 * waits for the shard rather than leave its fires unsent. */
static volatile int clock_stop;

static void *clock_thread(void *arg)
{
    (void)shmw_driver_clock(arg, &clock_stop, 64);
    return NULL;
}

static void hold_shard(struct holder *h, pthread_t *t, shard_t *s)
{
    h->m = &s->hdr->mutex;
    h->holding = 0;
    pthread_mutex_init(&h->gate, NULL);
    pthread_mutex_lock(&h->gate);
    if (pthread_create(t, NULL, hold, h))
        abort();
    while (!__atomic_load_n(&h->holding, __ATOMIC_SEQ_CST))
        usleep(100);
}

static void let_go(struct holder *h, pthread_t t)
{
    pthread_mutex_unlock(&h->gate);
    pthread_join(t, NULL);
    pthread_mutex_destroy(&h->gate);
}

/* One timer in each shard, due at once, as producers of each (ids go
 * round the shards in blocks of 8). */
static void one_in_each(shmw_t *w, double delay, int64_t *hs)
{
    int start = 100;

    for (uint32_t k = 0; k < 2; k++) {
        while (shmw_producer_attach(w, getpid(), start, 0) / 8 % 2 != (int)k)
            start++;
        hs[k] = shmw_add(w, delay, "t", 1, 0);
        if (hs[k] < 0 || shard_of(w, hs[k]) != &w->shard[k])
            abort();
    }
}

static void held_shard_run(void)
{
    struct shmw_params p = { 64, 8, 4, 1000000, 0, 2 };
    uint64_t size;
    shmw_t *w;
    char *base = make(&p, &size, &w, shmw_now_ns());
    char buf[8 * 64];
    struct holder h;
    pthread_t t, ct;
    int64_t hs[2];
    volatile int stop = 1, go = 0;
    int rc, n;

    shmw_set_lock_timeout(w, 100000000LL);
    one_in_each(w, 60.0, hs);
    hold_shard(&h, &t, &w->shard[1]);
    rc = shmw_cancel_many(w, hs, 2);
    n = shmw_producer_attach(w, getpid(), 99, 0);
    let_go(&h, t);
    EXPECT(rc == SHMW_ELOCK, "cancel_many with shard 1's lock held returned %d, not SHMW_ELOCK", rc);
    EXPECT(n >= 0 && n / 8 % 2 == 0, "attach with shard 1's lock held: %d, not an id of shard 0", n);
    EXPECT(shmw_cancel_many(w, hs, 2) == 1, "cancel_many again did not cancel shard 1's timer");
    EXPECT(shmw_pending(w) == 0, "%d pending after both were cancelled", shmw_pending(w));

    /* Fired, taken (sent), then acknowledged with shard 1's lock held. */
    EXPECT(shmw_driver_register(w, getpid(), 1, 0, 0) == 0, "register failed");
    one_in_each(w, 0.0, hs);
    if (pthread_create(&ct, NULL, clock_thread, w))
        abort();
    while (w->shard[0].hdr->inflight + w->shard[1].hdr->inflight < 2)
        usleep(1000);
    EXPECT(shmw_driver_take(w, &go, buf, 8) == 2, "the two fires were not taken");
    hold_shard(&h, &t, &w->shard[1]);
    rc = shmw_ack_many(w, hs, 2, 0, 0);
    let_go(&h, t);
    EXPECT(rc == SHMW_ELOCK, "ack_many with shard 1's lock held returned %d, not SHMW_ELOCK", rc);
    EXPECT(shmw_ack_many(w, hs, 2, 0, 0) == 1, "ack_many again did not acknowledge shard 1's fire");

    /* Fired, not taken: the dispatcher stops with shard 1's lock held. */
    one_in_each(w, 0.0, hs);
    while (w->shard[0].hdr->inflight + w->shard[1].hdr->inflight < 2)
        usleep(1000);
    hold_shard(&h, &t, &w->shard[1]);
    {
        int got[3], taken = 0, timed_out = 0;
        for (int k = 0; k < 3; k++) {      /* shard 0's fire, and a timeout on shard 1, in either order; never 0 */
            got[k] = shmw_driver_take(w, &stop, buf, 8);
            taken += got[k] > 0 ? got[k] : 0;
            timed_out += got[k] == SHMW_ELOCK;
        }
        let_go(&h, t);
        EXPECT(taken == 1 && timed_out == 2, "stopping with shard 1's lock held and its fire unsent, take gave %d, %d,"
               " %d: not shard 0's fire and timeouts", got[0], got[1], got[2]);
    }
    EXPECT(shmw_driver_take(w, &stop, buf, 8) == 1, "stopping, take did not hand out shard 1's fire once free");
    EXPECT(shmw_driver_take(w, &stop, buf, 8) == 0, "stopping, take did not say it was done");
    EXPECT(shmw_ack_many(w, hs, 2, 0, 0) == 2, "the two fires were not acknowledged");
    clock_stop = 1;
    shmw_wake(w);
    pthread_join(ct, NULL);
    EXPECT(shmw_driver_register(w, 0, 0, getpid(), 1) == 0, "release failed");
    shmw_close(w);
    free(base);
}

/* Part five: the shard of a slab index by multiply and shift, against
 * the division, at the edges and at random, for divisors from 1 to 2^31. */
static void divide_run(void)
{
    static const uint32_t ds[] = { 1, 2, 3, 5, 7, 10, 641, 4096, 10923, 32768, 65535, 65537, 1000003,
                                   0x40000000U, 0x40000001U, 0x7fffffffU };
    unsigned k;
    int j;

    for (k = 0; k < sizeof(ds) / sizeof(ds[0]); k++) {
        struct shmw_divisor v;
        uint32_t d = ds[k];
        shmw__divisor(&v, d);
        for (j = 0; j < 100000; j++) {
            uint32_t n = j < 64 ? (uint32_t)j : j < 128 ? 0x7fffffffU - (uint32_t)(j - 64)
                       : j < 192 ? d * (uint32_t)(j % 8) - (uint32_t)(j % 3) + 1 : (uint32_t)(rnd() & 0x7fffffffU);
            if (n > 0x7fffffffU)
                continue;
            EXPECT(shmw__divide(n, &v) == n / d, "%u / %u by multiply and shift gives %u", n, d, shmw__divide(n, &v));
        }
    }
}

int main(void)
{
    divide_run();
    model_run(1);
    model_run(4);
    scribble_run(1);
    scribble_run(3);
    trylock_run();
    sift_run();
    held_shard_run();
    if (failures) {
        fprintf(stderr, "test_core: %d failures\n", failures);
        return 1;
    }
    if (full_adds == 0) {
        fprintf(stderr, "test_core: the model never filled the wheel\n");
        return 1;
    }
    printf("test_core: %d model steps (%d adds to a full wheel) and %d scribbled segments, no failures\n",
           STEPS, full_adds, SCRIBBLES);
    return 0;
}
