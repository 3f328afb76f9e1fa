/* signal.c - the one signal handler shmwheel installs: a worker's stack
 * signal, which wakes a thread of the worker through a pipe.
 *
 * Owns: the table of the fd each caught signal writes to, and of the
 * handler each had before, which it calls in turn.
 * Keeps: the handler does only what an asynchronous signal handler may -
 * an fstat(2) and a write(2), errno saved and restored - and never blocks
 * (the fd is the caller's non-blocking pipe: a full pipe means a wake-up
 * is pending).  It writes only to the pipe it was given: a process that
 * forks and closes its descriptors may reuse the number for a file of its
 * own, so the handler checks the descriptor is still that pipe (device and
 * inode, taken when it was given) before it writes.  A handler the signal
 * had that is CPython's own (a signal.signal() handler, which only marks
 * the signal for the main thread) is called after the write, with the
 * same arguments, so that taking the signal takes nothing from anyone; any
 * other handler is left alone, since it may do what a handler called from
 * within another may not (faulthandler's raises the signal again).
 *
 * Python's own signal.signal() will not do here: its handlers run in the
 * main thread, between bytecodes, and a server's main thread may sit in C
 * for its whole life (uWSGI's), so the Python handler would never run.
 *
 * And a gate before faulthandler's dump of every thread, the driver's
 * fallback for a worker in which no Python runs (a C call that holds the
 * GIL).  faulthandler reads the other threads' frames from a signal
 * handler with no lock; while Python runs in any of them, frames are
 * pushed and freed under it, and the dump can crash the worker (it did, a
 * slow worker's, whose reporter had not answered in time).  So the
 * driver's dump is let through only on evidence that no Python runs: an
 * ask is there that the reporter thread has not taken; the reporter woke
 * (for it, or at the end of a timed wait) and has not run since, for
 * longer than a thread that runs bytecode keeps the GIL from a waiter
 * (twenty switch intervals, read where the GIL keeps it, and 0.3 s);
 * the GIL has not changed hands since it woke (the count of its own that
 * shmwheel._gil gives the address of: a thread that runs bytecode while
 * another waits gives it up within a switch interval, however many wait,
 * and one in a C call that holds it never does); and the process has
 * spent half that time on a CPU meanwhile (not stopped, or starved, with
 * a wait that no one could end).  Anything else is no such evidence, and
 * one line says the dump was not done.  A plain one (an operator's kill,
 * who chose to) is let through, as faulthandler alone would.
 */
#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#ifndef SYS_pidfd_send_signal
#define SYS_pidfd_send_signal 424
#endif

#include "core.h"

#define SIGNALS 65 /* 1..64 on Linux, SIGRTMAX included */

static volatile sig_atomic_t wake_fd[SIGNALS];
static volatile sig_atomic_t overflowed;          /* a record did not fit in the pipe */
static volatile uint64_t wake_dev[SIGNALS], wake_ino[SIGNALS];
static struct sigaction before[SIGNALS];          /* the handler each had, called after ours */
static volatile sig_atomic_t chained[SIGNALS];    /* before[signum] is set and called */

/* The gated dump signal, and the handler it had (faulthandler's). */
static volatile sig_atomic_t dump_signum;
static struct sigaction dump_then;
static int64_t gil_wait_ns;       /* how long the reporter must have waited for the GIL */
static const unsigned long *switches; /* the GIL's count of handoffs; NULL: unknown, no dump */
static const unsigned long *interval; /* its switch interval, in microseconds */
/* __atomic, CLOCK_MONOTONIC: */
static int64_t asked_ns;          /* the oldest stack signal the reporter has not taken (0: none) */
static int64_t woke_ns;           /* when its wait last ended: it then waits for the GIL */
static int64_t ran_ns;            /* when it last ran Python, after a wait */
static unsigned long woke_switches; /* __atomic: the GIL's count then */
static int waiting;               /* __atomic: the reporter is in its wait */
static int64_t woke_cpu_ns;       /* __atomic: the process's CPU time then */

