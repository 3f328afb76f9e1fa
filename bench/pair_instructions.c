/*
 * pair_instructions.c - the add/cancel path counted in instructions, which a
 * shared, noisy machine does not disturb: the same binary gives the same
 * count whatever else runs.  Compare two builds of the core this way; time
 * them with bench/micro.py and bench/contention.c.
 *
 *     gcc -O2 -flto -std=gnu11 -Icsrc bench/pair_instructions.c csrc/core/[a-z]*.c -lpthread -lm -o /tmp/pair_instructions
 *     valgrind --tool=callgrind --callgrind-out-file=/dev/null /tmp/pair_instructions
 *
 * It makes a wheel of 100,000 entries in private memory (no segment is
 * left anywhere), adds 1,000 timers an hour away, then runs PAIRS add +
 * cancel pairs of a 30 s timer, as a request timeout does.  Divide the
 * difference of two counts by PAIRS.
 */
#include "shmwheel.h"

#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#ifndef PAIRS
#define PAIRS 200000
#endif

int main(void)
{
    struct shmw_params p = { 100000, 0, 8, 1000000, 0 };
    uint64_t size;
    shmw_t *w;
    void *base;
    int i;

    if (shmw_segment_size(&p, &size) || !(base = aligned_alloc(64, (size + 63) & ~63ULL))
        || shmw_init(base, size, &p, shmw_now_ns()) || shmw_open(base, size, &w)
        || shmw_producer_attach(w, getpid(), 1, 0) < 0) {
        fprintf(stderr, "pair_instructions: could not make a wheel\n");
        return 1;
    }
    for (i = 0; i < 1000; i++)
        shmw_add(w, 3600.0 + i, NULL, 0, 0);
    for (i = 0; i < PAIRS; i++)
        if (shmw_cancel(w, shmw_add(w, 30.0, NULL, 0, 0)) != 1) {
            fprintf(stderr, "pair_instructions: add + cancel failed\n");
            return 1;
        }
    printf("%d add + cancel pairs, %d timers pending\n", PAIRS, shmw_pending(w));
    shmw_close(w);
    free(base);
    return 0;
}
