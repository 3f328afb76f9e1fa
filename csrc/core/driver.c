/*
 * driver.c - the in-flight FIFO and the driver's registration and loops.
 *
 * A timer the driver's clock fires does not leave the segment: it moves,
 * in state SHMW_INFLIGHT, to the tail of the in-flight FIFO, and stays
 * there until its handler has run and the driver acknowledges it, so that
 * a driver that dies loses nothing - the next one sends all of it again,
 * marked redelivered.  The clock (driver_clock) and the dispatcher or
 * writer (driver_take, driver_writer) are two threads of the driver's
 * process that sleep on the top's futex words, not on a lock.  Each shard
 * has its FIFO and its registration; the clock and the dispatcher serve the
 * shards in turn, and a shard whose lock stays busy holds up only itself.
 *
 * Invariants kept: the FIFO is doubly linked, exactly `inflight` long, and
 * holds exactly the entries in flight; the unsent cursor is NIL or on it,
 * and the entries before it, and only those, are marked SHMW_SENT.  Every
 * loop here stops with SHMW_ENOTDRIVER as soon as the registration names
 * another process: what is unsent is then the new driver's to hand out.
 */
#include "core.h"
#include "heap-inl.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

/* ---- the in-flight FIFO ----------------------------------------------------- */

int shmw__inflight_can_take(const shard_t *w)
{
    /* Whether the FIFO's tail can be appended to (checked before the entry
     * leaves its bucket). */
    const struct shmw_header *h = w->hdr;

    if (h->inflight_tail == SHMW_NIL)
        return h->inflight == 0 && h->inflight_head == SHMW_NIL ? SHMW_OK : SHMW_ECORRUPT;
    return h->inflight > 0 && h->inflight_tail < w->capacity ? SHMW_OK : SHMW_ECORRUPT;
}

void shmw__inflight_append(shard_t *w, uint32_t i)
{
    struct shmw_header *h = w->hdr;
    struct shmw_entry *e = entry_at(w, i);

    COMMIT(e->state, SHMW_INFLIGHT);
    STORE(e->bucket, SHMW_NIL);
    STORE(e->next, SHMW_NIL);
    STORE(e->prev, h->inflight_tail);
    if (h->inflight_tail == SHMW_NIL)
        STORE(h->inflight_head, i);
    else
        STORE(entry_at(w, h->inflight_tail)->next, i);
    STORE(h->inflight_tail, i);
    if (h->inflight_unsent == SHMW_NIL)
        STORE(h->inflight_unsent, i);
    STORE(h->inflight, h->inflight + 1);
}

#define FAIL(...) do { \
        if (reason) snprintf(reason, reason_len, __VA_ARGS__); \
        return SHMW_ECORRUPT; \
    } while (0)

int shmw__inflight_audit(const shard_t *w, char *reason, uint32_t reason_len)
{
    /* The one walk of the whole FIFO: `inflight` steps from the head, each
     * an entry in flight linked back to the one before, then NIL at the
     * tail; the entries before the unsent cursor marked sent, the rest
     * not; the cursor NIL or on the list.  It bounds and checks every
     * step, so the caller may walk the list again unchecked. */
    const struct shmw_header *h = w->hdr;
    uint32_t i = h->inflight_head, prev = SHMW_NIL, k;
    int past_cursor = 0;

    if (h->inflight > w->capacity)
        FAIL("in-flight list: %u entries, over the capacity", h->inflight);
    for (k = 0; k < h->inflight; k++) {
        const struct shmw_entry *e;
        if (i >= w->capacity)
            FAIL("in-flight list: step %u has index %u out of bounds", k, i);
        e = entry_at(w, i);
        if (e->state != SHMW_INFLIGHT || e->prev != prev)
            FAIL("in-flight list: entry %u is not linked as in flight", i);
        past_cursor |= i == h->inflight_unsent;
        if (((e->flags & SHMW_SENT) != 0) == past_cursor)
            FAIL("in-flight list: entry %u is %s the unsent cursor", i,
                 past_cursor ? "marked sent after" : "not marked sent before");
        prev = i;
        i = e->next;
    }
    if (i != SHMW_NIL || h->inflight_tail != prev)
        FAIL("in-flight list: does not end after %u entries", h->inflight);
    if (!past_cursor && h->inflight_unsent != SHMW_NIL)
        FAIL("in-flight list: the unsent cursor %u is not on it", h->inflight_unsent);
    return SHMW_OK;
}