_Static_assert(__atomic_always_lock_free(sizeof(int64_t), 0), "a signal handler reads these without a lock");

static int64_t cpu_ns(void)
{
    struct timespec ts;
    if (clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts) != 0) /* async-signal-safe */
        return 0;
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* before[signum] is running in this thread: not again from within it.  Per
 * thread, so that a signal on another thread still reaches it; initial-exec
 * on glibc, so that reading it in a signal handler allocates nothing. */
#ifdef __GLIBC__
static __thread __attribute__((tls_model("initial-exec"))) unsigned char in_chain[SIGNALS];
#else
static __thread unsigned char in_chain[SIGNALS];
#endif

static void on_signal(int signum, siginfo_t *info, void *context)
{
    int saved = errno;
    if (signum > 0 && signum < SIGNALS) {
        int fd = wake_fd[signum];
        unsigned char record[SHMW_SIGNAL_RECORD];
        uint64_t value = 0;
        struct stat st;
        int i;
        /* What the sender named, if it queued the signal with a value (the
         * driver: the request it asks about); 0 for a plain kill(2). */
        if (info && info->si_code == SI_QUEUE)
            value = (uint64_t)(uintptr_t)info->si_value.sival_ptr;
        int64_t none = 0; /* the oldest ask not taken is kept (a re-ask must not hide the first's wait) */
        __atomic_compare_exchange_n(&asked_ns, &none, shmw_now_ns(), 0, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED);
        record[0] = (unsigned char)signum;
        for (i = 0; i < 8; i++)
            record[1 + i] = (unsigned char)(value >> (8 * i));
        if (fd >= 0 && fstat(fd, &st) == 0 && (uint64_t)st.st_dev == wake_dev[signum] &&
            (uint64_t)st.st_ino == wake_ino[signum] && write(fd, record, sizeof record) < 0) {
            /* EAGAIN: the pipe is full, and the reader behind; it is told
             * to look at everything (a record with value 0 stands for
             * this one), once it has read what is there. */
            overflowed = 1;
        }
        if (chained[signum] && !in_chain[signum]) {
            const struct sigaction *then = &before[signum];
            in_chain[signum] = 1;
            errno = saved;
            if (then->sa_flags & SA_SIGINFO)
                then->sa_sigaction(signum, info, context);
            else if (then->sa_handler != SIG_DFL && then->sa_handler != SIG_IGN)
                then->sa_handler(signum);
            in_chain[signum] = 0;
        }
    }
    errno = saved;
}

static void on_dump(int signum, siginfo_t *info, void *context)
{
    static const char refused[] =
        "shmwheel: faulthandler's dump of every thread not done: nothing shows that no Python runs in this worker "
        "(its reporter thread has not been waiting for the GIL since it was asked), and a dump while Python runs "
        "could crash it\n";
    int saved = errno;
    if (signum == dump_signum) {
        int drivers = info != NULL && info->si_code == SI_QUEUE; /* a plain kill is an operator's choice */
        int64_t asked = __atomic_load_n(&asked_ns, __ATOMIC_ACQUIRE);
        int64_t woke = __atomic_load_n(&woke_ns, __ATOMIC_ACQUIRE);
        int64_t ran = __atomic_load_n(&ran_ns, __ATOMIC_ACQUIRE);
        const unsigned long *count = switches, *every = interval;
        int64_t wait = gil_wait_ns;
        if (every != NULL && (int64_t)(__atomic_load_n(every, __ATOMIC_RELAXED) * 20000ULL) > wait)
            wait = (int64_t)(__atomic_load_n(every, __ATOMIC_RELAXED) * 20000ULL); /* twenty switch intervals */
        /* An ask not taken, and the reporter woken and not run since: it
         * waits for the GIL, which has not changed hands since. */
        int stuck = count != NULL && every != NULL && asked != 0 && ran < woke && shmw_now_ns() - woke >= wait &&
                    __atomic_load_n(count, __ATOMIC_RELAXED) == __atomic_load_n(&woke_switches, __ATOMIC_ACQUIRE) &&
                    cpu_ns() - __atomic_load_n(&woke_cpu_ns, __ATOMIC_ACQUIRE) >= wait / 2;
        if (drivers && !stuck) {
            ssize_t n = write(STDERR_FILENO, refused, sizeof refused - 1);
            (void)n;
        } else if (dump_then.sa_flags & SA_SIGINFO) {
            errno = saved;
            dump_then.sa_sigaction(signum, info, context);
        } else if (dump_then.sa_handler != SIG_DFL && dump_then.sa_handler != SIG_IGN) {
            errno = saved;
            dump_then.sa_handler(signum);
        }
    }
    errno = saved;
}

