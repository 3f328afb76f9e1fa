/*
 * heap-inl.h - the delay-heap: a binary min-heap of the non-empty buckets'
 * indices, keyed by bucket expiry, so that the clock jumps from one
 * non-empty bucket to the next instead of ticking through empty ones.  Each
 * bucket records its position, so that a bucket a cancel empties leaves the
 * heap in O(log B).  Inline, as libuv keeps its timer heap: an add that
 * fills an empty bucket pushes it on the hot path (wheel.c), and the
 * driver's clock and stats read its top.
 *
 * The callers have checked every index they pass; indices read back from
 * the heap array are checked here, and a bad one is SHMW_ECORRUPT.
 */
#ifndef SHMWHEEL_HEAP_INL_H
#define SHMWHEEL_HEAP_INL_H

#include "core.h"

static inline int heap_less(const shard_t *w, uint32_t a, uint32_t b)
{
    return w->buckets[a].expires < w->buckets[b].expires;
}

static inline void heap_place(shard_t *w, uint32_t pos, uint32_t b)
{
    STORE(w->heap[pos], b);
    STORE(w->buckets[b].heap_pos, pos);
}

static inline int heap_sift_up(shard_t *w, uint32_t pos)
{
    uint32_t b;

    if (pos >= w->nbuckets || (b = w->heap[pos]) >= w->nbuckets)
        return SHMW_ECORRUPT;
    while (pos > 0) {
        uint32_t parent = (pos - 1) / 2;
        uint32_t pb = w->heap[parent];
        if (pb >= w->nbuckets)
            return SHMW_ECORRUPT;
        if (!heap_less(w, b, pb))
            break;
        heap_place(w, pos, pb);
        pos = parent;
    }
    heap_place(w, pos, b);
    return SHMW_OK;
}

static inline int heap_sift_down(shard_t *w, uint32_t pos, uint32_t len)
{
    uint32_t b = w->heap[pos];

    for (;;) {
        uint32_t child = 2 * pos + 1;
        uint32_t cb;
        if (child >= len)
            break;
        cb = w->heap[child];
        if (cb >= w->nbuckets)
            return SHMW_ECORRUPT;
        if (child + 1 < len) {
            uint32_t rb = w->heap[child + 1];
            if (rb >= w->nbuckets)
                return SHMW_ECORRUPT;
            if (heap_less(w, rb, cb)) {
                child++;
                cb = rb;
            }
        }
        if (!heap_less(w, cb, b))
            break;
        heap_place(w, pos, cb);
        pos = child;
    }
    heap_place(w, pos, b);
    return SHMW_OK;
}

static inline int heap_push(shard_t *w, uint32_t b)
{
    uint32_t len = w->hdr->heap_len;

    if (len >= w->nbuckets)
        return SHMW_ECORRUPT;
    STORE(w->heap[len], b);
    STORE(w->hdr->heap_len, len + 1);
    return heap_sift_up(w, len);
}

static inline int heap_remove(shard_t *w, uint32_t b)
{
    uint32_t pos = w->buckets[b].heap_pos;
    uint32_t len = w->hdr->heap_len;
    uint32_t last;
    int rc;

    if (len == 0 || len > w->nbuckets || pos >= len || w->heap[pos] != b)
        return SHMW_ECORRUPT;
    len--;
    STORE(w->hdr->heap_len, len);
    STORE(w->buckets[b].heap_pos, SHMW_NIL);
    if (pos == len)
        return SHMW_OK;
    last = w->heap[len];
    if (last >= w->nbuckets)
        return SHMW_ECORRUPT;
    heap_place(w, pos, last);
    rc = heap_sift_down(w, pos, len);
    if (rc)
        return rc;
    pos = w->buckets[last].heap_pos;    /* read back: where sift_down left it */
    return pos < len ? heap_sift_up(w, pos) : SHMW_ECORRUPT;
}

/* The earliest non-empty bucket's expiry in *expires, or 0 if the heap is
 * empty or its top is out of bounds. */
static inline int heap_top(const shard_t *w, uint64_t *expires)
{
    const struct shmw_header *h = w->hdr;

    if (h->heap_len == 0 || h->heap_len > w->nbuckets || w->heap[0] >= w->nbuckets)
        return 0;
    *expires = w->buckets[w->heap[0]].expires;
    return 1;
}

#endif /* SHMWHEEL_HEAP_INL_H */