#undef FAIL

static int inflight_unlink(shard_t *w, uint32_t i)
{
    struct shmw_header *h = w->hdr;
    uint32_t next = entry_at(w, i)->next;

    if (h->inflight == 0)
        return SHMW_ECORRUPT;
    if (shmw__list_unlink(w, &h->inflight_head, &h->inflight_tail, i))
        return SHMW_ECORRUPT;
    if (h->inflight_unsent == i)
        STORE(h->inflight_unsent, next);
    STORE(h->inflight, h->inflight - 1);
    return SHMW_OK;
}

int shmw__ack_entry(shard_t *w, uint32_t i)
{
    /* In-flight entry i off the FIFO, freed and counted acknowledged. */
    int rc = inflight_unlink(w, i);

    if (rc == SHMW_OK)
        shmw__slab_free(w, i, &w->hdr->acked);
    return rc;
}

void shmw__write_record(const shard_t *w, uint32_t i, char *rec)
{
    /* One fire record from entry i. */
    struct shmw_entry *e = entry_at(w, i);
    struct shmw_fire *f = (struct shmw_fire *)rec;
    uint32_t len = e->payload_len <= w->payload_size ? e->payload_len : 0;

    f->handle = handle_of(w, i);
    f->deadline_ns = e->deadline_ns;
    f->fired_at_ns = e->fired_at_ns;
    f->owner_pid = e->owner_pid;
    f->payload_len = len;
    f->flags = e->flags & (SHMW_REDELIVERED | SHMW_KEPT);
    f->_pad = 0;
    if (len)
        memcpy(rec + sizeof(*f), (char *)(e + 1), len);
}

int shmw__inflight_drain(shard_t *w, uint32_t max, char *records, uint32_t *n)
{
    /* For poll, on a wheel with no driver: up to `max` fires left in
     * flight by a dead driver, into `records`, acknowledged at once. */
    struct shmw_header *h = w->hdr;
    uint32_t stride = record_stride(w);
    int rc;

    *n = 0;
    while (*n < max && h->inflight_head != SHMW_NIL) {
        uint32_t i = h->inflight_head;
        if (i >= w->capacity || entry_at(w, i)->state != SHMW_INFLIGHT || !shmw__entry_sane(w, entry_at(w, i)))
            return SHMW_ECORRUPT;       /* the caller hands out the *n before it */
        shmw__write_record(w, i, records + (uint64_t)*n * stride);
        if ((rc = shmw__ack_entry(w, i)))
            return rc;
        (*n)++;
    }
    return SHMW_OK;
}

/* ---- registration ------------------------------------------------------------ */

void shmw_wake(shmw_t *w)
{
    if (!w)
        return;
    __atomic_add_fetch(&w->top->wake_word, 1, __ATOMIC_SEQ_CST);
    __atomic_add_fetch(&w->top->outbox_word, 1, __ATOMIC_SEQ_CST);
    shmw__futex_wake_all(&w->top->wake_word);
    shmw__futex_wake_all(&w->top->outbox_word);
}

/* Whether shard w's registration is the one the caller expects. */
static int registered_as(const shard_t *w, int32_t expect_pid, int64_t expect_start)
{
    const struct shmw_header *h = w->hdr;

    return h->driver_pid == expect_pid && (expect_pid == 0 || h->driver_start == expect_start);
}

/* One shard's registration written, its lock held: what it had in flight
 * handed out again, marked redelivered.  Its in-flight list audited first,
 * so that a failure changes nothing. */