int shmw_signal_gate_dump(int signum, int64_t min_gil_wait_ns, uint64_t gil_switches, uint64_t gil_interval)
{
    struct sigaction sa, now;
    if (signum <= 0 || signum >= SIGNALS || signum == SIGKILL || signum == SIGSTOP || min_gil_wait_ns <= 0)
        return -EINVAL;
    gil_wait_ns = min_gil_wait_ns;
    switches = (const unsigned long *)(uintptr_t)gil_switches;
    interval = (const unsigned long *)(uintptr_t)gil_interval;
    if (sigaction(signum, NULL, &now) != 0)
        return -errno;
    if ((now.sa_flags & SA_SIGINFO) && now.sa_sigaction == on_dump)
        return 0;                       /* gated already (a fork's, or a look again) */
    if (!(now.sa_flags & SA_SIGINFO) && (now.sa_handler == SIG_DFL || now.sa_handler == SIG_IGN))
        return -ENOENT;                 /* nothing to gate */
    dump_signum = 0;                    /* not called while it changes */
    __atomic_signal_fence(__ATOMIC_SEQ_CST);
    dump_then = now;
    __atomic_signal_fence(__ATOMIC_SEQ_CST);
    dump_signum = signum;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_dump;
    sa.sa_flags = SA_SIGINFO | (now.sa_flags & (SA_RESTART | SA_ONSTACK | SA_NODEFER));
    sa.sa_mask = now.sa_mask;
    if (sigaction(signum, &sa, NULL) != 0)
        return -errno;
    return 0;
}

int shmw_signal_gated(int signum)
{
    return shmw_signal_handler(signum) == (uint64_t)(uintptr_t)on_dump;
}

int shmw_signal_wait(int fd, int timeout_ms)
{
    struct pollfd p = {.fd = fd, .events = POLLIN};
    __atomic_store_n(&waiting, 1, __ATOMIC_RELEASE);
    int rc = poll(&p, 1, timeout_ms);
    int err = errno;
    __atomic_store_n(&waiting, 0, __ATOMIC_RELEASE);
    const unsigned long *count = switches;
    /* What the gate compares with: the count and CPU time first, the
     * time last, so that a handler that sees this wake sees them too. */
    if (count != NULL)
        __atomic_store_n(&woke_switches, __atomic_load_n(count, __ATOMIC_RELAXED), __ATOMIC_RELAXED);
    __atomic_store_n(&woke_cpu_ns, cpu_ns(), __ATOMIC_RELAXED);
    __atomic_store_n(&woke_ns, shmw_now_ns(), __ATOMIC_RELEASE);
    if (rc < 0)
        return -err;
    if (rc > 0 && (p.revents & (POLLNVAL | POLLERR)))
        return -EBADF;                  /* closed, or not a pipe's end it can read */
    if (rc > 0 && (p.revents & POLLHUP) && !(p.revents & POLLIN))
        return -EPIPE;                  /* every writer gone: nothing will come */
    return rc > 0;
}

int shmw_signal_waiting(void)
{
    return __atomic_load_n(&waiting, __ATOMIC_ACQUIRE);
}

void shmw_signal_reporter_runs(void)
{
    __atomic_store_n(&asked_ns, 0, __ATOMIC_RELEASE); /* what the pipe holds is taken next */
    __atomic_store_n(&ran_ns, shmw_now_ns(), __ATOMIC_RELEASE);
}

