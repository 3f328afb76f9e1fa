/*
 * slab.c - the slab of timer entries and its free lists.
 *
 * An entry describes itself (state, generation, deadline, payload): those
 * fields are written before the one store that commits it, its state, and
 * a repair trusts nothing else.  Free entries are on the shared free list
 * or in a lane's magazine, a LIFO that only that lane's processes take
 * from, so a process gets back the entry it freed last, whose cache line
 * its CPU still has.  An empty magazine takes SHMW_MAGAZINE entries from
 * the shared list (or, when that is empty too, from another lane: no entry
 * is ever out of reach); one that reaches 2 * SHMW_MAGAZINE gives
 * SHMW_MAGAZINE back.  Each move walks SHMW_MAGAZINE links, once every
 * SHMW_MAGAZINE operations at most: O(1) amortised.  free_count in the
 * header is the total, so that "is there room" is one load.
 *
 * Generations go up when an entry is handed out, not when it is freed: a
 * process that dies between the two stores of either leaves an entry whose
 * next handle is still new.  An entry whose generation has reached the
 * maximum is retired when freed instead of reused.
 */
#include "core.h"

uint32_t shmw__lookup(const shard_t *w, int64_t handle, uint8_t state)
{
    /* The entry a handle names if it is in `state`, or NIL. */
    uint32_t i = handle_index(w, handle);
    struct shmw_entry *e;

    if (i >= w->capacity)
        return SHMW_NIL;
    e = entry_at(w, i);
    if (e->state != state || e->generation != handle_generation(w, handle))
        return SHMW_NIL;
    return i;
}

int shmw__entry_sane(const shard_t *w, const struct shmw_entry *e)
{
    /* Whether what a pending or in-flight entry says about itself can be
     * turned into a fire: a generation that makes a handle, a payload
     * length within the entry, a deadline that is a time, known flags, a
     * producer id that exists, and, once fired, a firing time not before
     * the deadline.  An entry that fails is never handed out: the
     * operation that meets it reports SHMW_ECORRUPT, and a repair
     * quarantines it. */
    return e->generation != 0 && e->generation <= w->max_generation
        && e->payload_len <= w->payload_size && e->deadline_ns >= 0
        && !(e->flags & ~(SHMW_REDELIVERED | SHMW_CANCEL_ON_EXIT | SHMW_SENT | SHMW_KEPT))
        && (e->producer < SHMW_MAX_PRODUCERS || e->producer == SHMW_NO_PRODUCER)
        && (e->state != SHMW_INFLIGHT || e->fired_at_ns >= e->deadline_ns);
}

/* Cuts up to `max` (<= SHMW_MAGAZINE) entries off the free list at *head,
 * fewer only where it ends, and gives the first and the last; `exact`:
 * the list must hold `max`.  One walk checks them all, and the link left
 * behind, before anything changes: ECORRUPT if an entry is not free or a
 * link is out of bounds.  Returns how many (0: the list is empty). */
static int chain_cut(shard_t *w, uint32_t *head, uint32_t max, int exact, uint32_t *first, uint32_t *last)
{
    uint32_t i = *head, prev = SHMW_NIL, n = 0;

    while (n < max && i != SHMW_NIL) {
        if (i >= w->capacity || entry_at(w, i)->state != SHMW_FREE)
            return SHMW_ECORRUPT;
        prev = i;
        i = entry_at(w, i)->next;
        n++;
    }
    if ((i != SHMW_NIL && i >= w->capacity) || (exact && n < max))
        return SHMW_ECORRUPT;
    if (n == 0)
        return 0;
    *first = *head;
    *last = prev;
    STORE(*head, i);
    STORE(entry_at(w, prev)->next, SHMW_NIL);
    return (int)n;
}

/* Fills an empty magazine: from the shared list, or, when that is empty
 * too (the wheel is nearly full), from the first magazine with any. */
