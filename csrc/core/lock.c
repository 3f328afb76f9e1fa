/*
 * lock.c - the segment's one lock and its futex words.
 *
 * The lock is a process-shared, robust pthread mutex in the header.  Taking
 * it spins briefly, then waits at most the lock timeout: every hold is
 * bounded (SHMW_LOCK_WORK), so a lock not taken by then is jammed.  A
 * holder that died hands EOWNERDEAD to the next locker, which repairs the
 * segment (recovery.c) before it goes on.
 *
 * The futex words let the driver's threads sleep outside the lock: a word
 * is bumped with an atomic under the lock and FUTEX_WAKE is called after
 * unlocking, so no system call runs under the lock, and no wake-up is lost
 * because a sleeper passes the value it read under the lock to FUTEX_WAIT.
 */
#define _GNU_SOURCE
#include "core.h"

#include <errno.h>
#include <time.h>
#include <unistd.h>
#include <linux/futex.h>
#include <sys/syscall.h>

static inline void cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield" ::: "memory");
#else
    __asm__ __volatile__("" ::: "memory");
#endif
}

/* Whether a busy mutex is worth another trylock.  glibc keeps the owner's
 * thread ID in the first word of a robust mutex (0 when free; only the
 * OWNER_DIED bit once its owner is gone); a plain load of it leaves the
 * cache line shared with the holder, where a trylock would take it away
 * and slow the very hold we are waiting out. */
static inline int mutex_may_be_free(pthread_mutex_t *m)
{
#ifdef __GLIBC__
    return (__atomic_load_n(&m->__data.__lock, __ATOMIC_RELAXED) & FUTEX_TID_MASK) == 0;
#else
    (void)m;
    return 1;
#endif
}

int shmw__lock_raw(shard_t *w, int wait)
{
    /* Uncontended, trylock is the whole cost.  Contended, spin briefly
     * first: a producer's hold is a few dozen nanoseconds, and sleeping on
     * the futex costs a system call and a context switch on each side -
     * worse, every sleeper turns the next unlock into a FUTEX_WAKE, so
     * busy producers end up queueing behind each other (a lock convoy;
     * two processes adding flat out get fewer adds done than one).  Only
     * then wait, at most the lock timeout: no holder keeps the lock that
     * long, so a lock not taken by then is jammed - its word scribbled to
     * name a thread that never existed, say - and waiting on would hang
     * every process.  A caller that must not block (it keeps Python's GIL,
     * and every thread of its process would wait with it) spins for about
     * one producer's hold and gives up (SHMW_LOCK_TRY); one that has other
     * shards to serve meanwhile (the driver's clock and dispatcher) spins
     * as long as a waiter would and gives up (SHMW_LOCK_SPIN), so that a
     * holder stopped in one shard holds up that shard alone. */
    pthread_mutex_t *m = &w->hdr->mutex;
    int rc = pthread_mutex_trylock(m);
    uint32_t spins, max_spins = wait == SHMW_LOCK_TRY ? SHMW_TRY_SPINS : SHMW_LOCK_SPINS;

    for (spins = 0; rc == EBUSY && spins < max_spins; spins++) {
        cpu_relax();
        if (mutex_may_be_free(m))
            rc = pthread_mutex_trylock(m);
    }
    if (rc == EBUSY && wait != SHMW_LOCK_WAIT)
        return SHMW_EBUSY;
    if (rc == EBUSY) {
        int64_t until = shmw_now_ns() + w->lock_timeout_ns;
        struct timespec ts = { until / 1000000000LL, until % 1000000000LL };
        rc = pthread_mutex_clocklock(m, CLOCK_MONOTONIC, &ts);
    }

    if (rc == EOWNERDEAD) {
        /* The previous holder died inside a critical section: rebuild what
         * it may have left half-made, then mark the mutex consistent, so
         * that nobody ever sees ENOTRECOVERABLE.  If the repairer dies
         * too, the next locker gets EOWNERDEAD and repairs again.  Only a
         * segment repair cannot make sense of stays flagged damaged. */
        if (shmw__repair_locked(w, -1, NULL, 0) != SHMW_OK)
            STORE(w->hdr->flags, w->hdr->flags | SHMW_F_DAMAGED);
        pthread_mutex_consistent(m);
        rc = 0;
    }
    if (rc)
        w->timed_out_ns = shmw_now_ns();   /* for shmw_lock_holder */
    return rc ? SHMW_ELOCK : SHMW_OK;
}

