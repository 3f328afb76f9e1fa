/*
 * testing.h - the test hooks, built only into the tests' module
 * (shmwheel._shmwheel_testing, with SHMW_TESTING defined) and never into the
 * shipped one.  csrc/build_shmwheel.py reads the declarations below for the
 * tests' cdef, as it reads shmwheel.h for the shipped one.
 */
#ifndef SHMWHEEL_TESTING_H
#define SHMWHEEL_TESTING_H

#include "shmwheel.h"

/* The exit status of a process stopped by shmw_test_crash_after. */
#define SHMW_CRASH_EXIT 86

/* ---- cffi begin ---------------------------------------------------------- */

/* _exit(SHMW_CRASH_EXIT) before this process's n-th store to any segment
 * from now on (0: never). */
void shmw_test_crash_after(long n);
/* The same, but the process stops itself (SIGSTOP) there, holding the
 * lock, and carries on when it is continued. */
void shmw_test_stop_after(long n);
/* The longest sleep of the clocks of this process, SHMW_MAX_SLEEP_NS
 * (100 ms) by default, set to `ns` if 0 < ns <= SHMW_TEST_CLOCK_CAP_MAX_NS
 * (a day: now + cap stays far from overflow); returns the cap before the
 * call, so that 0 reads it. */
#define SHMW_TEST_CLOCK_CAP_MAX_NS 86400000000000LL
int64_t shmw_test_clock_cap(int64_t ns);
/* Where the regions after the header start, in bytes from the segment's. */
int  shmw_test_layout(shmw_t *w, uint64_t *buckets_off, uint64_t *heap_off, uint64_t *lists_off,
                      uint64_t *slab_off);

/* ---- cffi end ------------------------------------------------------------ */

#endif /* SHMWHEEL_TESTING_H */
