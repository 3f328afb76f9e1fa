/*
 * producers.c - the producer table: which processes have attached.
 *
 * A producer id is an index into the top's table of SHMW_MAX_PRODUCERS;
 * it holds the process's pid, PID namespace and start time, so that a pid
 * reused by another process is never taken for it.  An attached process's
 * timers are filed under its id (the id picks the shard and the lane), and its
 * SHMW_CANCEL_ON_EXIT timers are cancelled by the driver once the process
 * is gone (reap), after which its id is freed (release).  The pid is the
 * store that commits an id.
 */
#include "core.h"

/* Row g of the table is written under the lock of the shard of that
 * producer's adds (shard_of_producer), and only there. */

/* The next id of shard k after g: its ids come in blocks of SHMW_LANES,
 * every shards-th block. */
static uint32_t next_id(const shmw_t *w, uint32_t g)
{
    return g % SHMW_LANES < SHMW_LANES - 1 ? g + 1 : g + 1 + (w->shards - 1) * SHMW_LANES;
}

static int find_own(const shmw_t *w, int32_t pid, int64_t start, uint32_t pidns, uint32_t *id)
{
    /* Whether this process holds an id already (attached before), read
     * without the shards' locks: only this process writes a row with its
     * own pid, start and namespace, and the pid (which commits a row) is
     * read first, with acquire. */
    const struct shmw_producer *rows = w->top->producers;
    uint32_t g;

    for (g = 0; g < SHMW_MAX_PRODUCERS; g++)
        if (__atomic_load_n(&rows[g].pid, __ATOMIC_ACQUIRE) == pid && rows[g].start == start
            && rows[g].pidns == pidns) {
            *id = g;
            return 1;
        }
    return 0;
}

int shmw_producer_attach(shmw_t *w, int32_t pid, int64_t start, uint32_t pidns)
{
    /* An id of the next shard round the table that has one free, so that
     * the attached processes spread evenly over the shards. */
    struct shmw_producer *rows;
    uint32_t t, k, g, id = SHMW_NO_PRODUCER, first;
    int rc;

    if (!w)
        return SHMW_ECLOSED;
    if (pid <= 0)
        return SHMW_EINVAL;
    rows = w->top->producers;
    rc = find_own(w, pid, start, pidns, &id);
    first = __atomic_fetch_add(&w->top->next_shard, 1, __ATOMIC_RELAXED);
    /* A shard whose lock stays busy (its holder stopped) is passed over
     * the first time round, and waited for only on the second. */
    for (t = 0; rc == 0 && t < 2 * w->shards; t++) {
        k = (first + t) % w->shards;
        if ((rc = shmw__lock_mode(&w->shard[k], t < w->shards ? SHMW_LOCK_SPIN : SHMW_LOCK_WAIT)) == SHMW_EBUSY) {
            rc = 0;
            continue;
        }
        if (rc)
            return rc;
        for (g = k * SHMW_LANES; g < SHMW_MAX_PRODUCERS && rows[g].pid != 0; g = next_id(w, g))
            ;
        if (g < SHMW_MAX_PRODUCERS) {
            STORE(rows[g].start, start);
            STORE(rows[g].pidns, pidns);
            COMMIT(rows[g].pid, pid);      /* commits the id */
            id = g;
            rc = 1;
        }
        shmw__unlock(&w->shard[k]);
    }
    if (id == SHMW_NO_PRODUCER)
        return SHMW_EPRODUCERS;
    w->producer = id;
    w->home = &w->shard[shard_of_producer(w->shards, id)];
    __atomic_store_n(&w->producer_pid, pid, __ATOMIC_RELEASE);     /* after home: home_of reads them the other way */
    for (k = 0; k < w->shards; k++) {
        w->shard[k].producer = id;
        w->shard[k].producer_pid = pid;
    }
    return (int)id;
}

