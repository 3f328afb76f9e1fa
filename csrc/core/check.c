/*
 * check.c - the invariant checker: one function per structure, each naming
 * the first thing it finds wrong.
 *
 * O(capacity + buckets), under the lock, and it allocates nothing: each
 * list is walked for exactly as many steps as its count says and must end
 * there, which together with the totals per state proves every entry is on
 * exactly one list.  Every index is checked before it is followed, so the
 * checker is safe on any bytes.
 */
#include "core.h"

#include <stdio.h>

#define FAIL(...) do { \
        if (reason) snprintf(reason, reason_len, __VA_ARGS__); \
        return SHMW_ECORRUPT; \
    } while (0)

/* The header: identity, the parameters as they were at open, the level clocks. */
static int check_header(const shard_t *w, char *reason, uint32_t reason_len)
{
    const struct shmw_header *h = w->hdr;
    uint32_t l;

    if (__atomic_load_n(&h->magic, __ATOMIC_ACQUIRE) != SHMW_MAGIC)
        FAIL("header: magic overwritten");
    if (h->flags & SHMW_F_DAMAGED)
        FAIL("header: a process died holding the lock and left the segment inconsistent");
    if (h->capacity != w->capacity || h->tick_ns != w->tick_ns || h->payload_size != w->payload_size
        || h->wheel_bits != w->wheel_bits || h->levels != w->levels || h->stride != w->stride
        || h->index_bits != w->index_bits || (h->handle_key & w->max_generation) != w->handle_key
        || h->shard != w->shard || h->shards != w->shards)
        FAIL("header: parameters changed since open");
    for (l = 0; l < w->levels; l++)
        if (h->level_clock[l] != shmw_bucket_expiry(h->elapsed, l, w->wheel_bits))
            FAIL("header: level %u clock %llu does not match elapsed %llu", l,
                 (unsigned long long)h->level_clock[l], (unsigned long long)h->elapsed);
    if (h->driver_state > SHMW_DRIVER_STOPPING || (h->driver_pid == 0) != (h->driver_state == SHMW_DRIVER_NONE))
        FAIL("driver: state %u does not match pid %d", h->driver_state, h->driver_pid);
    return SHMW_OK;
}

/* Every entry on its own, and the counters against the states; the
 * number of pending entries into *pending. */
static int check_slab(const shard_t *w, uint64_t *pending, char *reason, uint32_t reason_len)
{
    const struct shmw_header *h = w->hdr;
    uint64_t seen[SHMW_INFLIGHT + 1] = { 0 };
    uint32_t i;

    for (i = 0; i < w->capacity; i++) {
        const struct shmw_entry *e = entry_at(w, i);
        if (e->state > SHMW_INFLIGHT)
            FAIL("slab: entry %u has unknown state %u", i, e->state);
        if ((e->state != SHMW_RETIRED && e->generation > w->max_generation)  /* a retired one's is unused */
            || (e->state == SHMW_FREE && e->generation == w->max_generation)
            || ((e->state == SHMW_PENDING || e->state == SHMW_INFLIGHT) && e->generation == 0))
            FAIL("slab: entry %u in state %u has generation %llu out of range", i, e->state,
                 (unsigned long long)e->generation);
        if ((e->state == SHMW_PENDING || e->state == SHMW_INFLIGHT) && !shmw__entry_sane(w, e))
            FAIL("slab: entry %u in state %u makes no sense (payload_len %u, deadline %lld, flags %#x, "
                 "producer %u)", i, e->state, e->payload_len, (long long)e->deadline_ns, e->flags, e->producer);
        seen[e->state]++;
    }
    if (seen[SHMW_FREE] != h->free_count)
        FAIL("counters: free_count is %u but %llu entries are free", h->free_count,
             (unsigned long long)seen[SHMW_FREE]);
    if (seen[SHMW_RETIRED] != h->retired)
        FAIL("counters: retired is %u but %llu entries are retired", h->retired,
             (unsigned long long)seen[SHMW_RETIRED]);
    if (seen[SHMW_INFLIGHT] != h->inflight)
        FAIL("counters: inflight is %u but %llu entries are in flight", h->inflight,
             (unsigned long long)seen[SHMW_INFLIGHT]);
    *pending = seen[SHMW_PENDING];
    return SHMW_OK;
}

/* The free lists: the shared one and each magazine end in NIL, hold only
 * free entries, and are free_count long together.  Lists that end in NIL
 * and share an entry share their last one, so distinct last entries (and
 * the walks' total) put every free entry on exactly one list. */