static int register_locked(shard_t *w, int32_t pid, int64_t start)
{
    struct shmw_header *h = w->hdr;
    uint32_t i;

    if (shmw__inflight_audit(w, NULL, 0))
        return SHMW_ECORRUPT;
    /* Whatever is in flight now was fired by a driver that is gone: send
     * all of it again, marked.  The audit has bounded the walk. */
    for (i = h->inflight_head; i != SHMW_NIL; i = entry_at(w, i)->next) {
        struct shmw_entry *e = entry_at(w, i);
        if (!(e->flags & SHMW_REDELIVERED))
            STORE(h->redelivered, h->redelivered + 1);
        STORE(e->flags, (uint8_t)((e->flags | SHMW_REDELIVERED) & ~SHMW_SENT));
    }
    STORE(h->inflight_unsent, h->inflight_head);
    STORE(h->driver_pid, pid);
    STORE(h->driver_start, pid ? start : 0);
    STORE(h->driver_state, pid ? SHMW_DRIVER_RUNNING : SHMW_DRIVER_NONE);
    STORE(h->sleep_until, 0);
    return SHMW_OK;
}

int shmw_driver_register(shmw_t *w, int32_t pid, int64_t start, int32_t expect_pid, int64_t expect_start)
{
    /* Shard 0 decides, and its lock is held throughout: the one caller
     * whose expectation it meets writes every other shard's registration
     * (whatever they hold: a driver that died half-way through them left
     * them mixed), each under its own lock in turn, and shard 0's last.
     * So a registration or a release cut short (killed, or a shard that
     * fails its audit) leaves shard 0 as it was, naming the driver the
     * next caller expects; and no two callers interleave.  The one call
     * that holds two locks at once, always shard 0's first. */
    shard_t *zero;
    uint32_t k;
    int rc;

    if (!w)
        return SHMW_ECLOSED;
    if (pid < 0)
        return SHMW_EINVAL;
    zero = &w->shard[0];
    if ((rc = shmw__lock(zero)))
        return rc;
    if (!registered_as(zero, expect_pid, expect_start)) {
        shmw__unlock(zero);
        return SHMW_ENOTDRIVER;
    }
    rc = shmw__inflight_audit(zero, NULL, 0) ? SHMW_ECORRUPT : SHMW_OK;
    for (k = 1; k < w->shards && rc == SHMW_OK; k++) {
        shard_t *s = &w->shard[k];
        if ((rc = shmw__lock(s)))
            break;
        rc = register_locked(s, pid, start);
        shmw__unlock(s);
    }
    if (rc == SHMW_OK)
        rc = register_locked(zero, pid, start);
    shmw__unlock(zero);
    return rc;
}

int shmw__clear_leftover(shmw_t *w, shard_t *s)
{
    /* Shard s names a driver: if shard 0 names none, that is a leftover of
     * a registration cut short, and s's is released.  Shard 0's lock is
     * taken first, as shmw_driver_register takes it, so that a
     * registration in progress is waited for, never taken for one. */
    shard_t *zero = &w->shard[0];
    int rc;

    if ((rc = shmw__lock(zero)))
        return rc;
    if ((rc = shmw__lock(s)) == SHMW_OK) {
        if (zero->hdr->driver_pid == 0 && s->hdr->driver_pid != 0)
            rc = register_locked(s, 0, 0);
        shmw__unlock(s);
    }
    shmw__unlock(zero);
    return rc;
}

int shmw_driver_set_state(shmw_t *w, int32_t pid, uint32_t state)
{
    uint32_t k;
    int rc = SHMW_OK;

    if (!w)
        return SHMW_ECLOSED;
    if (state > SHMW_DRIVER_STOPPING)
        return SHMW_EINVAL;
    for (k = 0; k < w->shards && rc == SHMW_OK; k++) {
        shard_t *s = &w->shard[k];
        if ((rc = shmw__lock(s)))
            return rc;
        if (s->hdr->driver_pid != pid)
            rc = SHMW_ENOTDRIVER;
        else
            STORE(s->hdr->driver_state, state);
        shmw__unlock(s);
    }
    return rc;
}

