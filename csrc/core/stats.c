/*
 * stats.c - what a segment holds, read under the lock in one go.
 *
 * Timers pending are not counted on every add and cancel: every entry is
 * free, retired, in flight or pending, and the first three are counted
 * anyway; the per-level figures come from the non-empty buckets, O(heap_len)
 * once per call.  A damaged segment can still be looked at.
 */
#include "core.h"
#include "heap-inl.h"

#include <string.h>

uint32_t shmw__pending_locked(const shmw_t *w)
{
    /* (A scribbled count gives 0 rather than a wrapped number.) */
    const struct shmw_header *h = w->hdr;
    uint64_t other = (uint64_t)h->free_count + h->retired + h->inflight;

    return other <= w->capacity ? w->capacity - (uint32_t)other : 0;
}

int shmw_pending(shmw_t *w)
{
    uint32_t n;
    int rc;

    if ((rc = shmw__enter(w)))
        return rc;
    n = shmw__pending_locked(w);     /* <= capacity <= SHMW_MAX_CAPACITY: fits an int */
    shmw__unlock(w);
    return (int)n;
}

int shmw_stats(shmw_t *w, struct shmw_stats *out)
{
    struct shmw_header *h;
    uint64_t next;
    uint32_t k;
    int rc;

    if (!w)
        return SHMW_ECLOSED;
    h = w->hdr;
    memset(out, 0, sizeof(*out));
    if ((rc = shmw__lock_raw(w, 1)))     /* a damaged segment can still be looked at, and opened to repair */
        return rc;
    out->capacity = w->capacity;
    out->pending = shmw__pending_locked(w);
    out->free = h->free_count;
    out->reserve = w->reserve;
    out->retired = h->retired;
    out->added = h->added;
    out->cancelled = h->cancelled;
    out->fired = h->fired;
    out->resets = h->resets;
    out->elapsed = h->elapsed;
    out->tick_ns = w->tick_ns;
    out->payload_size = w->payload_size;
    out->wheel_size = 1ULL << w->wheel_bits;
    out->levels = w->levels;
    out->buckets_in_heap = h->heap_len;
    out->next_expiry_ns = heap_top(w, &next) ? ticks_to_ns(w, next) : -1;
    for (k = 0; k < h->heap_len && k < w->nbuckets; k++) {
        uint32_t b = w->heap[k], l = b >> w->wheel_bits, m;
        if (b >= w->nbuckets || l >= w->levels)
            continue;
        for (m = w->buckets[b].lane_mask & ((1U << SHMW_LANES) - 1); m; m &= m - 1)  /* the lanes in use */
            out->level_pending[l] += list_of(w, (uint32_t)__builtin_ctz(m), b)->count;
    }
    out->driver_pid = h->driver_pid;
    out->driver_start = h->driver_start;
    out->driver_state = h->driver_state;
    out->inflight = h->inflight;
    out->acked = h->acked;
    out->redelivered = h->redelivered;
    out->handler_errors = h->handler_errors;
    out->refused = h->refused;
    out->advanced_ns = h->advanced_ns;
    out->clock_ns = ticks_to_ns(w, h->elapsed);
    out->recoveries = h->recoveries;
    out->repairs = h->repairs;
    out->quarantined = h->quarantined;
    out->removed = h->removed != 0;
    shmw__unlock(w);
    return SHMW_OK;
}
