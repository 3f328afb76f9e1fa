/*
 * wheel.c - the buckets and the advance: the hot path.
 *
 * add, cancel and reset take the lock once, check everything the operation
 * will touch, then change it; the clock and poll advance the wheel,
 * firing level-0 buckets and cascading higher ones.  Every public function
 * here checks its arguments and reads the clock before it takes the lock;
 * under the lock there are only loads, stores and arithmetic.
 *
 * Invariants kept: a pending entry is on exactly one lane list, of the
 * bucket its deadline and the wheel clock give (shmw__place), and points
 * back at it; a bucket's lane_mask says which of its lists are non-empty,
 * and exactly the non-empty buckets are in the delay-heap, at the position
 * they record.  A timer never fires before its deadline: it goes into the
 * bucket of the tick it rounds up to.
 */
#include "core.h"
#include "heap-inl.h"

#include <string.h>

/* ---- buckets ---------------------------------------------------------------- */

int shmw__place(const shard_t *w, uint64_t elapsed, uint64_t t, uint32_t *bucket, uint64_t *expires)
{
    /* Where a timer due at tick t goes with the wheel clock at `elapsed`.
     * A timer at or before the clock goes to the clock's own level-0
     * bucket: it is due at the next poll. */
    uint64_t key = t > elapsed ? t : elapsed;
    uint32_t level = shmw_level_for(elapsed, key, w->wheel_bits);

    if (level >= w->levels)
        return SHMW_ERANGE;
    *bucket = (level << w->wheel_bits) | shmw_slot_for(key, level, w->wheel_bits);
    *expires = shmw_bucket_expiry(key, level, w->wheel_bits);
    return SHMW_OK;
}

/* Whether lane `lane` of bucket b can take an entry due at `expires`.
 * Operations check this before they change anything, so that one that
 * fails on a scribbled segment leaves it as it was. */
static int bucket_can_take(const shard_t *w, uint32_t b, uint32_t lane, uint64_t expires)
{
    const struct shmw_bucket *bk = &w->buckets[b];
    const struct shmw_list *ls = list_of(w, lane, b);
    uint32_t bit = 1U << lane;

    if (bk->lane_mask >> SHMW_LANES)
        return SHMW_ECORRUPT;
    if (bk->lane_mask == 0 && (bk->heap_pos != SHMW_NIL || w->hdr->heap_len >= w->nbuckets))
        return SHMW_ECORRUPT;
    if (bk->lane_mask != 0 && (bk->expires != expires || bk->heap_pos >= w->nbuckets))
        return SHMW_ECORRUPT;
    if (!(bk->lane_mask & bit))
        return ls->head == SHMW_NIL && ls->tail == SHMW_NIL && ls->count == 0 ? SHMW_OK : SHMW_ECORRUPT;
    return ls->count > 0 && ls->tail < w->capacity ? SHMW_OK : SHMW_ECORRUPT;
}

int shmw__bucket_append(shard_t *w, uint32_t b, uint64_t expires, uint32_t i)
{
    /* Appends entry i, whose producer is already set, to its lane's list
     * of bucket b; the caller has checked bucket_can_take. */
    struct shmw_bucket *bk = &w->buckets[b];
    struct shmw_entry *e = entry_at(w, i);
    uint32_t lane = lane_of(e->producer), bit = 1U << lane;
    struct shmw_list *ls = list_of(w, lane, b);

    if (bk->lane_mask & bit) {
        if (ls->tail >= w->capacity || bk->expires != expires)
            return SHMW_ECORRUPT;
        STORE(entry_at(w, ls->tail)->next, i);
        STORE(e->prev, ls->tail);
        STORE(e->next, SHMW_NIL);
        STORE(e->bucket, b);
        STORE(ls->tail, i);
        STORE(ls->count, ls->count + 1);
        return SHMW_OK;
    }
    if (ls->count != 0 || (bk->lane_mask == 0 ? bk->heap_pos != SHMW_NIL : bk->expires != expires))
        return SHMW_ECORRUPT;
    STORE(e->prev, SHMW_NIL); STORE(e->next, SHMW_NIL);
    STORE(e->bucket, b);
    STORE(ls->head, i); STORE(ls->tail, i);
    STORE(ls->count, 1);
    if (bk->lane_mask != 0) {
        STORE(bk->lane_mask, bk->lane_mask | bit);
        return SHMW_OK;
    }
    STORE(bk->expires, expires);
    STORE(bk->lane_mask, bit);
    return heap_push(w, b);
}