/* ---- the clock ------------------------------------------------------------------ */

/* A shard whose lock the clock (or the dispatcher) found busy past a
 * waiter's spin: held by a process stopped or descheduled in it.  It is
 * looked at again SHMW_BUSY_RETRY_NS later, then twice as late each time
 * it is still busy, up to SHMW_MAX_SLEEP_NS, while the other shards are
 * served; *until_ns is lowered to the next look.  Once it has been busy
 * for the lock timeout, SHMW_ELOCK, as a wait for it would have ended
 * (the driver says so in its log and goes on), and the count starts
 * again. */
static int busy_later(shard_t *s, int64_t now_ns, int64_t *retry_ns, int64_t *backoff_ns, int64_t *since_ns,
                      int64_t *until_ns)
{
    if (!*since_ns) {
        *since_ns = now_ns;
    } else if (now_ns - *since_ns >= s->lock_timeout_ns) {
        *since_ns = *backoff_ns = *retry_ns = 0;
        s->timed_out_ns = now_ns;
        return SHMW_ELOCK;
    }
    *backoff_ns = *backoff_ns ? *backoff_ns * 2 : SHMW_BUSY_RETRY_NS;
    if (*backoff_ns > SHMW_MAX_SLEEP_NS)
        *backoff_ns = SHMW_MAX_SLEEP_NS;
    *retry_ns = now_ns + *backoff_ns;
    if (*retry_ns < *until_ns)
        *until_ns = *retry_ns;
    return SHMW_OK;
}

/* One shard's turn of the clock, under its lock: fires what is due, at
 * most `batch`, then (if nothing more is) says until when it sleeps.
 * *until_ns is lowered to the shard's next due time; *more set if it has
 * more due now; *fired counts what it moved in flight. */
static int clock_shard(shard_t *w, int64_t now_ns, uint32_t batch, int64_t *until_ns, int *more, uint32_t *fired)
{
    struct shmw_header *h = w->hdr;
    uint32_t n = 0;
    uint64_t next;
    int rc, left = 0;

    if ((rc = shmw__lock_mode(w, SHMW_LOCK_SPIN)))
        return rc;
    if (h->driver_pid != shmw__pid) {
        shmw__unlock(w);
        return SHMW_ENOTDRIVER;   /* someone took over: stop at once */
    }
    STORE(h->sleep_until, 0);
    rc = shmw__advance(w, (uint64_t)now_ns / (uint64_t)w->tick_ns, now_ns, batch, NULL, &n, &left);
    if (n)
        __atomic_add_fetch(w->outbox_word, 1, __ATOMIC_SEQ_CST);
    *fired += n;
    if (rc == SHMW_OK && !left) {
        /* Nothing more is due: it sleeps until its earliest bucket, and a
         * producer that adds an earlier one wakes the clock (wake_for). */
        if (heap_top(w, &next)) {
            STORE(h->sleep_until, next);
            w->due = next;
            if (ticks_to_ns(w, next) < *until_ns)
                *until_ns = ticks_to_ns(w, next);
        } else {
            STORE(h->sleep_until, UINT64_MAX);
            w->due = UINT64_MAX;
        }
    }
    *more |= left;
    shmw__unlock(w);
    return rc;
}