int shmw__lock_mode(shard_t *w, int wait)
{
    int rc = shmw__lock_raw(w, wait);

    if (rc)
        return rc;
    if (w->hdr->flags & SHMW_F_DAMAGED) {
        pthread_mutex_unlock(&w->hdr->mutex);
        return SHMW_ECORRUPT;
    }
    return SHMW_OK;
}

void shmw__unlock(shard_t *w)
{
    pthread_mutex_unlock(&w->hdr->mutex);
    if (__builtin_expect(w->wake_after_unlock, 0)) {
        w->wake_after_unlock = 0;
        shmw__futex_wake_all(w->wake_word);
    }
}

int shmw_set_lock_timeout(shmw_t *w, int64_t timeout_ns)
{
    uint32_t k;

    if (!w)
        return SHMW_ECLOSED;
    if (timeout_ns <= 0)
        return SHMW_EINVAL;
    for (k = 0; k < w->shards; k++)
        w->shard[k].lock_timeout_ns = timeout_ns;
    return SHMW_OK;
}

int32_t shmw_lock_holder(shmw_t *w)
{
    /* The thread ID glibc keeps in a robust mutex's lock word, as the
     * holder's own PID namespace numbers it: of the shard whose lock timed
     * out last in this process, or else of the first whose lock is held;
     * read without the locks, so it may be stale by the time the caller
     * looks the thread up. */
    uint32_t k;

    if (!w)
        return 0;
#ifdef __GLIBC__
    uint32_t last = 0;

    for (k = 1; k < w->shards; k++)     /* the shard whose lock timed out last in this process */
        if (w->shard[k].timed_out_ns > w->shard[last].timed_out_ns)
            last = k;
    for (k = 0; k < w->shards; k++) {   /* that one, else the first held */
        uint32_t j = k == 0 ? last : (k == last ? 0 : k);
        int32_t tid = (int32_t)(__atomic_load_n(&w->shard[j].hdr->mutex.__data.__lock, __ATOMIC_RELAXED)
                                & FUTEX_TID_MASK);
        if (tid)
            return tid;
    }
#else
    (void)k;
#endif
    return 0;
}

/* ---- futexes -------------------------------------------------------------- */

static long futex(uint32_t *word, int op, uint32_t val, const struct timespec *ts)
{
    return syscall(SYS_futex, word, op, val, ts, NULL, FUTEX_BITSET_MATCH_ANY);
}

void shmw__futex_wake_all(uint32_t *word)
{
    futex(word, FUTEX_WAKE, INT32_MAX, NULL);
}

/* Sleeps while *word == seen, until the absolute CLOCK_MONOTONIC time
 * deadline_ns (< 0: no limit).  Returns at once if the word has moved on. */
void shmw__futex_wait_until(uint32_t *word, uint32_t seen, int64_t deadline_ns)
{
    struct timespec ts;

    if (deadline_ns < 0) {
        futex(word, FUTEX_WAIT_BITSET, seen, NULL);
        return;
    }
    ts.tv_sec = deadline_ns / 1000000000LL;
    ts.tv_nsec = deadline_ns % 1000000000LL;
    futex(word, FUTEX_WAIT_BITSET, seen, &ts);
}

/* The clock sleeps until the earliest of the shards' sleep_until (each 0
 * while the clock looks at it, or there is no driver).  A timer due before
 * its shard's must wake it: the top's word is bumped here, under the
 * lock, and the caller wakes the clock after unlocking if this returns 1.
 * Lowering sleep_until makes later adds for the same moment skip the
 * system call. */
int shmw__wake_for(shard_t *w, uint64_t expires)
{
    struct shmw_header *h = w->hdr;

    if (expires >= h->sleep_until)
        return 0;
    STORE(h->sleep_until, expires);
    __atomic_add_fetch(w->wake_word, 1, __ATOMIC_SEQ_CST);
    return 1;
}
