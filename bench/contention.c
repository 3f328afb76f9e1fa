/*
 * contention.c - what an add or a cancel costs in C when other processes
 * share the segment, with no Python around it.
 *
 *     gcc -O2 -flto -std=gnu11 -Icsrc bench/contention.c csrc/core/[a-z]*.c -lpthread -lm -o /tmp/contention
 *     /tmp/contention [GAP_NS [SECONDS [MAX_PRODUCERS [ROUNDS [SHARDS]]]]]
 *
 * Each of 1 .. MAX_PRODUCERS (default 2) processes, forked onto one wheel in
 * anonymous shared memory, adds a timer due in 5 s, keeps it for a while (the
 * last 600 of its timers are pending at any time) and cancels it; between
 * two operations it spins for GAP_NS (default 1200 ns, about what the
 * Python request loop of compare/stress.py spends around each call).  It reports
 * the time spent inside shmw_add and shmw_cancel, per operation, read with
 * clock_gettime around each call (two clock reads, some 50 ns, included).
 *
 * The wheel has SHARDS shards (default: MAX_PRODUCERS, one a process, as
 * a request-timeout wheel has one a CPU); 1 is the wheel of one lock.
 * Each process attaches as a producer, as shmwheel.attach does, and so
 * has a shard, or with fewer shards than processes a lane, of its own.  Alone, that is the operation.  With a second
 * process it adds what the two pay for sharing: the lock, and the cache
 * line that holds it and the counters, which moves from one CPU's cache
 * to the other's on almost every operation.  What a move
 * costs depends on where the CPUs sit; on a VM, on where the host has put
 * its vCPUs at that moment, so ROUNDS (default 5) rounds are run and each
 * is printed.  Nothing is left behind: the memory is anonymous.
 *
 * Each count of processes runs twice a round: sharing one wheel, and as
 * the machine's own control, each process on a wheel of its own, the same
 * loop sharing nothing.  What the control loses with more processes is the
 * machine's (a turbo clock that drops, hyperthreads that share a core,
 * memory bandwidth), not the wheel's.  After the last round, for each
 * count: the median of the rounds, shared and alone, and the shared
 * median over one process's, the figure the wheel is held to.
 */
#include "shmwheel.h"

#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define MAX_PROCS  16
#define MAX_ROUNDS 99
#define HELD       600            /* timers each process keeps pending */
#define RING       1024           /* > HELD */
#define DELAY_S    5.0            /* far beyond the run: nothing fires */

struct report {
    uint64_t ops;
    int64_t  op_ns;               /* inside shmw_add / shmw_cancel */
    uint64_t failed;              /* operations that returned an error */
};

static int64_t now_ns(void)
{
    struct timespec t;

    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000000LL + t.tv_nsec;
}

/* Busy work the compiler cannot drop: a dependent chain of multiplies. */
static volatile uint64_t sink;

static void spin(uint32_t rounds)
{
    uint64_t x = sink;

    for (uint32_t i = 0; i < rounds; i++)
        x = x * 6364136223846793005ULL + 1442695040888963407ULL;
    sink = x;
}

static uint32_t rounds_for(int64_t gap_ns)
{
    int64_t t = now_ns();

    spin(10000000);
    t = now_ns() - t;
    return (uint32_t)(gap_ns * 10000000 / (t > 0 ? t : 1));
}

static void produce(void *base, uint64_t size, double seconds, uint32_t gap, struct report *out)
{
    int64_t ring[RING];
    uint32_t head = 0, held = 0;
    int64_t end, t;
    shmw_t *w;

    int slot;

    /* A producer slot of its own, as shmwheel.attach takes: its lane. */
    if (shmw_open(base, size, &w) != SHMW_OK || (slot = shmw_producer_attach(w, getpid(), 0, 0)) < 0)
        _exit(1);
    end = now_ns() + (int64_t)(seconds * 1e9);
    while (now_ns() < end) {
        for (int k = 0; k < 100; k++) {
            t = now_ns();
            int64_t h = shmw_add(w, DELAY_S, "payload!", 8, 0);
            out->op_ns += now_ns() - t;
            out->ops++;
            if (h < 0) {
                out->failed++;
                continue;
            }
            ring[(head + held++) % RING] = h;
            spin(gap);
            if (held > HELD) {
                t = now_ns();
                int rc = shmw_cancel(w, ring[head]);
                out->op_ns += now_ns() - t;
                out->ops++;
                out->failed += rc != 1;
                head = (head + 1) % RING;
                held--;
            }
            spin(gap);
        }
    }
    for (; held; held--, head = (head + 1) % RING)
        shmw_cancel(w, ring[head]);
    shmw_producer_release(w, (uint32_t)slot, getpid(), 0);
    shmw_close(w);
    _exit(0);
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;

    return (x > y) - (x < y);
}

