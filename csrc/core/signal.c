/* signal.c - the one signal handler shmwheel installs: a worker's stack
 * signal, which wakes a thread of the worker through a pipe.
 *
 * Owns: the table of the fd each caught signal writes to.
 * Keeps: the handler does only what an asynchronous signal handler may -
 * one write(2), errno saved and restored - and never blocks (the fd is the
 * caller's non-blocking pipe: a full pipe means a wake-up is pending).
 *
 * Python's own signal.signal() will not do here: its handlers run in the
 * main thread, between bytecodes, and a server's main thread may sit in C
 * for its whole life (uWSGI's), so the Python handler would never run.
 */
#include <errno.h>
#include <signal.h>
#include <string.h>
#include <unistd.h>

#include "core.h"

#define SIGNALS 65 /* 1..64 on Linux, SIGRTMAX included */

static volatile sig_atomic_t wake_fd[SIGNALS];

static void on_signal(int signum)
{
    int saved = errno;
    if (signum > 0 && signum < SIGNALS) {
        int fd = wake_fd[signum];
        unsigned char byte = (unsigned char)signum;
        if (fd >= 0 && write(fd, &byte, 1) < 0) {
            /* EAGAIN: a wake-up is pending already.  Nothing else to do. */
        }
    }
    errno = saved;
}

int shmw_signal_to_fd(int signum, int fd)
{
    if (signum <= 0 || signum >= SIGNALS || signum == SIGKILL || signum == SIGSTOP)
        return -EINVAL;
    struct sigaction sa, old;
    memset(&sa, 0, sizeof sa);
    sigemptyset(&sa.sa_mask);
    if (fd < 0) {
        sa.sa_handler = SIG_DFL;
    } else {
        sa.sa_handler = on_signal;
        sa.sa_flags = SA_RESTART;
    }
    /* The fd first: a signal that comes between the two finds it set. */
    wake_fd[signum] = fd < 0 ? -1 : fd;
    if (sigaction(signum, &sa, &old) != 0)
        return -errno;
    return !(old.sa_flags & SA_SIGINFO) && (old.sa_handler == SIG_DFL || old.sa_handler == SIG_IGN ||
                                            old.sa_handler == on_signal)
               ? 0
               : 1;
}
