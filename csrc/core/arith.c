/*
 * arith.c - pure arithmetic: ticks, levels, wheel slots, bucket expiries,
 * the handle's index bits, seconds to nanoseconds.  No segment, no side
 * effects; every function is total (any input gives an answer, never
 * undefined behaviour) and is tested at every boundary (tests/test_arith.py).
 */
#include "core.h"

#include <math.h>
#include <time.h>

uint64_t shmw_ticks_ceil(int64_t ns, int64_t tick_ns)
{
    if (ns <= 0 || tick_ns <= 0)
        return 0;
    return (uint64_t)ns / (uint64_t)tick_ns + ((uint64_t)ns % (uint64_t)tick_ns != 0);
}

uint32_t shmw_level_for(uint64_t elapsed, uint64_t t, uint32_t wheel_bits)
{
    /* The lowest level whose window of W buckets past its own clock holds t.
     * A t at or before the clock belongs in level 0 (it is due). */
    uint64_t w = 1ULL << wheel_bits;
    uint32_t level = 0;
    uint32_t shift = 0;

    if (t <= elapsed || wheel_bits == 0 || wheel_bits >= 32)
        return 0;
    for (; shift < 64; level++, shift += wheel_bits)
        if ((t >> shift) - (elapsed >> shift) < w)
            return level;
    return level;               /* both shifted to 0 */
}

uint32_t shmw_slot_for(uint64_t t, uint32_t level, uint32_t wheel_bits)
{
    uint32_t shift = level * wheel_bits;

    if (shift >= 64 || wheel_bits >= 32)
        return 0;
    return (uint32_t)((t >> shift) & ((1ULL << wheel_bits) - 1));
}

uint64_t shmw_bucket_expiry(uint64_t t, uint32_t level, uint32_t wheel_bits)
{
    uint32_t shift = level * wheel_bits;

    if (shift >= 64)
        return 0;
    return t & ~((1ULL << shift) - 1);
}

uint32_t shmw_levels_for(int64_t tick_ns, uint32_t wheel_bits)
{
    /* Smallest L whose top window, (W - 1) * W^(L-1) ticks, exceeds twice
     * the longest delay: the delay itself plus as much again of driver lag
     * (elapsed behind the real clock), so that every accepted timer has a
     * level even if nobody polls for a century. */
    uint64_t need = 2 * shmw_ticks_ceil(SHMW_MAX_DELAY_NS, tick_ns) + 2;
    uint64_t w, window;
    uint32_t levels = 1;

    if (wheel_bits == 0 || wheel_bits >= 32 || tick_ns <= 0)
        return SHMW_MAX_LEVELS + 1;   /* no such wheel */
    w = 1ULL << wheel_bits;
    window = w - 1;

    while (window <= need && levels < SHMW_MAX_LEVELS) {
        if (window > UINT64_MAX / w)
            return levels + 1;  /* the next level covers every uint64_t */
        window *= w;
        levels++;
    }
    return levels;
}

uint32_t shmw_index_bits(uint32_t capacity)
{
    uint32_t bits = 0;

    while (bits < 32 && (1ULL << bits) < capacity)
        bits++;
    return bits;
}

int shmw_seconds_to_ns(double seconds, int64_t *out)
{
    double ns;

    if (isnan(seconds) || isinf(seconds) || seconds < 0)
        return SHMW_ETIME;
    ns = nearbyint(seconds * 1e9);
    if (ns >= 9.2e18)           /* just under INT64_MAX */
        return SHMW_ERANGE;
    *out = (int64_t)ns;
    return SHMW_OK;
}

int64_t shmw_now_ns(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);  /* vDSO: no system call */
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}