static double median(double *v, int n)
{
    qsort(v, (size_t)n, sizeof(*v), cmp_double);
    return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

/* n processes, the k-th on bases[shared ? 0 : k]: ns an operation, or -1 if one failed. */
static double run(void **bases, uint64_t size, const struct shmw_params *p, int n, int shared,
                  double seconds, uint32_t gap, struct report *reports)
{
    uint64_t ops = 0, failed = 0;
    int64_t op_ns = 0;
    int status, ok = 1;

    for (int k = 0; k < (shared ? 1 : n); k++)
        if (shmw_init(bases[k], size, p, now_ns()) != SHMW_OK)
            return -1;
    for (int k = 0; k < n; k++) {
        reports[k] = (struct report){ 0, 0, 0 };
        if (fork() == 0)
            produce(bases[shared ? 0 : k], size, seconds, gap, &reports[k]);
    }
    for (int k = 0; k < n; k++) {
        wait(&status);
        ok &= WIFEXITED(status) && WEXITSTATUS(status) == 0;
    }
    for (int k = 0; k < n; k++) {
        ops += reports[k].ops;
        op_ns += reports[k].op_ns;
        failed += reports[k].failed;
    }
    if (!ok || failed) {
        fprintf(stderr, "\ncontention: a process failed (%llu failed operations)\n", (unsigned long long)failed);
        return -1;
    }
    return ops ? (double)op_ns / ops : 0.0;
}

int main(int argc, char **argv)
{
    int64_t gap_ns = argc > 1 ? atoll(argv[1]) : 1200;
    double seconds = argc > 2 ? atof(argv[2]) : 1.0;
    int max_procs = argc > 3 ? atoi(argv[3]) : 2;
    int rounds = argc > 4 ? atoi(argv[4]) : 5;
    int shards = argc > 5 ? atoi(argv[5]) : max_procs;
    struct shmw_params p = { .capacity = MAX_PROCS * RING, .payload_size = 8, .wheel_bits = 8,
                             .tick_ns = 1000000, .shards = (uint32_t)shards };
    static double shared_ns[MAX_PROCS + 1][MAX_ROUNDS], alone_ns[MAX_PROCS + 1][MAX_ROUNDS];
    void *bases[MAX_PROCS];
    struct report *reports;
    uint64_t size;
    uint32_t gap;

    if (gap_ns < 0 || seconds <= 0 || max_procs < 1 || max_procs > MAX_PROCS || rounds < 1 || rounds > MAX_ROUNDS
        || shards < 1 || shards > MAX_PROCS) {
        fprintf(stderr, "usage: %s [GAP_NS [SECONDS [MAX_PRODUCERS (1-%d) [ROUNDS (1-%d) [SHARDS (1-%d)]]]]]\n",
                argv[0], MAX_PROCS, MAX_ROUNDS, MAX_PROCS);
        return 2;
    }
    if (shmw_segment_size(&p, &size) != SHMW_OK)
        return 1;
    for (int k = 0; k < max_procs; k++) {
        bases[k] = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
        if (bases[k] == MAP_FAILED) {
            perror("contention");
            return 1;
        }
    }
    reports = mmap(NULL, sizeof(*reports) * MAX_PROCS, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (reports == MAP_FAILED) {
        perror("contention");
        return 1;
    }
    gap = rounds_for(gap_ns);
    printf("ns per add or cancel, %lld ns of other work between operations, %g s a run, %d shard%s a wheel;\n"
           "each count of processes sharing one wheel, then alone: each on a wheel of its own\n",
           (long long)gap_ns, seconds, shards, shards > 1 ? "s" : "");
    for (int r = 0; r < rounds; r++) {
        printf("round %d:", r + 1);
        for (int n = 1; n <= max_procs; n++) {
            shared_ns[n][r] = run(bases, size, &p, n, 1, seconds, gap, reports);
            alone_ns[n][r] = run(bases, size, &p, n, 0, seconds, gap, reports);
            if (shared_ns[n][r] < 0 || alone_ns[n][r] < 0)
                return 1;
            printf("  %d process%s %.0f (alone %.0f)", n, n > 1 ? "es" : "", shared_ns[n][r], alone_ns[n][r]);
        }
        printf("\n");
        fflush(stdout);
    }
    printf("median of %d round%s:\n", rounds, rounds > 1 ? "s" : "");
    double one = median(shared_ns[1], rounds);
    for (int n = 1; n <= max_procs; n++) {
        double shared = median(shared_ns[n], rounds), alone = median(alone_ns[n], rounds);

        printf("  %2d process%s %6.0f ns shared, %6.0f alone: %.2fx one process's, %.2fx alone\n", n,
               n > 1 ? "es" : "  ", shared, alone, shared / one, shared / alone);
    }
    return 0;
}
