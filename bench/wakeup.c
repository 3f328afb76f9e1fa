/*
 * wakeup.c - what one context switch costs this machine in CPU time: two
 * processes hand a byte back and forth over two pipes, each blocked in
 * read() until the other writes, so every hand-over is a sleep and a
 * wake-up.  Run on one CPU, the wake-up is a switch on that CPU; run
 * across two, it is a wake-up of the other CPU, which under a hypervisor
 * may be an idle virtual CPU brought back into its host's schedule.
 *
 * That price is what a thread pays for waiting on a lock another holds,
 * the GIL included, so it sets how much a little more work under the GIL
 * costs a threaded worker (docs/bench-log.md, uWSGI).
 *
 *     gcc -O2 -std=gnu11 bench/wakeup.c -o /tmp/wakeup
 *     /tmp/wakeup                # wherever the scheduler puts the two
 *     taskset -c 0 /tmp/wakeup   # both on CPU 0
 *
 * Prints the round trip (two switches) in wall time and in the CPU time
 * of both processes (getrusage), and that CPU time per switch counted.
 */
#include <stdio.h>
#include <stdlib.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define ROUNDS 200000

static double seconds(struct timeval tv)
{
    return (double)tv.tv_sec + (double)tv.tv_usec / 1e6;
}

int main(void)
{
    int there[2], back[2];
    struct timespec t0, t1;
    struct rusage self, child;
    double wall, cpu;
    long k, switches;
    char c = 'x';
    pid_t pid;

    if (pipe(there) || pipe(back)) {
        perror("wakeup: pipe");
        return 1;
    }
    if ((pid = fork()) < 0) {
        perror("wakeup: fork");
        return 1;
    }
    if (pid == 0) {
        for (k = 0; k < ROUNDS; k++)
            if (read(there[0], &c, 1) != 1 || write(back[1], &c, 1) != 1)
                _exit(1);
        _exit(0);
    }
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (k = 0; k < ROUNDS; k++)
        if (write(there[1], &c, 1) != 1 || read(back[0], &c, 1) != 1) {
            perror("wakeup: the child stopped answering");
            return 1;
        }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    if (waitpid(pid, NULL, 0) != pid) {
        perror("wakeup: waitpid");
        return 1;
    }
    getrusage(RUSAGE_SELF, &self);
    getrusage(RUSAGE_CHILDREN, &child);
    wall = (double)(t1.tv_sec - t0.tv_sec) * 1e9 + (double)(t1.tv_nsec - t0.tv_nsec);
    cpu = (seconds(self.ru_utime) + seconds(self.ru_stime) + seconds(child.ru_utime) + seconds(child.ru_stime)) * 1e9;
    switches = self.ru_nvcsw + self.ru_nivcsw + child.ru_nvcsw + child.ru_nivcsw;
    printf("round trip: %.0f ns wall, %.0f ns CPU; %.2f switches a round trip, %.0f ns CPU a switch\n",
           wall / ROUNDS, cpu / ROUNDS, (double)switches / ROUNDS, switches ? cpu / (double)switches : 0.0);
    return 0;
}
