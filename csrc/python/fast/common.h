/*
 * fast/common.h - what every part of shmwheel._fast shares: the includes,
 * the core's entry points, the request record's offsets, the pid, the
 * clock, the interned names and the functions one part calls in another.
 * The parts are compiled as one unit (fast.c includes them in order).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

/* Every object this module shares between a worker's threads (a Clerk's
 * table, this thread's slot, a Body, the interned names) is guarded by the
 * GIL and nothing else.  A free-threaded CPython (3.13t, 3.14t) would turn
 * the GIL back on for the whole process as it imported the module, or,
 * with PYTHON_GIL=0, run it unguarded: neither is a request timeout worth
 * having, so the build stops here instead (README.md, "Supported
 * Pythons"). */
#ifdef Py_GIL_DISABLED
#error "shmwheel does not support free-threaded CPython: its C request path relies on the GIL (use a CPython built with the GIL, e.g. python3.13 rather than python3.13t)"
#endif

#include <limits.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "record.h"
#include "shmwheel.h"

typedef int64_t (*add_at_fn)(shmw_t *w, int64_t deadline_ns, const char *payload, uint32_t len, uint32_t flags);
typedef int (*try_cancel_fn)(shmw_t *w, int64_t handle);
/* The core's own prototypes: a change there is a compile error here (and
 * SHMW_API_VERSION tells a stale build of either module at import). */
_Static_assert(__builtin_types_compatible_p(add_at_fn, __typeof__(&shmw_add_at_ns)), "add_at_fn: shmw_add_at_ns");
_Static_assert(__builtin_types_compatible_p(try_cancel_fn, __typeof__(&shmw_try_cancel)), "try_cancel_fn: shmw_try_cancel");

/* The request record's head (csrc/record.h): the offsets of the fields that
 * change from one request to the next.  The others come from the Clerk's
 * template, packed by Python. */
#define HEAD_SIZE     SHMW_REQ_HEAD_SIZE
#define OFF_MLEN      offsetof(struct shmw_request_head, method_len)
#define OFF_RLEN      offsetof(struct shmw_request_head, request_id_len)
#define OFF_FLAGS     SHMW_REQ_AT_FLAGS
#define OFF_STARTED   SHMW_REQ_AT_STARTED
#define OFF_THREAD    SHMW_REQ_AT_THREAD
#define OFF_TASK      SHMW_REQ_AT_TASK
#define OFF_TIMEOUT   SHMW_REQ_AT_TIMEOUT
#define OFF_QUEUED    SHMW_REQ_AT_QUEUED

/* This process's pid: asked once, and again in a forked child. */
static pid_t current_pid;

static void after_fork_child(void)
{
    current_pid = getpid();
}

/* An int's value as a 64-bit integer, -1 with an exception.  Where a long
 * has 64 bits, PyLong_AsLong: CPython's PyLong_AsLongLong goes through
 * _PyLong_AsByteArray for any int past 2**30 (every handle, every clock
 * reading), which made it a tenth of finish()'s own time. */
static inline long long as_int64(PyObject *o)
{
#if LONG_MAX == LLONG_MAX
    return PyLong_AsLong(o);
#else
    return PyLong_AsLongLong(o);
#endif
}

/* time.monotonic_ns(): CLOCK_MONOTONIC, read through the vDSO. */
static inline int64_t monotonic_ns(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* Interned names, made once by the module. */
static PyObject *str_look, *str_fast, *str_finish, *str_finished, *str_close, *str_empty, *str_dash;
static PyObject *str_request_method, *str_script_name, *str_path_info, *str_request_id, *str_environ_key;
static PyObject *str_method, *str_path, *str_headers, *str_running_loop;
static PyObject *str_type, *str_more_body, *str_body_type, *str_zerocopy_type, *str_pathsend_type;
static PyObject *str_ws_close, *str_http, *str_timer, *str_app, *str_timer_attr, *str_req_key;
static PyObject *str_file_wrapper, *str_file_body, *str_in_c, *str_timing_file_wrapper, *str_file_type;
static PyObject *str_serve, *str_call, *str_declined, *str_cancel;
static PyObject *declined_kwnames;  /* ("declined",): the Python pre_request's keyword */
static PyObject *str_handle, *str_for;

/* What one part calls in a part included after it. */
typedef struct ClerkObject ClerkObject;
static PyObject *Clerk_wsgi(ClerkObject *self, PyObject *const *args, Py_ssize_t nargs);   /* wsgi.c */
static PyObject *Body_make(PyObject *body, PyObject *owner, PyObject *key);                  /* wsgi.c */
static PyObject *Send_make(PyObject *send, PyObject *owner, PyObject *key);                  /* asgi.c */
