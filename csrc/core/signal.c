/* signal.c - the one signal handler shmwheel installs: a worker's stack
 * signal, which wakes a thread of the worker through a pipe.
 *
 * Owns: the table of the fd each caught signal writes to.
 * Keeps: the handler does only what an asynchronous signal handler may -
 * an fstat(2) and a write(2), errno saved and restored - and never blocks
 * (the fd is the caller's non-blocking pipe: a full pipe means a wake-up
 * is pending).  It writes only to the pipe it was given: a process that
 * forks and closes its descriptors may reuse the number for a file of its
 * own, so the handler checks the descriptor is still that pipe (device and
 * inode, taken when it was given) before it writes.
 *
 * Python's own signal.signal() will not do here: its handlers run in the
 * main thread, between bytecodes, and a server's main thread may sit in C
 * for its whole life (uWSGI's), so the Python handler would never run.
 */
#include <errno.h>
#include <signal.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core.h"

#define SIGNALS 65 /* 1..64 on Linux, SIGRTMAX included */

static volatile sig_atomic_t wake_fd[SIGNALS];
static volatile uint64_t wake_dev[SIGNALS], wake_ino[SIGNALS];

static void on_signal(int signum)
{
    int saved = errno;
    if (signum > 0 && signum < SIGNALS) {
        int fd = wake_fd[signum];
        unsigned char byte = (unsigned char)signum;
        struct stat st;
        if (fd >= 0 && fstat(fd, &st) == 0 && (uint64_t)st.st_dev == wake_dev[signum] &&
            (uint64_t)st.st_ino == wake_ino[signum] && write(fd, &byte, 1) < 0) {
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
        struct stat st;
        if (fstat(fd, &st) != 0)
            return -errno;
        sa.sa_handler = on_signal;
        sa.sa_flags = SA_RESTART;
        wake_fd[signum] = -1; /* no write while the identity below changes */
        wake_dev[signum] = (uint64_t)st.st_dev;
        wake_ino[signum] = (uint64_t)st.st_ino;
    }
    /* The fd before the handler: a signal that comes between the two finds it set. */
    wake_fd[signum] = fd < 0 ? -1 : fd;
    if (sigaction(signum, &sa, &old) != 0)
        return -errno;
    return !(old.sa_flags & SA_SIGINFO) && (old.sa_handler == SIG_DFL || old.sa_handler == SIG_IGN ||
                                            old.sa_handler == on_signal)
               ? 0
               : 1;
}
