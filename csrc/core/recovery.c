/*
 * recovery.c - rebuilding a segment after a lock holder died mid-change, or
 * after a check found it scribbled on.
 *
 * What each entry says about itself (state, generation, deadline, payload)
 * is written before the one store that commits it, its state, so it is
 * authoritative; the free lists, the buckets and their heap and the
 * counters are derived from it and rebuilt here, in O(capacity + buckets),
 * without allocating.  An entry whose own fields make no sense (a scribble:
 * an unknown state, a generation that makes no handle, a payload longer
 * than its entry) is quarantined - retired, never handed out again - so
 * that a repair always succeeds and the healthy timers go on firing.  The
 * in-flight FIFO is kept if it passes its audit; otherwise it is rebuilt in
 * slab order, the entries handed out first and the cursor after them, so
 * that a live driver hands nothing out twice (a driver that died
 * redelivers all of it anyway, marked, when the next one registers).
 * Repair rewrites nothing an entry says about itself but links and the
 * state of a quarantined one, so it can be repeated: a repairer that dies
 * too leaves the next locker the same job.
 */
#include "core.h"
#include "heap-inl.h"

#include <stdio.h>

/* Retires entry i for good, whatever it was: a repair found it nonsensical. */
static void quarantine(shard_t *w, uint32_t i)
{
    struct shmw_entry *e = entry_at(w, i);

    STORE(e->next, SHMW_NIL); STORE(e->prev, SHMW_NIL); STORE(e->bucket, SHMW_NIL);
    STORE(e->flags, 0);
    COMMIT(e->state, SHMW_RETIRED);
    STORE(w->hdr->quarantined, w->hdr->quarantined + 1);
}

#define SAY(...) do { \
        if (reason && !said) { snprintf(reason, reason_len, __VA_ARGS__); said = 1; } \
    } while (0)

int shmw__repair_locked(shard_t *w, int64_t clock_limit_ns, char *reason, uint32_t reason_len)
{
    /* clock_limit_ns >= 0: a wheel clock past that time is set back to it
     * (a scribbled clock would fire every timer early).  The first thing
     * found wrong goes into reason, if it is not NULL and nothing is there
     * yet. */
    struct shmw_header *h = w->hdr;
    uint32_t i, b, inflight = 0;
    uint64_t expires, top;
    int rc, said = reason && reason_len && reason[0];

    /* (A wheel starts at its creation time rounded up to a tick: a clock
     * up to that is not ahead.) */
    if (clock_limit_ns >= 0 && h->elapsed > shmw_ticks_ceil(clock_limit_ns, w->tick_ns)) {
        SAY("header: the wheel clock, tick %llu, is ahead of the real clock",
            (unsigned long long)h->elapsed);
        STORE(h->elapsed, shmw_ticks_ceil(clock_limit_ns, w->tick_ns));
    }

    /* What an entry says about itself must make sense on its own, and a
     * pending one must have a place on the wheel. */
    for (i = 0; i < w->capacity; i++) {
        struct shmw_entry *e = entry_at(w, i);
        switch (e->state) {
        case SHMW_FREE:
        case SHMW_RETIRED:
            continue;
        case SHMW_PENDING:
        case SHMW_INFLIGHT:
            if (shmw__entry_sane(w, e)
                && (e->state == SHMW_INFLIGHT
                    || shmw__place(w, h->elapsed, shmw_ticks_ceil(e->deadline_ns, w->tick_ns), &b, &expires)
                       == SHMW_OK)) {
                inflight += e->state == SHMW_INFLIGHT;
                continue;
            }
            SAY("slab: entry %u in state %u makes no sense (generation %llu, payload_len %u, flags %#x)", i,
                e->state, (unsigned long long)e->generation, e->payload_len, e->flags);
            break;
        default:
            SAY("slab: entry %u has unknown state %u", i, e->state);
            break;
        }
        quarantine(w, i);
    }

    for (b = 0; b < w->nbuckets; b++) {
        STORE(w->buckets[b].lane_mask, 0);
        STORE(w->buckets[b].heap_pos, SHMW_NIL);
    }
    for (b = 0; b < SHMW_LANES * w->nbuckets; b++) {
        STORE(w->lists[b].head, SHMW_NIL); STORE(w->lists[b].tail, SHMW_NIL);
        STORE(w->lists[b].count, 0);
    }
    STORE(h->heap_len, 0);
    shmw__set_elapsed(w, h->elapsed, h->advanced_ns);

    if (h->inflight == inflight && shmw__inflight_audit(w, NULL, 0) == SHMW_OK) {
        inflight = 0;   /* kept as it is */
    } else {
        STORE(h->inflight_head, SHMW_NIL); STORE(h->inflight_tail, SHMW_NIL);
        STORE(h->inflight_unsent, SHMW_NIL);
        STORE(h->inflight, 0);
    }

    /* Every free entry to the shared list, highest index first, so that it
     * hands out low entries first; the magazines start empty. */
    STORE(h->free_head, SHMW_NIL);
    STORE(h->free_count, 0);
    for (b = 0; b < SHMW_LANES; b++) {
        STORE(h->magazines[b].free_head, SHMW_NIL);
        STORE(h->magazines[b].free_count, 0);
    }
    STORE(h->retired, 0);
    for (i = w->capacity; i-- > 0;) {
        struct shmw_entry *e = entry_at(w, i);
        switch (e->state) {
        case SHMW_FREE:
            if (e->generation >= w->max_generation) {
                COMMIT(e->state, SHMW_RETIRED);   /* died between alloc and commit */
                STORE(h->retired, h->retired + 1);
                break;
            }
            STORE(e->next, h->free_head);
            STORE(h->free_head, i);
            STORE(h->free_count, h->free_count + 1);
            break;
        case SHMW_RETIRED:
            STORE(h->retired, h->retired + 1);
            break;
        case SHMW_PENDING:
            if ((rc = shmw__place(w, h->elapsed, shmw_ticks_ceil(e->deadline_ns, w->tick_ns), &b, &expires)))
                return rc;      /* checked above: not reached */
            if ((rc = shmw__bucket_append(w, b, expires, i)))
                return rc;
            break;
        }
    }
    /* A broken in-flight FIFO: relink it in slab order, what was handed
     * out first, the unsent cursor on the first of the rest. */
    for (b = 0; b < 2 && inflight > 0; b++) {
        for (i = 0; i < w->capacity; i++) {
            struct shmw_entry *e = entry_at(w, i);
            if (e->state != SHMW_INFLIGHT || ((e->flags & SHMW_SENT) != 0) == b)
                continue;
            shmw__inflight_append(w, i);
            if (b == 0)
                STORE(h->inflight_unsent, SHMW_NIL);
        }
    }
    /* The registration is written in three stores; make them agree. */
    if (h->driver_pid == 0) {
        STORE(h->driver_state, SHMW_DRIVER_NONE);
        STORE(h->driver_start, 0);
    } else if (h->driver_state == SHMW_DRIVER_NONE || h->driver_state > SHMW_DRIVER_STOPPING) {
        STORE(h->driver_state, SHMW_DRIVER_RUNNING);
    }
    /* The heap the clock slept on is rebuilt: it sleeps until the new top
     * as far as producers know (they wake it for anything earlier), and
     * is woken to look at this shard again, once the lock is let go
     * (shmw__unlock: no system call under the lock). */
    if (h->driver_pid == 0)
        STORE(h->sleep_until, 0);
    else
        STORE(h->sleep_until, heap_top(w, &top) ? top : UINT64_MAX);
    __atomic_add_fetch(w->wake_word, 1, __ATOMIC_SEQ_CST);
    w->wake_after_unlock = 1;
    STORE(h->flags, h->flags & ~SHMW_F_DAMAGED);
    STORE(h->recoveries, h->recoveries + 1);
    return SHMW_OK;
}