int shmw__list_unlink(shard_t *w, uint32_t *head, uint32_t *tail, uint32_t i)
{
    /* Takes entry i out of the doubly linked list whose ends are *head and
     * *tail (a bucket's, or the in-flight FIFO).  Checks the links around
     * i before touching anything, so a scribbled list is reported, not
     * made worse. */
    struct shmw_entry *e = entry_at(w, i);

    if (e->prev == SHMW_NIL ? *head != i
        : e->prev >= w->capacity || entry_at(w, e->prev)->next != i)
        return SHMW_ECORRUPT;
    if (e->next == SHMW_NIL ? *tail != i
        : e->next >= w->capacity || entry_at(w, e->next)->prev != i)
        return SHMW_ECORRUPT;

    if (e->prev == SHMW_NIL)
        STORE(*head, e->next);
    else
        STORE(entry_at(w, e->prev)->next, e->next);
    if (e->next == SHMW_NIL)
        STORE(*tail, e->prev);
    else
        STORE(entry_at(w, e->next)->prev, e->prev);
    STORE(e->prev, SHMW_NIL); STORE(e->next, SHMW_NIL);
    return SHMW_OK;
}

/* Whether neighbour n of an entry in lane `lane` of bucket b is in that
 * list too.  The lane comes from the entry's own producer field: scribbled,
 * it would name another lane's list, whose count the unlink would then
 * take down while the entry's real neighbours still agree with each
 * other.  Costs nothing: list_unlink reads these entries anyway. */
static inline int same_list(const shard_t *w, uint32_t n, uint32_t lane, uint32_t b)
{
    return n == SHMW_NIL
        || (n < w->capacity && lane_of(entry_at(w, n)->producer) == lane && entry_at(w, n)->bucket == b);
}

static int bucket_unlink(shard_t *w, uint32_t i)
{
    struct shmw_entry *e = entry_at(w, i);
    uint32_t b = e->bucket, lane = lane_of(e->producer), bit = 1U << lane;
    struct shmw_bucket *bk;
    struct shmw_list *ls;

    if (b >= w->nbuckets || !same_list(w, e->prev, lane, b) || !same_list(w, e->next, lane, b))
        return SHMW_ECORRUPT;
    bk = &w->buckets[b];
    ls = list_of(w, lane, b);
    if (ls->count == 0 || !(bk->lane_mask & bit) || bk->lane_mask >> SHMW_LANES)
        return SHMW_ECORRUPT;
    if (shmw__list_unlink(w, &ls->head, &ls->tail, i))
        return SHMW_ECORRUPT;
    STORE(e->bucket, SHMW_NIL);
    STORE(ls->count, ls->count - 1);
    if (ls->count > 0)
        return SHMW_OK;
    STORE(ls->head, SHMW_NIL); STORE(ls->tail, SHMW_NIL);
    STORE(bk->lane_mask, bk->lane_mask & ~bit);
    return bk->lane_mask == 0 ? heap_remove(w, b) : SHMW_OK;
}

int shmw__cancel_entry(shard_t *w, uint32_t i)
{
    /* Pending entry i out of its bucket, freed and counted cancelled. */
    int rc = bucket_unlink(w, i);

    if (rc == SHMW_OK)
        shmw__slab_free(w, i, &w->hdr->cancelled);
    return rc;
}

/* ---- add, cancel, reset --------------------------------------------------- */

