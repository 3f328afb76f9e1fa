/*
 * producers.c - the producer table: which processes have attached.
 *
 * A producer id is an index into the header's table of SHMW_MAX_PRODUCERS;
 * it holds the process's pid, PID namespace and start time, so that a pid
 * reused by another process is never taken for it.  An attached process's
 * timers are filed under its id (the id picks the lane), and its
 * SHMW_CANCEL_ON_EXIT timers are cancelled by the driver once the process
 * is gone (reap), after which its id is freed (release).  The pid is the
 * store that commits an id.
 */
#include "core.h"

int shmw_producer_attach(shmw_t *w, int32_t pid, int64_t start, uint32_t pidns)
{
    struct shmw_header *h;
    uint32_t k, id = SHMW_NO_PRODUCER;
    int rc;

    if (pid <= 0)
        return SHMW_EINVAL;
    if ((rc = shmw__enter(w)))
        return rc;
    h = w->hdr;
    for (k = 0; k < SHMW_MAX_PRODUCERS; k++) {
        const struct shmw_producer *p = &h->producers[k];
        if (p->pid == pid && p->start == start && p->pidns == pidns) {
            id = k;             /* this process attached before */
            break;
        }
        if (p->pid == 0 && id == SHMW_NO_PRODUCER)
            id = k;
    }
    if (id != SHMW_NO_PRODUCER && h->producers[id].pid != pid) {
        STORE(h->producers[id].start, start);
        STORE(h->producers[id].pidns, pidns);
        COMMIT(h->producers[id].pid, pid);      /* commits the id */
    }
    shmw__unlock(w);
    if (id == SHMW_NO_PRODUCER)
        return SHMW_EPRODUCERS;
    w->producer = id;
    w->producer_pid = pid;
    return (int)id;
}

int shmw_producers(shmw_t *w, int32_t *pids, int64_t *starts, uint32_t *pidns, uint32_t max)
{
    /* The whole table, by id (pid 0: free); returns the ids in use. */
    uint32_t k, n = 0;
    int rc;

    if (!w)
        return SHMW_ECLOSED;
    if (max < SHMW_MAX_PRODUCERS)
        return SHMW_EINVAL;
    if ((rc = shmw__lock_raw(w, 1)))     /* a look, which a damaged segment allows */
        return rc;
    for (k = 0; k < SHMW_MAX_PRODUCERS; k++) {
        pids[k] = w->hdr->producers[k].pid;
        starts[k] = w->hdr->producers[k].start;
        pidns[k] = w->hdr->producers[k].pidns;
        n += pids[k] != 0;
    }
    shmw__unlock(w);
    return (int)n;
}

static int producer_is(const shmw_t *w, uint32_t id, int32_t pid, int64_t start)
{
    return id < SHMW_MAX_PRODUCERS && pid > 0 && w->hdr->producers[id].pid == pid
        && w->hdr->producers[id].start == start;
}

int shmw_producer_reap(shmw_t *w, uint32_t id, int32_t pid, int64_t start, uint32_t from, uint32_t count)
{
    /* O(count) under the lock: the caller sweeps the slab in ranges so
     * that no hold is long. */
    uint32_t i, end, done = 0;
    int rc;

    if ((rc = shmw__enter(w)))
        return rc;
    if (!producer_is(w, id, pid, start)) {
        shmw__unlock(w);
        return SHMW_ESTALE;
    }
    end = from < w->capacity && count < w->capacity - from ? from + count : w->capacity;
    for (i = from; i < end; i++) {
        struct shmw_entry *e = entry_at(w, i);
        if (e->state != SHMW_PENDING || e->producer != id || !(e->flags & SHMW_CANCEL_ON_EXIT))
            continue;
        if ((rc = shmw__cancel_entry(w, i)))
            break;
        done++;
    }
    shmw__unlock(w);
    return rc ? rc : (int)done;
}

int shmw_producer_release(shmw_t *w, uint32_t id, int32_t pid, int64_t start)
{
    int rc;

    if ((rc = shmw__enter(w)))
        return rc;
    if (producer_is(w, id, pid, start)) {
        STORE(w->hdr->producers[id].pid, 0);
        STORE(w->hdr->producers[id].start, 0);
        STORE(w->hdr->producers[id].pidns, 0);
    } else {
        rc = SHMW_ESTALE;
    }
    shmw__unlock(w);
    return rc;
}