#undef SAY

static int repair_shard(shard_t *w, int64_t now_ns, char *reason, uint32_t reason_len)
{
    int rc;

    if ((rc = shmw__lock_raw(w, 1)))
        return rc;
    /* The clock is read again under the lock: the driver's clock may have
     * moved the wheel past the caller's now meanwhile, which is no fault. */
    if (shmw_now_ns() > now_ns)
        now_ns = shmw_now_ns();
    if (shmw__check_locked(w, reason, reason_len) == SHMW_OK
        && w->hdr->elapsed <= shmw_ticks_ceil(now_ns, w->tick_ns)) {
        shmw__unlock(w);
        return 0;
    }
    rc = shmw__repair_locked(w, now_ns, reason, reason_len);
    if (rc == SHMW_OK) {
        /* Counted as a repair, not as a recovery from a dead holder. */
        STORE(w->hdr->recoveries, w->hdr->recoveries - 1);
        STORE(w->hdr->repairs, w->hdr->repairs + 1);
    } else {
        STORE(w->hdr->flags, w->hdr->flags | SHMW_F_DAMAGED);
    }
    /* The clock may be asleep on a bucket the repair moved, the dispatcher
     * on fires the rebuilt list put back: both look again. */
    __atomic_add_fetch(w->wake_word, 1, __ATOMIC_SEQ_CST);
    __atomic_add_fetch(w->outbox_word, 1, __ATOMIC_SEQ_CST);
    shmw__unlock(w);
    shmw__futex_wake_all(w->wake_word);
    shmw__futex_wake_all(w->outbox_word);
    return rc ? rc : 1;
}

int shmw_repair(shmw_t *w, int64_t now_ns, char *reason, uint32_t reason_len)
{
    /* Each shard in turn, under its own lock; the reason is the first
     * shard's that was repaired (or could not be), named. */
    char mine[200];
    uint32_t k;
    int rc, repaired = 0;

    if (!w)
        return SHMW_ECLOSED;
    if (now_ns < 0)
        return SHMW_EINVAL;
    if (reason && reason_len)
        reason[0] = '\0';
    for (k = 0; k < w->shards; k++) {
        mine[0] = '\0';
        rc = repair_shard(&w->shard[k], now_ns, mine, sizeof(mine));
        if (rc != 0 && reason && reason_len && !reason[0])
            shmw__name_shard(w, k, mine, reason, reason_len);
        if (rc < 0)
            return rc;
        repaired |= rc;
    }
    return repaired;
}