/* Takes a free entry, fills it and puts it in its bucket.  Everything is
 * checked before the first store, so a failure changes nothing. */
static int insert_new(shard_t *w, int64_t deadline_ns, const char *payload, uint32_t len, uint32_t flags,
                      int64_t *handle, int *wake)
{
    struct shmw_header *h = w->hdr;
    struct shmw_entry *e;
    uint16_t producer = my_producer(w);
    uint64_t expires;
    uint32_t i, b;
    int rc;

    rc = shmw__place(w, h->elapsed, shmw_ticks_ceil(deadline_ns, w->tick_ns), &b, &expires);
    if (rc == SHMW_OK)
        rc = bucket_can_take(w, b, lane_of(producer), expires);
    if (rc == SHMW_OK)
        rc = shmw__slab_take(w, lane_of(producer), (flags & SHMW_RESERVED) != 0, &i);
    if (rc)
        return rc;
    e = entry_at(w, i);
    STORE(e->deadline_ns, deadline_ns);
    STORE(e->owner_pid, shmw__pid);
    STORE(e->payload_len, len);
    STORE(e->flags, (uint8_t)(flags & SHMW_CANCEL_ON_EXIT));
    STORE(e->producer, producer);
    if (len) {
        CRASH_POINT();
        memcpy((char *)(e + 1), payload, len);
    }
    COMMIT(e->state, SHMW_PENDING);          /* commits the entry */
    rc = shmw__bucket_append(w, b, expires, i);
    if (rc)
        return rc;
    STORE(h->added, h->added + 1);
    *wake |= shmw__wake_for(w, expires);
    *handle = handle_of(w, i);
    return SHMW_OK;
}

/* The deadline `ns` names: a delay from now, or (absolute) a time on
 * CLOCK_MONOTONIC; either way at most SHMW_MAX_DELAY_NS ahead.  *now_ns is
 * the clock's reading, made here on first need (-1: not read yet) and
 * kept for the caller's next deadline.  An absolute time below
 * SHMW_MAX_DELAY_NS is never too far ahead, so a caller that has read the
 * clock itself (shmwheel._fast) does not pay for a second read.  No lock. */
static int deadline_of_ns(int64_t ns, int absolute, int64_t *now_ns, int64_t *deadline_ns)
{
    if (ns < 0)
        return SHMW_ETIME;
    if (!absolute || ns > SHMW_MAX_DELAY_NS) {
        if (*now_ns < 0)
            *now_ns = shmw_now_ns();
        if (!absolute) {
            if (ns > SHMW_MAX_DELAY_NS)
                return SHMW_ERANGE;
            ns += *now_ns;
        } else if (ns > *now_ns && ns - *now_ns > SHMW_MAX_DELAY_NS) {
            return SHMW_ERANGE;
        }
    }
    *deadline_ns = ns;
    return SHMW_OK;
}

/* deadline_of_ns for a deadline in seconds, as the public calls take it. */
static int deadline_of(double seconds, int absolute, int64_t *now_ns, int64_t *deadline_ns)
{
    int64_t ns;
    int rc = shmw_seconds_to_ns(seconds, &ns);

    return rc ? rc : deadline_of_ns(ns, absolute, now_ns, deadline_ns);
}

static void wake_clock(shard_t *w)
{
    shmw__futex_wake_all(w->wake_word);
}

/* An add to one shard, of a deadline already checked by deadline_of[_ns]. */
static int64_t add_to(shard_t *w, int64_t deadline_ns, const char *payload, uint32_t len, uint32_t flags)
{
    int64_t handle = 0;
    int rc, wake = 0;

    if ((rc = shmw__lock_mode(w, !(flags & SHMW_TRYLOCK))))
        return rc;
    /* Read under the lock: an add that takes it after the mark fails, so
     * no timer goes into a segment after its remover looked. */
    rc = w->hdr->removed ? SHMW_EREMOVED : insert_new(w, deadline_ns, payload, len, flags, &handle, &wake);
    shmw__unlock(w);
    if (wake)
        wake_clock(w);
    return rc ? rc : handle;
}