int shmw_producers(shmw_t *w, int32_t *pids, int64_t *starts, uint32_t *pidns, uint32_t max)
{
    /* The whole table, by id (pid 0: free); returns the ids in use. */
    const struct shmw_producer *rows;
    uint32_t k, g, n = 0;
    int rc;

    if (!w)
        return SHMW_ECLOSED;
    if (max < SHMW_MAX_PRODUCERS)
        return SHMW_EINVAL;
    rows = w->top->producers;
    for (k = 0; k < w->shards; k++) {
        if ((rc = shmw__lock_raw(&w->shard[k], 1)))     /* a look, which a damaged segment allows */
            return rc;
        for (g = k * SHMW_LANES; g < SHMW_MAX_PRODUCERS; g = next_id(w, g)) {
            pids[g] = rows[g].pid;
            starts[g] = rows[g].start;
            pidns[g] = rows[g].pidns;
            n += pids[g] != 0;
        }
        shmw__unlock(&w->shard[k]);
    }
    return (int)n;
}

/* Whether row id still holds that process.  Read under another shard's
 * lock by reap: the row of a dead producer changes only at its release. */
static int producer_is(const shmw_t *w, uint32_t id, int32_t pid, int64_t start)
{
    const struct shmw_producer *rows = w->top->producers;

    return id < SHMW_MAX_PRODUCERS && pid > 0 && __atomic_load_n(&rows[id].pid, __ATOMIC_RELAXED) == pid
        && __atomic_load_n(&rows[id].start, __ATOMIC_RELAXED) == start;
}

int shmw_producer_reap(shmw_t *w, uint32_t id, int32_t pid, int64_t start, uint32_t from, uint32_t count)
{
    /* O(count) under the locks of the shards the slab indices [from,
     * from + count) fall in, one at a time: the caller sweeps the slab in
     * ranges so that no hold is long.  Its timers are in every shard its
     * adds spilled into, not only its own. */
    uint32_t k, i, end, done = 0;
    int rc = SHMW_OK;

    if (!w)
        return SHMW_ECLOSED;
    end = from < w->capacity && count < w->capacity - from ? from + count : w->capacity;
    for (k = from / w->shard_capacity; k < w->shards && k * w->shard_capacity < end; k++) {
        shard_t *s = &w->shard[k];
        uint32_t lo = from > s->index_base ? from - s->index_base : 0;
        uint32_t hi = end - s->index_base < s->capacity ? end - s->index_base : s->capacity;

        if ((rc = shmw__lock(s)))
            return rc;
        if (!producer_is(w, id, pid, start)) {
            shmw__unlock(s);
            return SHMW_ESTALE;
        }
        for (i = lo; i < hi; i++) {
            struct shmw_entry *e = entry_at(s, i);
            if (e->state != SHMW_PENDING || e->producer != id || !(e->flags & SHMW_CANCEL_ON_EXIT))
                continue;
            if ((rc = shmw__cancel_entry(s, i)))
                break;
            done++;
        }
        shmw__unlock(s);
        if (rc)
            return rc;
    }
    if (done == 0 && !producer_is(w, id, pid, start))
        return SHMW_ESTALE;     /* a range past the slab: the check all the same */
    return (int)done;
}

int shmw_producer_release(shmw_t *w, uint32_t id, int32_t pid, int64_t start)
{
    struct shmw_producer *rows;
    shard_t *s;
    int rc;

    if (!w)
        return SHMW_ECLOSED;
    if (id >= SHMW_MAX_PRODUCERS)
        return SHMW_ESTALE;
    rows = w->top->producers;
    s = &w->shard[shard_of_producer(w->shards, id)];
    if ((rc = shmw__lock(s)))
        return rc;
    if (producer_is(w, id, pid, start)) {
        STORE(rows[id].pid, 0);
        STORE(rows[id].start, 0);
        STORE(rows[id].pidns, 0);
    } else {
        rc = SHMW_ESTALE;
    }
    shmw__unlock(s);
    return rc;
}