static int magazine_refill(shard_t *w, struct shmw_magazine *mag)
{
    struct shmw_header *h = w->hdr;
    uint32_t first = SHMW_NIL, last, k;
    int n;

    if (mag->free_head != SHMW_NIL)
        return SHMW_ECORRUPT;
    n = chain_cut(w, &h->free_head, SHMW_MAGAZINE, 0, &first, &last);
    if (n == 0) {
        struct shmw_magazine *other;
        for (k = 0; k < SHMW_LANES && h->magazines[k].free_count == 0; k++)
            ;
        if (k == SHMW_LANES)
            return SHMW_ECORRUPT;           /* free_count said there were some */
        other = &h->magazines[k];
        n = chain_cut(w, &other->free_head, other->free_count < SHMW_MAGAZINE ? other->free_count : SHMW_MAGAZINE,
                      1, &first, &last);
        if (n > 0)
            STORE(other->free_count, other->free_count - (uint32_t)n);
    }
    if (n < 0)
        return n;
    STORE(mag->free_head, first);
    STORE(mag->free_count, (uint32_t)n);
    return SHMW_OK;
}

/* Gives the top SHMW_MAGAZINE entries of a full magazine back to the
 * shared list.  A magazine that does not walk is left as it is, for check
 * to report: nothing has been lost yet. */
static void magazine_spill(shard_t *w, struct shmw_magazine *mag)
{
    struct shmw_header *h = w->hdr;
    uint32_t first, last;

    if (chain_cut(w, &mag->free_head, SHMW_MAGAZINE, 1, &first, &last) != (int)SHMW_MAGAZINE)
        return;
    STORE(mag->free_count, mag->free_count - SHMW_MAGAZINE);
    STORE(entry_at(w, last)->next, h->free_head);
    STORE(h->free_head, first);
}

void shmw__slab_free(shard_t *w, uint32_t i, uint64_t *count)
{
    /* Entry i, off every list, to the magazine of the process that frees
     * it, or retired if its generations are used up; counted in *count
     * (the header's cancelled or acked), unless it is NULL. */
    struct shmw_entry *e = entry_at(w, i);
    struct shmw_header *h = w->hdr;
    struct shmw_magazine *mag = &h->magazines[lane_of(my_producer(w))];

    if (count)
        STORE(*count, *count + 1);

    STORE(e->prev, SHMW_NIL); STORE(e->bucket, SHMW_NIL);
    STORE(e->flags, 0);
    if (e->generation >= w->max_generation) {
        STORE(e->next, SHMW_NIL);
        COMMIT(e->state, SHMW_RETIRED);
        STORE(h->retired, h->retired + 1);
        return;
    }
    STORE(e->next, mag->free_head);
    COMMIT(e->state, SHMW_FREE);
    STORE(mag->free_head, i);
    STORE(mag->free_count, mag->free_count + 1);
    STORE(h->free_count, h->free_count + 1);
    if (mag->free_count >= 2 * SHMW_MAGAZINE)
        magazine_spill(w, mag);
}

int shmw__slab_take(shard_t *w, uint32_t lane, int reserved, uint32_t *out)
{
    /* A free entry for a timer of `lane`, from its magazine, with its
     * generation moved on; the last w->reserve only if `reserved`. */
    struct shmw_header *h = w->hdr;
    struct shmw_magazine *mag = &h->magazines[lane];
    struct shmw_entry *e;
    uint32_t i;
    int rc;

    if (h->free_count <= (reserved ? 0 : w->reserve))
        return SHMW_EFULL;
    if (mag->free_count == 0 && (rc = magazine_refill(w, mag)))
        return rc;
    i = mag->free_head;
    if (i >= w->capacity)
        return SHMW_ECORRUPT;
    e = entry_at(w, i);
    if (e->state != SHMW_FREE || (e->next != SHMW_NIL && e->next >= w->capacity)
        || e->generation >= w->max_generation)
        return SHMW_ECORRUPT;   /* a bad generation would make a negative handle */
    STORE(mag->free_head, e->next);
    STORE(mag->free_count, mag->free_count - 1);
    STORE(h->free_count, h->free_count - 1);
    STORE(e->generation, e->generation + 1);
    *out = i;
    return SHMW_OK;
}