/* An add of a deadline already checked by deadline_of[_ns]: to this
 * process's own shard, or if that one is full, to the next that is not. */
static int64_t add_checked(shmw_t *w, int64_t deadline_ns, const char *payload, uint32_t len, uint32_t flags)
{
    shard_t *home;
    uint32_t k;
    int64_t rc;

    if (!w)
        return SHMW_ECLOSED;
    if (len > w->payload_size)
        return SHMW_EPAYLOAD;
    if (flags & ~(uint32_t)(SHMW_CANCEL_ON_EXIT | SHMW_TRYLOCK | SHMW_RESERVED))
        return SHMW_EINVAL;
    home = home_of(w);
    /* Cancel-on-exit needs this process's own producer id; after a fork
     * the id is the parent's, so the caller must attach again. */
    if ((flags & SHMW_CANCEL_ON_EXIT) && my_producer(home) == SHMW_NO_PRODUCER)
        return SHMW_ENOTATTACHED;
    for (k = 0;; home = &w->shard[home->shard + 1 < w->shards ? home->shard + 1 : 0]) {
        rc = add_to(home, deadline_ns, payload, len, flags);     /* one call: inlined */
        if (rc != SHMW_EFULL || ++k == w->shards)
            return rc;
    }
}

static int64_t add_seconds(shmw_t *w, double seconds, int absolute, const char *payload, uint32_t len,
                           uint32_t flags)
{
    int64_t deadline_ns, now_ns = -1;
    int rc = deadline_of(seconds, absolute, &now_ns, &deadline_ns);

    return rc ? rc : add_checked(w, deadline_ns, payload, len, flags);
}

int64_t shmw_add(shmw_t *w, double delay_s, const char *payload, uint32_t len, uint32_t flags)
{
    return add_seconds(w, delay_s, 0, payload, len, flags);
}

int64_t shmw_add_at(shmw_t *w, double deadline_s, const char *payload, uint32_t len, uint32_t flags)
{
    return add_seconds(w, deadline_s, 1, payload, len, flags);
}

int64_t shmw_add_at_ns(shmw_t *w, int64_t deadline_ns, const char *payload, uint32_t len, uint32_t flags)
{
    int64_t now_ns = -1;
    int rc = deadline_of_ns(deadline_ns, 1, &now_ns, &deadline_ns);

    return rc ? rc : add_checked(w, deadline_ns, payload, len, flags);
}

int shmw_add_many(shmw_t *w, const double *delays, uint32_t n,
                  const char *payloads, const uint32_t *lens, int64_t *handles)
{
    /* All or nothing, into one shard: this process's own, or the next
     * with room for all of them.  Every argument is checked and the free
     * count is checked before the first insert.  The deadlines are
     * computed into the caller's handle array, then overwritten by the
     * handles. */
    int64_t now_ns = -1;
    uint64_t off = 0;
    uint32_t k, t;
    shard_t *s = NULL;
    int rc, wake = 0;

    if (!w)
        return SHMW_ECLOSED;
    for (k = 0; k < n; k++) {
        if ((rc = deadline_of(delays[k], 0, &now_ns, &handles[k])))
            return rc;
        if (lens && lens[k] > w->payload_size)
            return SHMW_EPAYLOAD;
    }
    rc = SHMW_EFULL;
    for (t = 0; rc == SHMW_EFULL && t < w->shards; t++) {
        s = &w->shard[(home_of(w)->shard + t) % w->shards];
        if ((rc = shmw__lock(s)))
            return rc;
        if (s->hdr->removed || s->hdr->free_count < (uint64_t)n + s->reserve) {
            rc = s->hdr->removed ? SHMW_EREMOVED : SHMW_EFULL;
            shmw__unlock(s);
        }
    }
    if (rc)
        return rc;
    for (k = 0; k < n; k++) {
        uint32_t len = lens ? lens[k] : 0;
        rc = insert_new(s, handles[k], len ? payloads + off : NULL, len, 0, &handles[k], &wake);
        if (rc)
            break;              /* only ECORRUPT gets here */
        off += len;
    }
    shmw__unlock(s);
    if (wake)
        wake_clock(s);
    return rc;
}

