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

uint32_t shmw__pending_locked(const shard_t *w)
{
    /* (A scribbled count gives 0 rather than a wrapped number.) */
    const struct shmw_header *h = w->hdr;
    uint64_t other = (uint64_t)h->free_count + h->retired + h->inflight;

    return other <= w->capacity ? w->capacity - (uint32_t)other : 0;
}

int shmw_pending(shmw_t *w)
{
    uint64_t n = 0;
    uint32_t k;
    int rc;

    if (!w)
        return SHMW_ECLOSED;
    for (k = 0; k < w->shards; k++) {
        if ((rc = shmw__lock(&w->shard[k])))
            return rc;
        n += shmw__pending_locked(&w->shard[k]);
        shmw__unlock(&w->shard[k]);
    }
    return (int)n;      /* <= capacity <= SHMW_MAX_CAPACITY: fits an int */
}

/* One shard's figures added to *out (its lock held). */
static void add_shard(const shard_t *w, struct shmw_stats *out)
{
    const struct shmw_header *h = w->hdr;
    uint64_t next;
    uint32_t k;

    out->pending += shmw__pending_locked(w);
    out->free += h->free_count;
    out->reserve += w->reserve;
    out->retired += h->retired;
    out->added += h->added;
    out->cancelled += h->cancelled;
    out->fired += h->fired;
    out->resets += h->resets;
    out->buckets_in_heap += h->heap_len;
    if (heap_top(w, &next) && (out->next_expiry_ns < 0 || ticks_to_ns(w, next) < out->next_expiry_ns))
        out->next_expiry_ns = ticks_to_ns(w, next);
    for (k = 0; k < h->heap_len && k < w->nbuckets; k++) {
        uint32_t b = w->heap[k], l = b >> w->wheel_bits, m;
        if (b >= w->nbuckets || l >= w->levels)
            continue;
        for (m = w->buckets[b].lane_mask & ((1U << SHMW_LANES) - 1); m; m &= m - 1)  /* the lanes in use */
            out->level_pending[l] += list_of(w, (uint32_t)__builtin_ctz(m), b)->count;
    }
    out->inflight += h->inflight;
    out->acked += h->acked;
    out->redelivered += h->redelivered;
    out->handler_errors += h->handler_errors;
    out->refused += h->refused;
    out->recoveries += h->recoveries;
    out->repairs += h->repairs;
    out->quarantined += h->quarantined;
    /* The clock: the shard it moved last (it moves the others only when
     * they have something due or a producer wakes it for them). */
    if (h->advanced_ns > out->advanced_ns) {
        out->advanced_ns = h->advanced_ns;
        out->elapsed = h->elapsed;
        out->clock_ns = ticks_to_ns(w, h->elapsed);
    }
    out->removed |= h->removed != 0;
}

int shmw_stats(shmw_t *w, struct shmw_stats *out)
{
    /* The shards' figures summed, each read under its own lock; the
     * driver's registration as shard 0 has it. */
    const struct shmw_header *h0;
    uint32_t k;
    int rc;

    if (!w)
        return SHMW_ECLOSED;
    memset(out, 0, sizeof(*out));
    out->capacity = w->capacity;
    out->tick_ns = w->shard[0].tick_ns;
    out->payload_size = w->payload_size;
    out->wheel_size = 1ULL << w->shard[0].wheel_bits;
    out->levels = w->shard[0].levels;
    out->shards = w->shards;
    out->next_expiry_ns = -1;
    out->advanced_ns = INT64_MIN;
    for (k = 0; k < w->shards; k++) {
        if ((rc = shmw__lock_raw(&w->shard[k], 1)))     /* a damaged segment can still be looked at, and opened to repair */
            return rc;
        add_shard(&w->shard[k], out);
        if (k == 0) {
            h0 = w->shard[0].hdr;
            out->driver_pid = h0->driver_pid;
            out->driver_start = h0->driver_start;
            out->driver_state = h0->driver_state;
        }
        shmw__unlock(&w->shard[k]);
    }
    if (__atomic_load_n(&w->top->passed_ns, __ATOMIC_RELAXED) > out->advanced_ns)
        out->advanced_ns = __atomic_load_n(&w->top->passed_ns, __ATOMIC_RELAXED);
    return SHMW_OK;
}

int shmw_snapshot(shmw_t *w, uint32_t *at, uint32_t max, char *records)
{
    /* Entries whose own fields make no sense are left out: a repair
     * quarantines them, and a reader is no place to say so. */
    shard_t *s;
    uint32_t i, end, n = 0, stride;
    int rc;

    if (!w)
        return SHMW_ECLOSED;
    if (!at || !records || !max)
        return SHMW_EINVAL;     /* (no room for a record: a walk would never move on) */
    if (*at >= w->capacity)
        return 0;
    s = &w->shard[shmw__divide(*at, &w->by_shard)];
    i = *at - s->index_base;
    end = i + SHMW_SNAPSHOT_WORK < s->capacity ? i + SHMW_SNAPSHOT_WORK : s->capacity;
    stride = record_stride(s);
    if ((rc = shmw__lock(s)))
        return rc;
    for (; i < end && n < max; i++) {
        const struct shmw_entry *e = entry_at(s, i);
        uint8_t state = e->state;
        if ((state != SHMW_PENDING && state != SHMW_INFLIGHT) || !shmw__entry_sane(s, e))
            continue;
        shmw__write_record(s, i, records + (uint64_t)n * stride);
        if (state == SHMW_INFLIGHT)
            ((struct shmw_fire *)(records + (uint64_t)n * stride))->flags |= SHMW_FIRED;
        n++;
    }
    shmw__unlock(s);
    *at = s->index_base + i;
    return (int)n;
}

int shmw_count(shmw_t *w, uint32_t counter, uint64_t n)
{
    if (!w)
        return SHMW_ECLOSED;
    if (counter >= SHMW_COUNTERS)
        return SHMW_EINVAL;
    __atomic_fetch_add(&w->users->counters[counter], n, __ATOMIC_RELAXED);
    return SHMW_OK;
}

int shmw_counters(shmw_t *w, uint64_t *out, uint32_t n)
{
    uint32_t k;

    if (!w)
        return SHMW_ECLOSED;
    if (!out || n > SHMW_COUNTERS)
        return SHMW_EINVAL;
    for (k = 0; k < n; k++)
        out[k] = __atomic_load_n(&w->users->counters[k], __ATOMIC_RELAXED);
    return SHMW_OK;
}

int shmw_set_note(shmw_t *w, const char *note, uint32_t len)
{
    int rc;

    if (!w)
        return SHMW_ECLOSED;
    if ((!note && len) || len > SHMW_NOTE_SIZE)
        return SHMW_EINVAL;
    if ((rc = shmw__lock(&w->shard[0])))
        return rc;
    STORE(w->users->note_len, 0);         /* a holder that dies half-way leaves no note, not half of one */
    if (len)
        memcpy(w->users->note, note, len);
    STORE(w->users->note_len, len);
    shmw__unlock(&w->shard[0]);
    return SHMW_OK;
}

int shmw_note(shmw_t *w, char *out, uint32_t cap)
{
    uint32_t len;
    int rc;

    if (!w)
        return SHMW_ECLOSED;
    if (!out && cap)
        return SHMW_EINVAL;
    if ((rc = shmw__lock(&w->shard[0])))
        return rc;
    len = w->users->note_len <= SHMW_NOTE_SIZE ? w->users->note_len : 0;       /* (scribbled: none) */
    if (len && cap)
        memcpy(out, w->users->note, len < cap ? len : cap);
    shmw__unlock(&w->shard[0]);
    return (int)len;
}