static int is_ours(const struct sigaction *sa)
{
    return (sa->sa_flags & SA_SIGINFO) && sa->sa_sigaction == on_signal;
}

static int is_default_or_ignored(const struct sigaction *sa)
{
    return !(sa->sa_flags & SA_SIGINFO) && (sa->sa_handler == SIG_DFL || sa->sa_handler == SIG_IGN);
}

static uint64_t address_of(const struct sigaction *sa)
{
    return (sa->sa_flags & SA_SIGINFO) ? (uint64_t)(uintptr_t)sa->sa_sigaction : (uint64_t)(uintptr_t)sa->sa_handler;
}

int shmw_signal_to_fd(int signum, int fd, uint64_t chainable)
{
    if (signum <= 0 || signum >= SIGNALS || signum == SIGKILL || signum == SIGSTOP)
        return -EINVAL;
    struct sigaction sa, now;
    memset(&sa, 0, sizeof sa);
    sigemptyset(&sa.sa_mask);
    if (sigaction(signum, NULL, &now) != 0)
        return -errno;
    if (fd < 0) {
        if (!is_ours(&now))
            return 0;                   /* someone's since: theirs stays */
        if (chained[signum])
            sa = before[signum];
        else
            sa.sa_handler = SIG_DFL;
        if (sigaction(signum, &sa, NULL) != 0)
            return -errno;
        wake_fd[signum] = -1;
        chained[signum] = 0;
        return 0;
    }
    struct stat st;
    if (fstat(fd, &st) != 0)
        return -errno;
    if (!is_ours(&now)) {
        /* The handler it has now: none, one to call after ours, or one
         * that is left alone.  Not called while it is being replaced. */
        if (!is_default_or_ignored(&now) && (chainable == 0 || address_of(&now) != chainable))
            return 2;
        chained[signum] = 0;
        before[signum] = now;
        chained[signum] = !is_default_or_ignored(&now);
    }
    sa.sa_sigaction = on_signal;
    sa.sa_flags = SA_SIGINFO | SA_RESTART;
    if (chained[signum]) {
        /* As the handler it calls was installed: whether a wait it ends
         * returns EINTR (a Python handler expects it to), its stack, its mask. */
        sa.sa_flags = SA_SIGINFO | (before[signum].sa_flags & (SA_RESTART | SA_ONSTACK));
        sa.sa_mask = before[signum].sa_mask;
    }
    wake_fd[signum] = -1; /* no write while the identity below changes */
    wake_dev[signum] = (uint64_t)st.st_dev;
    wake_ino[signum] = (uint64_t)st.st_ino;
    /* The fd before the handler: a signal that comes between the two finds it set. */
    wake_fd[signum] = fd;
    if (sigaction(signum, &sa, NULL) != 0)
        return -errno;
    return chained[signum] ? 1 : 0;
}

int shmw_signal_owner(int signum)
{
    struct sigaction now;
    if (signum <= 0 || signum >= SIGNALS)
        return -EINVAL;
    if (sigaction(signum, NULL, &now) != 0)
        return -errno;
    if (is_ours(&now))
        return 2;
    if (is_default_or_ignored(&now))
        return now.sa_handler == SIG_IGN ? 1 : 0;
    return 3;
}

int shmw_signal_overflowed(void)
{
    int was = overflowed;
    overflowed = 0;
    return was;
}

int shmw_pidfd_sigqueue(int pidfd, int signum, int64_t value)
{
    siginfo_t info;
    memset(&info, 0, sizeof info);
    info.si_signo = signum;
    info.si_code = SI_QUEUE;
    info.si_pid = getpid();
    info.si_uid = getuid();
    info.si_value.sival_ptr = (void *)(uintptr_t)value;
    if (syscall(SYS_pidfd_send_signal, pidfd, signum, &info, 0) != 0)
        return -errno;
    return 0;
}

uint64_t shmw_signal_handler(int signum)
{
    struct sigaction now;
    if (signum <= 0 || signum >= SIGNALS || sigaction(signum, NULL, &now) != 0)
        return 0;
    return address_of(&now);
}