/* 1 if the handle named a pending timer of the shard, now cancelled; 0 if not. */
static int cancel_locked(shard_t *w, int64_t handle)
{
    uint32_t i = shmw__lookup(w, handle, SHMW_PENDING);
    int rc;

    if (i == SHMW_NIL)
        return 0;
    return (rc = shmw__cancel_entry(w, i)) ? rc : 1;
}

static int cancel_one(shmw_t *w, int64_t handle, int wait)
{
    shard_t *s;
    int rc;

    if (!w)
        return SHMW_ECLOSED;
    if (handle < 0)
        return SHMW_EHANDLE;
    if (!(s = shard_of(w, handle)))
        return 0;               /* no entry has that index: none pending */
    if ((rc = wait ? shmw__lock(s) : shmw__lock_mode(s, 0)))
        return rc;
    rc = cancel_locked(s, handle);
    shmw__unlock(s);
    return rc;
}

int shmw_cancel(shmw_t *w, int64_t handle)
{
    return cancel_one(w, handle, 1);
}

int shmw_try_cancel(shmw_t *w, int64_t handle)
{
    return cancel_one(w, handle, 0);
}

int shmw__by_shard(shmw_t *w, const int64_t *handles, uint32_t n, int (*op)(shard_t *, int64_t, void *), void *arg)
{
    uint32_t k, j;
    int rc = 0, done = 0;

    if (!w)
        return SHMW_ECLOSED;
    for (j = 0; j < n; j++)
        if (handles[j] < 0)
            return SHMW_EHANDLE;
    for (k = 0; k < w->shards && rc >= 0; k++) {
        shard_t *s = &w->shard[k];
        int locked = 0;
        for (j = 0; j < n && rc >= 0; j++) {
            if (shard_of(w, handles[j]) != s)
                continue;
            if (!locked && (rc = shmw__lock(s)))
                return rc;
            locked = 1;
            if ((rc = op(s, handles[j], arg)) > 0)
                done += rc;
        }
        if (locked)
            shmw__unlock(s);
    }
    return rc < 0 ? rc : done;
}

static int cancel_op(shard_t *w, int64_t handle, void *arg)
{
    (void)arg;
    return cancel_locked(w, handle);
}

int shmw_cancel_many(shmw_t *w, const int64_t *handles, uint32_t n)
{
    return shmw__by_shard(w, handles, n, cancel_op, NULL);
}

static int reset_checked(shmw_t *wheel, int64_t handle, double seconds, int absolute)
{
    struct shmw_entry *e;
    int64_t deadline_ns, now_ns = -1;
    uint64_t expires;
    uint32_t i, b;
    shard_t *w;
    int rc, wake = 0;

    if (!wheel)
        return SHMW_ECLOSED;
    if ((rc = deadline_of(seconds, absolute, &now_ns, &deadline_ns)))
        return rc;
    if (handle < 0)
        return SHMW_EHANDLE;
    if (!(w = shard_of(wheel, handle)))
        return 0;
    if ((rc = shmw__lock(w)))
        return rc;
    i = shmw__lookup(w, handle, SHMW_PENDING);
    if (i == SHMW_NIL) {
        shmw__unlock(w);
        return 0;
    }
    e = entry_at(w, i);
    rc = shmw__place(w, w->hdr->elapsed, shmw_ticks_ceil(deadline_ns, w->tick_ns), &b, &expires);
    if (rc == SHMW_OK && b != e->bucket)
        rc = bucket_can_take(w, b, lane_of(e->producer), expires);
    if (rc == SHMW_OK) {
        /* The new deadline first: if this process dies before the entry
         * is relinked, recovery files it by the deadline it now has. */
        STORE(e->deadline_ns, deadline_ns);
        if (!(b == e->bucket && w->buckets[b].expires == expires)) {
            rc = bucket_unlink(w, i);
            if (rc == SHMW_OK)
                rc = shmw__bucket_append(w, b, expires, i);
        }
    }
    if (rc == SHMW_OK) {
        STORE(w->hdr->resets, w->hdr->resets + 1);
        wake = shmw__wake_for(w, expires);
    }
    shmw__unlock(w);
    if (wake)
        wake_clock(w);
    return rc ? rc : 1;
}