static int check_free_lists(const shard_t *w, char *reason, uint32_t reason_len)
{
    const struct shmw_header *h = w->hdr;
    uint32_t last[SHMW_LANES + 1], lane, total = 0, i, k, l;

    for (lane = 0; lane <= SHMW_LANES; lane++) {
        uint32_t max = lane < SHMW_LANES ? h->magazines[lane].free_count : w->capacity;
        const char *name = lane < SHMW_LANES ? "magazine" : "shared free list";
        /* Before the walk: the count bounds it, and a free list has no
         * back links to stop a loop early. */
        if (lane < SHMW_LANES && max >= 2 * SHMW_MAGAZINE)
            FAIL("magazine %u: count %u, over %u", lane, max, 2 * SHMW_MAGAZINE - 1);
        i = lane < SHMW_LANES ? h->magazines[lane].free_head : h->free_head;
        last[lane] = SHMW_NIL;
        for (k = 0; k < max && i != SHMW_NIL; k++) {
            if (i >= w->capacity)
                FAIL("%s %u: step %u has index %u out of bounds", name, lane, k, i);
            if (entry_at(w, i)->state != SHMW_FREE)
                FAIL("%s %u: entry %u is not free", name, lane, i);
            last[lane] = i;
            i = entry_at(w, i)->next;
        }
        if (i != SHMW_NIL)
            FAIL("%s %u: longer than %u", name, lane, max);
        if (lane < SHMW_LANES && k != max)
            FAIL("magazine %u: %u long, its count says %u", lane, k, max);
        total += k;
        for (l = 0; l < lane; l++)
            if (last[lane] != SHMW_NIL && last[l] == last[lane])
                FAIL("free lists: %u and %u share entry %u", l, lane, last[lane]);
    }
    if (total != h->free_count)
        FAIL("free lists: %u entries on them, free_count is %u", total, h->free_count);
    return SHMW_OK;
}

/* Lane `lane`'s list of non-empty bucket b: count long, doubly linked,
 * pending entries of that lane that point back at b, each due within the
 * bucket. */
static int check_list(const shard_t *w, uint32_t b, uint32_t lane, char *reason, uint32_t reason_len)
{
    const struct shmw_bucket *bk = &w->buckets[b];
    const struct shmw_list *ls = list_of(w, lane, b);
    uint32_t level = b >> w->wheel_bits, prev = SHMW_NIL, i = ls->head, k;
    uint64_t gran = level * w->wheel_bits >= 64 ? UINT64_MAX : 1ULL << (level * w->wheel_bits);

    for (k = 0; k < ls->count; k++) {
        const struct shmw_entry *e;
        uint64_t t;
        if (i >= w->capacity)
            FAIL("bucket %u: lane %u step %u has index %u out of bounds", b, lane, k, i);
        e = entry_at(w, i);
        if (e->state != SHMW_PENDING || e->bucket != b || e->prev != prev || lane_of(e->producer) != lane)
            FAIL("bucket %u: entry %u is not linked as a pending member of lane %u", b, i, lane);
        t = shmw_ticks_ceil(e->deadline_ns, w->tick_ns);
        /* Level 0 holds its own tick, and overdue timers only in the
         * bucket at the clock; level l holds W^l ticks from its expiry. */
        if (level == 0 ? (t > bk->expires || (t < bk->expires && bk->expires != w->hdr->elapsed))
                       : (t < bk->expires || t - bk->expires >= gran))
            FAIL("bucket %u: entry %u due at tick %llu outside the bucket [%llu, +%llu)", b, i,
                 (unsigned long long)t, (unsigned long long)bk->expires, (unsigned long long)gran);
        prev = i;
        i = e->next;
    }
    if (i != SHMW_NIL || ls->tail != prev)
        FAIL("bucket %u: lane %u does not end after count %u", b, lane, ls->count);
    return SHMW_OK;
}

/* Bucket b: its lane mask says which lists are non-empty; a non-empty one
 * is at its heap position, not behind the clock, at the slot its expiry
 * gives, within its level's window, and each of its lists checks.  The
 * entries in it are added to *entries. */
