/*
 * testing.c - the test hooks (testing.h): crash points, the clock's cap
 * and the layout probe.  Built only with SHMW_TESTING, which also puts a
 * crash point before every store of the core (core/core.h): off (0) by
 * default, a crash point costs one predictable branch.
 */
#include "testing.h"
#include "core/core.h"

#include <signal.h>
#include <unistd.h>

#ifndef SHMW_TESTING
#error "testing.c is for the tests' build only: define SHMW_TESTING"
#endif

long shmw__crash_countdown;
static int crash_stops;         /* SIGSTOP instead of _exit: a holder frozen mid-operation */

void shmw__crash_now(void)
{
    if (crash_stops)
        raise(SIGSTOP);         /* and carries on when continued */
    else
        _exit(SHMW_CRASH_EXIT);
}

void shmw_test_crash_after(long n)
{
    shmw__crash_countdown = n > 0 ? n : 0;
    crash_stops = 0;
}

void shmw_test_stop_after(long n)
{
    shmw__crash_countdown = n > 0 ? n : 0;
    crash_stops = 1;
}

int64_t shmw__clock_cap_ns = SHMW_MAX_SLEEP_NS;

int64_t shmw_test_clock_cap(int64_t ns)
{
    int64_t before = __atomic_load_n(&shmw__clock_cap_ns, __ATOMIC_RELAXED);

    if (ns > 0 && ns <= SHMW_TEST_CLOCK_CAP_MAX_NS)
        __atomic_store_n(&shmw__clock_cap_ns, ns, __ATOMIC_RELAXED);
    return before;
}

int shmw_test_layout(shmw_t *w, uint64_t *buckets_off, uint64_t *heap_off, uint64_t *lists_off,
                     uint64_t *slab_off)
{
    if (!w)
        return SHMW_ECLOSED;
    /* Shard 0's, from the segment's first byte. */
    *buckets_off = (uint64_t)((char *)w->shard[0].buckets - (char *)w->top);
    *heap_off = (uint64_t)((char *)w->shard[0].heap - (char *)w->top);
    *lists_off = (uint64_t)((char *)w->shard[0].lists - (char *)w->top);
    *slab_off = (uint64_t)(w->shard[0].slab - (char *)w->top);
    return SHMW_OK;
}