int shmw_reset(shmw_t *w, int64_t handle, double delay_s)
{
    return reset_checked(w, handle, delay_s, 0);
}

int shmw_reset_at(shmw_t *w, int64_t handle, double deadline_s)
{
    return reset_checked(w, handle, deadline_s, 1);
}

/* ---- the advance ------------------------------------------------------------ */

void shmw__set_elapsed(shard_t *w, uint64_t t, int64_t now_ns)
{
    struct shmw_header *h = w->hdr;
    uint32_t l;

    STORE(h->elapsed, t);
    STORE(h->advanced_ns, now_ns);
    for (l = 0; l < w->levels; l++)
        STORE(h->level_clock[l], shmw_bucket_expiry(t, l, w->wheel_bits));
}

/* The first lane in use (a bit of `lanes`) at or after lane `from`, cyclically. */
static uint32_t next_lane(uint32_t lanes, uint32_t from)
{
    uint32_t later = lanes & (~0U << (from % SHMW_LANES));
    return (uint32_t)__builtin_ctz(later ? later : lanes);
}

int shmw__advance(shard_t *w, uint64_t now_tick, int64_t now_ns, uint32_t max, char *records,
                  uint32_t *fired, int *more)
{
    /* Advances the clock towards now_tick, firing at most `max` timers:
     * into `records` and straight back to the free list (records != NULL:
     * poll), or onto the in-flight FIFO (records == NULL: the driver).
     * Pops due buckets in expiry order.  A level-0 bucket fires whole; a
     * higher bucket is a cascade: the clock jumps to its expiry and its
     * timers go back in, each to a strictly later bucket of a lower level,
     * or fire if due at that very tick.  Entries are taken off the head
     * one at a time, so a call that stops early leaves the rest of the
     * bucket, and the clock, where they were: it stops after `max` fires
     * or SHMW_LOCK_WORK entries moved or fired, whichever comes first,
     * and sets *more if something due is left.  That bounds the lock
     * hold: cascading a million timers takes many short holds, not one of
     * tens of milliseconds. */
    struct shmw_header *h = w->hdr;
    uint32_t stride = record_stride(w);
    uint32_t n = 0, work = 0;
    int rc = SHMW_OK;

    *more = 0;
    for (;;) {
        struct shmw_bucket *bk;
        struct shmw_entry *e;
        uint32_t b, i, lanes, lane, nb = 0;
        uint64_t at, t, expires = 0;

        if (h->heap_len > w->nbuckets || (h->heap_len > 0 && w->heap[0] >= w->nbuckets)) {
            rc = SHMW_ECORRUPT;
            break;
        }
        if (h->heap_len == 0 || w->buckets[w->heap[0]].expires > now_tick) {
            if (now_tick > h->elapsed)
                shmw__set_elapsed(w, now_tick, now_ns);
            break;
        }
        if (n == max || work == SHMW_LOCK_WORK) {
            *more = 1;
            break;
        }
        b = w->heap[0];
        bk = &w->buckets[b];
        at = bk->expires;
        lanes = bk->lane_mask;
        if (lanes == 0 || lanes >> SHMW_LANES) {
            rc = SHMW_ECORRUPT;
            break;
        }
        /* The lanes in turn, one entry each: a producer that floods a
         * bucket (thousands of timers due in one tick, a forger's) holds
         * up the others' timers by one entry a turn, not by all of its own. */
        lane = next_lane(lanes, w->fire_lane);
        w->fire_lane = (lane + 1) % SHMW_LANES;
        i = list_of(w, lane, b)->head;
        if (at < h->elapsed || i >= w->capacity) {
            rc = SHMW_ECORRUPT;
            break;
        }
        e = entry_at(w, i);
        if (e->state != SHMW_PENDING || e->bucket != b || !shmw__entry_sane(w, e)) {
            rc = SHMW_ECORRUPT;
            break;
        }
        if (at > h->elapsed)
            shmw__set_elapsed(w, at, now_ns);
        work++;

        /* Check where the entry goes before it leaves its bucket. */
        t = shmw_ticks_ceil(e->deadline_ns, w->tick_ns);
        if (t > at) {
            if ((rc = shmw__place(w, at, t, &nb, &expires))
                || (rc = bucket_can_take(w, nb, lane_of(e->producer), expires)))
                break;
        } else if (!records && (rc = shmw__inflight_can_take(w))) {
            break;
        }
        if ((rc = bucket_unlink(w, i)))
            break;
        if (t > at) {
            /* Cascade. */
            if ((rc = shmw__bucket_append(w, nb, expires, i)))
                break;
            continue;
        }
        STORE(e->fired_at_ns, now_ns);
        STORE(h->fired, h->fired + 1);
        if (records) {
            shmw__write_record(w, i, records + (uint64_t)n * stride);
            shmw__slab_free(w, i, NULL);
        } else {
            shmw__inflight_append(w, i);
        }
        n++;
    }
    *fired = n;
    return rc;
}