int shmw_driver_clock(shmw_t *w, const volatile int *stop, uint32_t batch)
{
    /* Fires what is due in batches of at most `batch` per lock hold, so a
     * burst of a million timers does not shut producers out, then sleeps
     * until the earliest bucket of any shard is due or a producer adds an
     * earlier one.  There is no periodic tick: an idle wheel sleeps in
     * FUTEX_WAIT.
     *
     * A shard is looked at (locked) only when something of it is due by
     * the clock's own reckoning (`due`, what its heap said last time) or a
     * producer has woken the clock for it (its sleep_until lowered below
     * what the clock left there).  The top's word is read before the
     * shards are: a producer that lowers a shard's sleep_until after the
     * clock looked at that shard bumps the word after it, and FUTEX_WAIT
     * then returns at once. */
    struct shmw_top *top;
    int rc = SHMW_OK;

    if (!w)
        return SHMW_ECLOSED;
    if (batch == 0)
        return SHMW_EINVAL;
    top = w->top;
    while (!*stop) {
        int64_t now_ns, until_ns;
        uint32_t fired = 0, seen, k;
        uint64_t now_tick;
        int more = 0;

        seen = __atomic_load_n(&top->wake_word, __ATOMIC_SEQ_CST);
        now_ns = shmw_now_ns();
        now_tick = (uint64_t)now_ns / (uint64_t)w->shard[0].tick_ns;
        /* Never longer than SHMW_MAX_SLEEP_NS.  The cap bounds the stall
         * if a producer dies between lowering sleep_until and its
         * FUTEX_WAKE (or under the lock): a later add for the same moment
         * skips the wake, so only the sleeper can recover. */
        until_ns = now_ns + CLOCK_CAP_NS();
        __atomic_store_n(&top->passed_ns, now_ns, __ATOMIC_RELAXED);
        for (k = 0; k < w->shards; k++) {
            shard_t *s = &w->shard[k];
            uint64_t asleep = __atomic_load_n(&s->hdr->sleep_until, __ATOMIC_SEQ_CST);
            int woken = asleep != s->due;       /* a producer's add: its lock was free a moment ago */
            if (s->due > now_tick && !woken && s->due != 0) {
                if (s->due != UINT64_MAX && ticks_to_ns(s, s->due) < until_ns)
                    until_ns = ticks_to_ns(s, s->due);
                continue;       /* nothing due, and no producer woke the clock for it */
            }
            if (!woken && now_ns < s->clock_retry_ns) {
                if (s->clock_retry_ns < until_ns)
                    until_ns = s->clock_retry_ns;
                continue;       /* its lock was busy a moment ago */
            }
            rc = clock_shard(s, now_ns, batch, &until_ns, &more, &fired);
            if (rc == SHMW_EBUSY) {
                if ((rc = busy_later(s, now_ns, &s->clock_retry_ns, &s->clock_backoff_ns, &s->busy_since_ns,
                                     &until_ns)))
                    break;
                continue;
            }
            s->clock_backoff_ns = s->busy_since_ns = 0;
            if (rc)
                break;
        }
        if (fired)
            shmw__futex_wake_all(&top->outbox_word);
        if (rc)
            return rc;          /* what it moved in flight before the error is the dispatcher's */
        if (!more && !*stop)
            shmw__futex_wait_until(&top->wake_word, seen, until_ns);
    }
    return SHMW_OK;
}

/* ---- the dispatcher and the writer ------------------------------------------- */

/* Up to `cap` unsent fires of one shard into buf, marked sent, under its
 * lock; how many into *n. */
static int take_shard(shard_t *w, char *buf, uint32_t cap, uint32_t *n, int wait)
{
    struct shmw_header *h = w->hdr;
    uint32_t stride = record_stride(w), i;
    int rc;

    *n = 0;
    if (__atomic_load_n(&h->inflight_unsent, __ATOMIC_RELAXED) == SHMW_NIL
        && __atomic_load_n(&h->driver_pid, __ATOMIC_RELAXED) == shmw__pid)
        return SHMW_OK;         /* nothing to take: no lock (a stale look is caught by the word) */
    if ((rc = shmw__lock_mode(w, wait)))
        return rc;
    if (h->driver_pid != shmw__pid) {
        shmw__unlock(w);
        return SHMW_ENOTDRIVER;
    }
    i = h->inflight_unsent;
    while (*n < cap && i != SHMW_NIL) {
        struct shmw_entry *e;
        /* An entry marked sent is one the cursor should be past: a
         * scribbled cursor, which would hand it out twice. */
        if (i >= w->capacity || (e = entry_at(w, i))->state != SHMW_INFLIGHT || !shmw__entry_sane(w, e)
            || (e->flags & SHMW_SENT)) {
            if (*n > 0)
                break;      /* hand out what was taken; the next take meets it */
            shmw__unlock(w);
            return SHMW_ECORRUPT;
        }
        shmw__write_record(w, i, buf + (uint64_t)*n * stride);
        STORE(e->flags, e->flags | SHMW_SENT);
        (*n)++;
        i = e->next;
    }
    STORE(h->inflight_unsent, i);
    shmw__unlock(w);
    return SHMW_OK;
}