static int check_bucket(const shard_t *w, uint32_t b, uint64_t *entries, char *reason, uint32_t reason_len)
{
    const struct shmw_header *h = w->hdr;
    const struct shmw_bucket *bk = &w->buckets[b];
    uint32_t level = b >> w->wheel_bits, lane, lanes = 0;
    int rc;

    for (lane = 0; lane < SHMW_LANES; lane++) {
        const struct shmw_list *ls = list_of(w, lane, b);
        if (ls->count > 0)
            lanes |= 1U << lane;
        else if (ls->head != SHMW_NIL || ls->tail != SHMW_NIL)
            FAIL("bucket %u: lane %u empty but linked", b, lane);
    }
    if (bk->lane_mask != lanes)
        FAIL("bucket %u: lane bits %#x, lists in use %#x", b, bk->lane_mask, lanes);
    if (lanes == 0) {
        if (bk->heap_pos != SHMW_NIL)
            FAIL("bucket %u: empty but in the delay-heap", b);
        return SHMW_OK;
    }
    if (bk->heap_pos >= h->heap_len || bk->heap_pos >= w->nbuckets || w->heap[bk->heap_pos] != b)
        FAIL("bucket %u: not at its heap position %u", b, bk->heap_pos);
    if (bk->expires < h->elapsed)
        FAIL("bucket %u: expires at tick %llu, before the clock %llu", b,
             (unsigned long long)bk->expires, (unsigned long long)h->elapsed);
    if (shmw_slot_for(bk->expires, level, w->wheel_bits) != (b & w->wheel_mask)
        || shmw_bucket_expiry(bk->expires, level, w->wheel_bits) != bk->expires)
        FAIL("bucket %u: expiry %llu does not belong to this slot", b, (unsigned long long)bk->expires);
    /* Within the level's window: what makes one slot mean one range. */
    if (shmw_level_for(shmw_bucket_expiry(h->elapsed, level, w->wheel_bits), bk->expires, w->wheel_bits) > level)
        FAIL("bucket %u: expiry %llu is beyond its level's window", b, (unsigned long long)bk->expires);
    for (lane = 0; lane < SHMW_LANES; lane++) {
        if ((rc = check_list(w, b, lane, reason, reason_len)))
            return rc;
        *entries += list_of(w, lane, b)->count;
    }
    return SHMW_OK;
}

/* Every bucket, then the delay-heap: as many buckets in it as are
 * non-empty, holding `pending` entries, each position no earlier than its
 * parent. */
static int check_wheel(const shard_t *w, uint64_t pending, char *reason, uint32_t reason_len)
{
    const struct shmw_header *h = w->hdr;
    uint64_t entries = 0, nonempty = 0;
    uint32_t b, k;
    int rc;

    for (b = 0; b < w->nbuckets; b++) {
        if ((rc = check_bucket(w, b, &entries, reason, reason_len)))
            return rc;
        nonempty += w->buckets[b].lane_mask != 0;
    }
    if (entries != pending)
        FAIL("buckets: hold %llu entries, %llu are pending", (unsigned long long)entries,
             (unsigned long long)pending);
    if (nonempty != h->heap_len)
        FAIL("delay-heap: %u buckets, %llu non-empty", h->heap_len, (unsigned long long)nonempty);
    /* heap_len <= nbuckets now; each heap[k] names a non-empty bucket that
     * points back at k (checked above), so the indices are in bounds. */
    for (k = 1; k < h->heap_len; k++)
        if (w->buckets[w->heap[k]].expires < w->buckets[w->heap[(k - 1) / 2]].expires)
            FAIL("delay-heap: position %u expires before its parent", k);
    return SHMW_OK;
}

int shmw__check_locked(shard_t *w, char *reason, uint32_t reason_len)
{
    uint64_t pending = 0;
    int rc;

    if ((rc = check_header(w, reason, reason_len))
        || (rc = check_slab(w, &pending, reason, reason_len))
        || (rc = shmw__inflight_audit(w, reason, reason_len))
        || (rc = check_free_lists(w, reason, reason_len))
        || (rc = check_wheel(w, pending, reason, reason_len)))
        return rc;
    return SHMW_OK;
}

static int check_shard(shard_t *w, char *reason, uint32_t reason_len)
{
    int rc;

    if ((rc = shmw__lock(w))) {
        if (reason)
            snprintf(reason, reason_len, rc == SHMW_ECORRUPT
                     ? "a process died holding the lock and left the segment inconsistent"
                     : "the lock cannot be taken");
        return rc;
    }
    rc = shmw__check_locked(w, reason, reason_len);
    shmw__unlock(w);
    return rc;
}

void shmw__name_shard(const shmw_t *w, uint32_t k, const char *said, char *reason, uint32_t reason_len)
{
    if (w->shards == 1)
        snprintf(reason, reason_len, "%s", said);
    else
        snprintf(reason, reason_len, "shard %u: %s", k, said);
}

int shmw_check(shmw_t *w, char *reason, uint32_t reason_len)
{
    /* The top's identity, then each shard under its own lock. */
    char mine[200];
    uint32_t k;
    int rc;

    if (!w)
        return SHMW_ECLOSED;
    if (__atomic_load_n(&w->top->magic, __ATOMIC_ACQUIRE) != SHMW_MAGIC)
        FAIL("header: magic overwritten");
    if (w->top->shards != w->shards || w->top->shard_capacity != w->shard_capacity)
        FAIL("header: parameters changed since open");
    for (k = 0; k < w->shards; k++) {
        mine[0] = '\0';
        if ((rc = check_shard(&w->shard[k], mine, sizeof(mine)))) {
            if (reason)
                shmw__name_shard(w, k, mine, reason, reason_len);
            return rc;
        }
    }
    return SHMW_OK;
}