int shmw_poll(shmw_t *w, double now_s, int use_clock, uint32_t max, char *records, int *more)
{
    /* Hands out, first, whatever a dead driver left in flight (marked
     * redelivered when its registration was released), then what is due:
     * shard by shard, each under its own lock, from the one after where
     * the last poll began, so that a shard that fills every call starves
     * none of the others. */
    uint32_t n = 0, t, first, stride;
    uint64_t now_tick;
    int64_t now_ns;
    int rc = SHMW_OK;

    if (!w)
        return SHMW_ECLOSED;
    if (use_clock)
        now_ns = shmw_now_ns();
    else if ((rc = shmw_seconds_to_ns(now_s, &now_ns)))
        return rc;
    now_tick = (uint64_t)now_ns / (uint64_t)w->shard[0].tick_ns;
    stride = record_stride(&w->shard[0]);

    *more = 0;
    first = __atomic_fetch_add(&w->take_from, 1, __ATOMIC_RELAXED);
    for (t = 0; t < w->shards && n < max && rc == SHMW_OK; t++) {
        shard_t *s = &w->shard[(first + t) % w->shards];
        uint32_t drained = 0, fired = 0;
        int left = 0;

        if ((rc = shmw__lock(s)))
            break;
        if (s->hdr->driver_pid != 0 && s->shard != 0) {
            /* Shard 0's registration decides: this one may be what a
             * registration cut short left (shmw_driver_register writes
             * shard 0 last), which is cleared here. */
            shmw__unlock(s);
            if ((rc = shmw__clear_leftover(w, s)) || (rc = shmw__lock(s)))
                break;
        }
        if (s->hdr->driver_pid != 0)
            rc = SHMW_EDRIVER;
        else if ((rc = shmw__inflight_drain(s, max - n, records + (uint64_t)n * stride, &drained)) == SHMW_OK)
            rc = shmw__advance(s, now_tick, now_ns, max - n - drained,
                               records + (uint64_t)(n + drained) * stride, &fired, &left);
        shmw__unlock(s);
        n += drained + fired;
        *more |= left;
    }
    if (n >= max && t < w->shards)
        *more = 1;              /* shards it did not look at */
    /* The timers fired before an error are freed already: their records
     * must reach the caller.  The error comes again with the next call. */
    if (rc && n > 0) {
        *more = 1;
        return (int)n;
    }
    return rc ? rc : (int)n;
}