int shmw_driver_take(shmw_t *w, const volatile int *stop, char *buf, uint32_t cap)
{
    /* Copies up to `cap` unsent fires out of the shards, each under its
     * lock, and marks them sent; with none unsent, sleeps until the clock
     * fires some.  Returns how many, or 0 once *stop is set and nothing is
     * left unsent.  The shards are taken from in turn, from the one after
     * where the last take began. */
    uint32_t stride;

    if (!w)
        return SHMW_ECLOSED;
    if (cap == 0 || cap > INT32_MAX)
        return SHMW_EINVAL;
    stride = record_stride(&w->shard[0]);
    for (;;) {
        uint32_t n = 0, seen, t, first;
        int stopping, rc;

        /* *stop is read after the word: a stop set before this load is
         * seen here, and one set after it bumps the word past `seen`, so
         * the FUTEX_WAIT below returns at once.  No stop is missed, nor a
         * fire the clock moves in flight after its shard was looked at. */
        seen = __atomic_load_n(&w->top->outbox_word, __ATOMIC_SEQ_CST);
        stopping = __atomic_load_n(stop, __ATOMIC_SEQ_CST);
        int64_t now_ns = shmw_now_ns(), until_ns = -1;

        first = __atomic_fetch_add(&w->take_from, 1, __ATOMIC_RELAXED);
        for (t = 0; t < w->shards && n < cap; t++) {
            shard_t *s = &w->shard[(first + t) % w->shards];
            uint32_t got = 0;
            /* Stopping, every shard is waited for: what it has unsent is
             * handed out before the driver stops, or the wait times out. */
            if (!stopping && now_ns < s->take_retry_ns) {
                if (until_ns < 0 || s->take_retry_ns < until_ns)
                    until_ns = s->take_retry_ns;
                continue;       /* its lock was busy a moment ago */
            }
            rc = take_shard(s, buf + (uint64_t)n * stride, cap - n, &got, stopping ? SHMW_LOCK_WAIT : SHMW_LOCK_SPIN);
            n += got;
            if (rc == SHMW_EBUSY) {
                if (until_ns < 0)
                    until_ns = INT64_MAX;
                if ((rc = busy_later(s, now_ns, &s->take_retry_ns, &s->take_backoff_ns, &s->take_busy_since_ns,
                                     &until_ns)))
                    return n ? (int)n : rc;
                continue;
            }
            s->take_backoff_ns = s->take_busy_since_ns = 0;
            if (rc)
                return n ? (int)n : rc;
        }
        if (n)
            return (int)n;
        if (stopping)
            return 0;
        shmw__futex_wait_until(&w->top->outbox_word, seen, until_ns);
    }
}

uint32_t shmw_sift(const shmw_t *wheel, char *buf, uint32_t n, const int32_t *owners, uint32_t n_owners,
                   const char *spare, uint32_t n_spare, int64_t *handles, int32_t *pids, uint32_t *taken)
{
    /* A forger's hundred thousand timers cost this loop a few nanoseconds
     * each, not a Python object and a handler call: a real timer that the
     * clock fired after them is handed out milliseconds later, not tenths
     * of a second.  The owner lists are a dispatcher's few refusals, so a
     * linear look-up. */
    const shard_t *w = &wheel->shard[0];
    uint32_t stride = record_stride(w), k, j, left = 0;

    *taken = 0;
    for (k = 0; k < n; k++) {
        char *rec = buf + (uint64_t)k * stride;
        const struct shmw_fire *f = (const struct shmw_fire *)rec;
        int sift = 0;

        for (j = 0; j < n_owners && !sift; j++)
            sift = f->owner_pid == owners[j];
        if (sift && (f->flags & SHMW_KEPT))
            sift = 0;
        for (j = 0; j < n_spare && sift && f->payload_len > 0 && w->payload_size > 0; j++)
            sift = rec[sizeof(*f)] != spare[j];
        if (sift) {
            handles[*taken] = f->handle;
            pids[*taken] = f->owner_pid;
            (*taken)++;
            continue;
        }
        if (left != k)
            memmove(buf + (uint64_t)left * stride, rec, stride);
        left++;
    }
    return left;
}

static int write_all(int fd, const char *buf, size_t len)
{
    while (len > 0) {
        ssize_t k = write(fd, buf, len);
        if (k < 0) {
            if (errno == EINTR)
                continue;
            return SHMW_EIO;
        }
        buf += k;
        len -= (size_t)k;
    }
    return SHMW_OK;
}

int shmw_driver_writer(shmw_t *w, int fd, const volatile int *stop, char *buf, uint32_t cap)
{
    /* Takes fires and writes them to the fd outside the lock.  A slow
     * reader blocks this thread only: the clock goes on firing into the
     * in-flight FIFO meanwhile. */
    int n;

    if (!w)
        return SHMW_ECLOSED;
    while ((n = shmw_driver_take(w, stop, buf, cap)) > 0) {
        int rc = write_all(fd, buf, (size_t)n * record_stride(&w->shard[0]));
        if (rc)
            return rc;
    }
    return n;
}

/* An acknowledgement's or a keep's part of shmw__by_shard: the entry a
 * handle names, if it is in flight. */
static int in_flight_op(shard_t *w, int64_t handle, void *arg)
{
    int (*each)(shard_t *, uint32_t) = *(int (**)(shard_t *, uint32_t))arg;
    uint32_t i = shmw__lookup(w, handle, SHMW_INFLIGHT);
    int rc;

    if (i == SHMW_NIL)
        return 0;
    return (rc = each(w, i)) ? rc : 1;
}

static int keep_entry(shard_t *w, uint32_t i)
{
    STORE(entry_at(w, i)->flags, (uint8_t)(entry_at(w, i)->flags | SHMW_KEPT));
    return SHMW_OK;
}

int shmw_ack_many(shmw_t *w, const int64_t *handles, uint32_t n, uint32_t errors, uint32_t refused)
{
    /* The counts go to shard 0 once every handle is acknowledged, so that
     * a call tried again after an error counts them once. */
    int (*each)(shard_t *, uint32_t) = shmw__ack_entry;
    shard_t *zero;
    int done = shmw__by_shard(w, handles, n, in_flight_op, &each), rc;

    if (done < 0 || !(errors || refused))
        return done;
    zero = &w->shard[0];
    if ((rc = shmw__lock(zero)))
        return rc;
    STORE(zero->hdr->handler_errors, zero->hdr->handler_errors + errors);
    STORE(zero->hdr->refused, zero->hdr->refused > UINT32_MAX - refused ? UINT32_MAX : zero->hdr->refused + refused);
    shmw__unlock(zero);
    return done;
}

int shmw_keep_many(shmw_t *w, const int64_t *handles, uint32_t n)
{
    /* Only a mark: the entry stays on the FIFO where it is, sent, until
     * shmw_ack_many frees it or a new driver sends it again. */
    int (*each)(shard_t *, uint32_t) = keep_entry;

    return shmw__by_shard(w, handles, n, in_flight_op, &each);
}
