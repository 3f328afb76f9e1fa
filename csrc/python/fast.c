/*
 * fast.c - shmwheel._fast: a worker's request timer on a path that keeps
 * the GIL.
 *
 * cffi releases the GIL around every C call.  For a ~100 ns hold of the
 * segment's lock that costs more than the hold: on a threaded worker the
 * GIL goes to another thread, and getting it back is a context switch or
 * two.  This module makes the request's add and cancel as plain C calls
 * that keep the GIL, into the SAME core the cffi module holds: it links
 * none of csrc/core; the cffi module hands over the addresses of shmw_add_at_ns
 * and shmw_try_cancel and the Wheel's shmw_t * (shmwheel/_wheel.py,
 * Wheel.fast_core).  Keeping the GIL while waiting for the lock would stall
 * every thread of the process, so the path only ever tries the lock
 * (SHMW_TRYLOCK, shmw_try_cancel): on SHMW_EBUSY, or on any other result
 * but success, it gives back None having changed nothing, and the caller
 * takes the cffi path, which releases the GIL and waits, and says what went
 * wrong.
 *
 * Core     one open segment: the shmw_t *, the two entry points, and the
 *          cffi objects that keep the struct and its mapping alive.
 *          close() (from Wheel.close) makes every later call give up.
 * Active   a request in progress, as Python reads it from the table.
 * Table    a RequestTimer's requests in progress in one process, with no
 *          object made per request; and beside it, here, the request a
 *          plain thread runs, in a thread-local slot.
 * Timer    one RequestTimer's constants in one process: start() packs the
 *          request record (shmwheel/contrib/_record.py, byte for byte:
 *          tests/test_fast.py compares), adds it, and files the request
 *          in the RequestTimer's table, and in its thread's slot or its
 *          context; finish() takes it out and cancels its timer; wsgi() is
 *          the WSGI middleware's call, from the environ to the Body.
 * WSGI     a plain TimeoutMiddleware as a C callable: the server's call
 *          reaches Timer.wsgi with no Python frame (uWSGI's application).
 * Body     a WSGI response body whose close() ends its request's timer
 *          through the RequestTimer's Timer of the moment, or its finish().
 * ASGI     a plain ASGI TimeoutMiddleware's HTTP request: the timer started
 *          from the scope, the application called with a timed copy of it
 *          and a Send, and its call given back in a Then.
 * Send     an ASGI request's send: messages go straight to the server's;
 *          the one that completes the response is awaited through a Then.
 * Then     an awaitable that ends the request's timer after another: the
 *          server's send of the last message, or the application's call;
 *          from a Coroutine, a call that starts at its first step.
 * Coroutine  TimeoutMiddleware.__call__ (the ASGI one) in C, which servers
 *          still take for a coroutine function: its call is a Then, so the
 *          middleware has no coroutine of its own.
 *
 * No request asks the kernel for anything but the core's lock: a Timer
 * only serves the process that made it (the pid is kept here, set again in
 * a forked child by pthread_atfork); the clock is the vDSO's; an asyncio
 * task is found without asyncio.current_task(), whose get_running_loop()
 * calls getpid() on CPython 3.11, but for a thread's first request under
 * a loop.  At a request's start, on its first and then once a second, a
 * Timer gives the RequestTimer its look at the wheel (RequestTimer._look),
 * and goes on unless the look replaced it.
 *
 * Nothing runs under the segment's lock but the core's own code: the record
 * is built, and every Python object made, before the add or after it.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

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
 * change from one request to the next.  The others come from the Timer's
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

/* ---- Core ----------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    shmw_t        *w;           /* NULL once closed: every call gives up */
    add_at_fn      add_at;      /* shmw_add_at_ns: the deadline from the clock read here, not read again */
    try_cancel_fn  try_cancel;
    PyObject      *keep;        /* the cffi objects that own *w and its mapping */
} CoreObject;

static void *address(PyObject *o, const char *what)
{
    void *p = PyLong_AsVoidPtr(o);

    if (!p && !PyErr_Occurred())
        PyErr_Format(PyExc_ValueError, "%s is NULL", what);
    return p;
}

static int Core_init(CoreObject *self, PyObject *args, PyObject *kwds)
{
    PyObject *w, *add_at, *try_cancel, *keep, *old;
    static char *names[] = {"w", "add_at", "try_cancel", "keep", NULL};

    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOO:Core", names, &w, &add_at, &try_cancel, &keep))
        return -1;
    if (!(self->w = address(w, "w")) || !(self->add_at = (add_at_fn)address(add_at, "add_at"))
        || !(self->try_cancel = (try_cancel_fn)address(try_cancel, "try_cancel"))) {
        self->w = NULL;
        return -1;
    }
    old = self->keep;
    Py_INCREF(keep);
    self->keep = keep;
    Py_XDECREF(old);
    return 0;
}

static void Core_dealloc(CoreObject *self)
{
    Py_XDECREF(self->keep);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *Core_close(CoreObject *self, PyObject *Py_UNUSED(ignored))
{
    self->w = NULL;
    Py_RETURN_NONE;
}

static PyObject *Core_get_closed(CoreObject *self, void *Py_UNUSED(closure))
{
    return PyBool_FromLong(self->w == NULL);
}

static PyMethodDef Core_methods[] = {
    {"close", (PyCFunction)Core_close, METH_NOARGS, "Give up every later call (the Wheel is closing)."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Core_getset[] = {
    {"closed", (getter)Core_get_closed, NULL, "Whether close() has been called.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject CoreType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "shmwheel._fast.Core",
    .tp_basicsize = sizeof(CoreObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Core(w, add_at, try_cancel, keep): an open segment, by the addresses the cffi module gives.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Core_init,
    .tp_dealloc = (destructor)Core_dealloc,
    .tp_methods = Core_methods,
    .tp_getset = Core_getset,
};

/* ---- Active --------------------------------------------------------------- */

/* A request in progress, as its RequestTimer's table holds it: one object,
 * its record inline, where a NamedTuple took four (the tuple, its record's
 * bytes and its two deadlines' ints) and the generic dealloc of a tuple
 * subclass.  Read as the NamedTuple was: by attribute, with _replace() and
 * ==.  Like a tuple it has no tp_clear: what it holds cannot change, so a
 * cycle through it runs through its task, which the collector clears. */
typedef struct {
    PyObject_VAR_HEAD           /* ob_size: the record's length */
    int64_t   deadline_ns;      /* when its timer fires: its warn_after stage, or its timeout */
    int64_t   timeout_ns;       /* when it times out */
    int64_t   handle;           /* its timer (extend() gives it a new one) */
    uint64_t  thread;           /* its OS thread */
    PyObject *task;             /* its asyncio or trio task, its greenlet, or None */
    char      interrupt;        /* whether it is ended at its timeout */
    char      payload[1];       /* its timer's record */
} ActiveObject;

static PyTypeObject ActiveType;

#define ACTIVE_FIELDS "payload", "deadline_ns", "thread", "task", "handle", "timeout_ns", "interrupt"

/* A new Active, untracked, with room for an ``n``-byte record, its
 * fields zero and no task. */
static ActiveObject *Active_alloc(Py_ssize_t n)
{
    ActiveObject *self = PyObject_GC_NewVar(ActiveObject, &ActiveType, n);

    if (self) {
        self->deadline_ns = self->timeout_ns = self->handle = 0;
        self->thread = 0;
        self->task = NULL;
        self->interrupt = 0;
    }
    return self;
}

static int Active_traverse(ActiveObject *self, visitproc visit, void *arg)
{
    Py_VISIT(self->task);
    return 0;
}

static void Active_dealloc(ActiveObject *self)
{
    PyObject_GC_UnTrack(self);
    Py_CLEAR(self->task);
    PyObject_GC_Del(self);
}

/* Active(payload, deadline_ns, thread, task, handle, timeout_ns, interrupt). */
static PyObject *Active_new(PyTypeObject *Py_UNUSED(type), PyObject *args, PyObject *kwds)
{
    static char *names[] = {ACTIVE_FIELDS, NULL};
    ActiveObject *self;
    Py_buffer payload;
    PyObject *thread_id, *task;
    long long deadline, handle, timeout;
    unsigned long long thread;
    int interrupt;

    if (!PyArg_ParseTupleAndKeywords(args, kwds, "y*LO!OLLp:Active", names, &payload, &deadline, &PyLong_Type,
                                     &thread_id, &task, &handle, &timeout, &interrupt))
        return NULL;
    thread = PyLong_AsUnsignedLongLong(thread_id);
    if (thread == (unsigned long long)-1 && PyErr_Occurred()) {
        PyBuffer_Release(&payload);
        return NULL;
    }
    if (!(self = Active_alloc(payload.len))) {
        PyBuffer_Release(&payload);
        return NULL;
    }
    memcpy(self->payload, payload.buf, (size_t)payload.len);
    PyBuffer_Release(&payload);
    self->deadline_ns = deadline;
    self->timeout_ns = timeout;
    self->handle = handle;
    self->thread = thread;
    self->task = Py_NewRef(task);
    self->interrupt = (char)interrupt;
    PyObject_GC_Track(self);
    return (PyObject *)self;
}

/* The fields as the constructor takes them, in its order. */
static PyObject *Active_fields(ActiveObject *self)
{
    return Py_BuildValue("(y#LKOLLO)", self->payload, Py_SIZE(self), (long long)self->deadline_ns,
                         (unsigned long long)self->thread, self->task, (long long)self->handle,
                         (long long)self->timeout_ns, self->interrupt ? Py_True : Py_False);
}

/* _replace(**fields): a new Active with these fields changed, as a NamedTuple's. */
static PyObject *Active_replace(ActiveObject *self, PyObject *args, PyObject *kwds)
{
    PyObject *fields, *r;

    if (PyTuple_GET_SIZE(args)) {
        PyErr_SetString(PyExc_TypeError, "_replace() takes keyword arguments only");
        return NULL;
    }
    if (!(fields = Active_fields(self)))
        return NULL;
    if (kwds) {
        static const char *names[] = {ACTIVE_FIELDS};
        PyObject *name, *value, *rest;
        Py_ssize_t pos = 0, k;

        if (!(rest = PyDict_Copy(kwds))) {
            Py_DECREF(fields);
            return NULL;
        }
        for (k = 0; k < (Py_ssize_t)(sizeof names / sizeof names[0]); k++) {
            PyObject *key = PyUnicode_FromString(names[k]);

            value = key ? PyDict_GetItemWithError(rest, key) : NULL;
            if (value) {
                Py_DECREF(PyTuple_GET_ITEM(fields, k));
                PyTuple_SET_ITEM(fields, k, Py_NewRef(value));
            }
            if (!key || (!value && PyErr_Occurred()) || (value && PyDict_DelItem(rest, key) < 0)) {
                Py_XDECREF(key);
                Py_DECREF(rest);
                Py_DECREF(fields);
                return NULL;
            }
            Py_DECREF(key);
        }
        if (PyDict_Next(rest, &pos, &name, &value)) {
            PyErr_Format(PyExc_ValueError, "_replace() got an unexpected field name %R", name);
            Py_DECREF(rest);
            Py_DECREF(fields);
            return NULL;
        }
        Py_DECREF(rest);
    }
    r = Active_new(&ActiveType, fields, NULL);
    Py_DECREF(fields);
    return r;
}

static PyObject *Active_richcompare(PyObject *a, PyObject *b, int op)
{
    PyObject *x, *y, *r;

    if (!Py_IS_TYPE(a, &ActiveType) || !Py_IS_TYPE(b, &ActiveType) || (op != Py_EQ && op != Py_NE))
        Py_RETURN_NOTIMPLEMENTED;
    if (!(x = Active_fields((ActiveObject *)a)))
        return NULL;
    if (!(y = Active_fields((ActiveObject *)b))) {
        Py_DECREF(x);
        return NULL;
    }
    r = PyObject_RichCompare(x, y, op);
    Py_DECREF(x);
    Py_DECREF(y);
    return r;
}

static PyObject *Active_repr(ActiveObject *self)
{
    PyObject *fields = Active_fields(self), *r;

    if (!fields)
        return NULL;
    r = PyUnicode_FromFormat("Active(payload=%R, deadline_ns=%R, thread=%R, task=%R, handle=%R, timeout_ns=%R, "
                             "interrupt=%R)",
                             PyTuple_GET_ITEM(fields, 0), PyTuple_GET_ITEM(fields, 1), PyTuple_GET_ITEM(fields, 2),
                             PyTuple_GET_ITEM(fields, 3), PyTuple_GET_ITEM(fields, 4), PyTuple_GET_ITEM(fields, 5),
                             PyTuple_GET_ITEM(fields, 6));
    Py_DECREF(fields);
    return r;
}

static PyObject *Active_get_payload(ActiveObject *self, void *Py_UNUSED(closure))
{
    return PyBytes_FromStringAndSize(self->payload, Py_SIZE(self));
}

static PyObject *Active_get_thread(ActiveObject *self, void *Py_UNUSED(closure))
{
    return PyLong_FromUnsignedLongLong(self->thread);
}

static PyObject *Active_get_task(ActiveObject *self, void *Py_UNUSED(closure))
{
    return Py_NewRef(self->task);
}

static PyObject *Active_get_interrupt(ActiveObject *self, void *Py_UNUSED(closure))
{
    return PyBool_FromLong(self->interrupt);
}

static PyMemberDef Active_members[] = {
    {"deadline_ns", T_LONGLONG, offsetof(ActiveObject, deadline_ns), READONLY,
     "time.monotonic_ns() when its timer fires: at its warn_after stage, or its timeout"},
    {"handle", T_LONGLONG, offsetof(ActiveObject, handle), READONLY, "its timer (extend() gives it a new one)"},
    {"timeout_ns", T_LONGLONG, offsetof(ActiveObject, timeout_ns), READONLY,
     "time.monotonic_ns() when it times out"},
    {NULL},
};

static PyGetSetDef Active_getset[] = {
    {"payload", (getter)Active_get_payload, NULL, "its timer's record", NULL},
    {"thread", (getter)Active_get_thread, NULL,
     "its OS thread, as _thread.get_ident() names it before any monkey-patching", NULL},
    {"task", (getter)Active_get_task, NULL, "its asyncio or trio task, or its greenlet, or None", NULL},
    {"interrupt", (getter)Active_get_interrupt, NULL, "whether it is ended at its timeout", NULL},
    {NULL},
};

static PyMethodDef Active_methods[] = {
    {"_replace", (PyCFunction)(void (*)(void))Active_replace, METH_VARARGS | METH_KEYWORDS,
     "A new Active with the fields given changed."},
    {NULL},
};

static PyTypeObject ActiveType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "shmwheel._fast.Active",
    .tp_doc = "A request in progress, as its worker's table holds it.",
    .tp_basicsize = offsetof(ActiveObject, payload),
    .tp_itemsize = 1,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = Active_new,
    .tp_dealloc = (destructor)Active_dealloc,
    .tp_traverse = (traverseproc)Active_traverse,
    .tp_repr = (reprfunc)Active_repr,
    .tp_richcompare = Active_richcompare,
    .tp_hash = PyObject_HashNotImplemented,
    .tp_members = Active_members,
    .tp_getset = Active_getset,
    .tp_methods = Active_methods,
};

/* ---- Table ---------------------------------------------------------------- */

/* A RequestTimer's requests in progress in this process, by the handle its
 * start() gave each (the key: extend() gives a request a new timer, never a
 * new key).  What was a dict of Actives, without an object or a dict entry
 * made per request: open addressing on the key (linear probing, deletion
 * by backward shift, so no tombstones), at most half full, each slot
 * keeping its record's buffer from one request to the next.  A start
 * writes its record into the table's spare buffer, and once the add has
 * given the key, swaps that buffer with the free slot's.  Python reads the
 * table as a mapping of handles to Actives, made when asked for: the
 * reporter thread, extend(), a finish whose timer has fired.
 *
 * Every change bumps ``version``: code that makes a Python object while it
 * reads a slot (an allocation may run the collector, and a finalizer any
 * Python) finds the slot again, or starts over, if it changed. */
typedef struct {
    int64_t   key;              /* the handle start() gave */
    int64_t   handle;           /* its timer now */
    int64_t   deadline_ns;      /* when its timer fires: its warn_after stage, or its timeout */
    int64_t   timeout_ns;       /* when it times out */
    uint64_t  thread;           /* its OS thread */
    PyObject *task;             /* its task or greenlet, or None; NULL: the slot is free */
    char     *payload;          /* its record; the buffer stays with the slot when it is freed */
    uint32_t  len;              /* the record's length */
    uint32_t  room;             /* the buffer's */
    char      interrupt;        /* whether it is ended at its timeout */
} Slot;

typedef struct {
    PyObject_HEAD
    Slot      *slots;           /* NULL until the first request */
    Py_ssize_t mask;            /* the number of slots less one (a power of two less one) */
    Py_ssize_t used;
    char      *spare;           /* where the next start writes its record */
    uint32_t   spare_room;
    uint64_t   version;
} TableObject;

static PyTypeObject TableType;

#define TABLE_MIN 16

static inline Py_ssize_t home_of(int64_t key, Py_ssize_t mask)
{
    return (Py_ssize_t)(((uint64_t)key * UINT64_C(0x9E3779B97F4A7C15)) >> 32) & mask;
}

/* The slot of ``key``, or NULL. */
static Slot *Table_find(TableObject *t, int64_t key)
{
    Py_ssize_t i;

    if (!t->slots)
        return NULL;
    for (i = home_of(key, t->mask);; i = (i + 1) & t->mask) {
        Slot *s = &t->slots[i];

        if (!s->task)
            return NULL;
        if (s->key == key)
            return s;
    }
}

/* Room for one more request without growing: 0, or -1 with MemoryError.
 * Plain C, like every change below: no Python runs while slots move. */
static int Table_reserve(TableObject *t)
{
    Py_ssize_t n = t->slots ? t->mask + 1 : 0, m, k, i;
    Slot *slots;

    if (t->slots && (t->used + 1) * 2 <= n)
        return 0;
    m = n ? n * 2 : TABLE_MIN;
    if (m > PY_SSIZE_T_MAX / (Py_ssize_t)sizeof(Slot) || !(slots = PyMem_Calloc((size_t)m, sizeof(Slot)))) {
        PyErr_NoMemory();
        return -1;
    }
    for (k = 0; k < n; k++) {
        Slot *s = &t->slots[k];

        if (!s->task) {
            PyMem_Free(s->payload);     /* a free slot's buffer: the new slots make their own */
            continue;
        }
        for (i = home_of(s->key, m - 1); slots[i].task; i = (i + 1) & (m - 1))
            ;
        slots[i] = *s;
    }
    PyMem_Free(t->slots);
    t->slots = slots;
    t->mask = m - 1;
    t->version++;
    return 0;
}

/* A buffer of at least ``n`` bytes at *buf, whose size is *room: 0, or -1
 * with MemoryError. */
static int room_for(char **buf, uint32_t *room, Py_ssize_t n)
{
    char *p;

    if ((Py_ssize_t)*room >= n)
        return 0;
    if (n > (Py_ssize_t)SHMW_MAX_PAYLOAD) {
        PyErr_Format(PyExc_ValueError, "a record is at most %u bytes", SHMW_MAX_PAYLOAD);
        return -1;
    }
    if (!(p = PyMem_Realloc(*buf, (size_t)n))) {
        PyErr_NoMemory();
        return -1;
    }
    *buf = p;
    *room = (uint32_t)n;
    return 0;
}

/* The free slot for ``key``, which is not in the table, after a
 * Table_reserve(): its buffer swapped with the spare one, which holds the
 * record.  The caller fills in the rest, the task last (non-NULL). */
static Slot *Table_put(TableObject *t, int64_t key, uint32_t len)
{
    Py_ssize_t i;
    Slot *s;
    char *buf;
    uint32_t room;

    for (i = home_of(key, t->mask); t->slots[i].task; i = (i + 1) & t->mask)
        ;
    s = &t->slots[i];
    buf = s->payload;
    room = s->room;
    s->payload = t->spare;
    s->room = t->spare_room;
    t->spare = buf;
    t->spare_room = room;
    s->key = key;
    s->len = len;
    t->used++;
    t->version++;
    return s;
}

/* Frees slot ``s``, its task given to the caller, and closes the gap by
 * moving back the slots after it that may sit there. */
static PyObject *Table_take(TableObject *t, Slot *s)
{
    Py_ssize_t i = s - t->slots, j = i, home;
    PyObject *task = s->task;
    Slot hole;

    s->task = NULL;
    hole = *s;
    for (;;) {
        j = (j + 1) & t->mask;
        if (!t->slots[j].task)
            break;
        home = home_of(t->slots[j].key, t->mask);
        /* It stays if its home lies cyclically in (i, j]. */
        if (i <= j ? (i < home && home <= j) : (i < home || home <= j))
            continue;
        t->slots[i] = t->slots[j];
        t->slots[j] = hole;
        i = j;
    }
    t->used--;
    t->version++;
    return task;
}

/* ``a``, made with room for the slot's record, filled from the slot and tracked. */
static PyObject *Active_fill(ActiveObject *a, const Slot *s)
{
    memcpy(a->payload, s->payload, s->len);
    a->deadline_ns = s->deadline_ns;
    a->timeout_ns = s->timeout_ns;
    a->handle = s->handle;
    a->thread = s->thread;
    a->task = Py_NewRef(s->task);
    a->interrupt = s->interrupt;
    PyObject_GC_Track(a);
    return (PyObject *)a;
}

/* The Active of ``key`` as the table holds it now; NULL, without an
 * exception, if it holds none. */
static PyObject *Table_active(TableObject *t, int64_t key)
{
    for (;;) {
        Slot *s = Table_find(t, key);
        uint64_t version = t->version;
        ActiveObject *a;

        if (!s)
            return NULL;
        if (!(a = Active_alloc(s->len)))
            return NULL;
        if (version != t->version) {    /* changed by what the allocation ran */
            Py_DECREF(a);
            continue;
        }
        return Active_fill(a, s);
    }
}

/* A key as the table takes it: 1 and *out, or 0 for one it cannot hold (not
 * an int, or past 64 bits), or -1 with an exception. */
static int key_of(PyObject *o, int64_t *out)
{
    int overflow;
    long long v;

    if (!PyLong_Check(o))
        return 0;
    v = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (v == -1 && PyErr_Occurred())
        return -1;
    *out = v;
    return !overflow;
}

static PyObject *Table_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    if (PyTuple_GET_SIZE(args) || (kwds && PyDict_GET_SIZE(kwds))) {
        PyErr_SetString(PyExc_TypeError, "Table() takes no arguments");
        return NULL;
    }
    return type->tp_alloc(type, 0);     /* zeroed: no slots yet */
}

static int Table_traverse(TableObject *self, visitproc visit, void *arg)
{
    Py_ssize_t k;

    if (self->slots)
        for (k = 0; k <= self->mask; k++)
            Py_VISIT(self->slots[k].task);
    return 0;
}

/* Empties the table; its tasks let go once it is consistent again. */
static int Table_clear(TableObject *self)
{
    Slot *slots = self->slots;
    Py_ssize_t k, n = slots ? self->mask + 1 : 0;

    self->slots = NULL;
    self->mask = 0;
    self->used = 0;
    self->version++;
    for (k = 0; k < n; k++) {
        Py_XDECREF(slots[k].task);
        PyMem_Free(slots[k].payload);
    }
    PyMem_Free(slots);
    return 0;
}

static void Table_dealloc(TableObject *self)
{
    PyObject_GC_UnTrack(self);
    Table_clear(self);
    PyMem_Free(self->spare);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static Py_ssize_t Table_length(TableObject *self)
{
    return self->used;
}

static int Table_contains(TableObject *self, PyObject *key)
{
    int64_t k;
    int r = key_of(key, &k);

    return r <= 0 ? r : Table_find(self, k) != NULL;
}

static PyObject *Table_subscript(TableObject *self, PyObject *key)
{
    int64_t k;
    int r = key_of(key, &k);
    PyObject *a = r > 0 ? Table_active(self, k) : NULL;

    if (!a && !PyErr_Occurred())
        PyErr_SetObject(PyExc_KeyError, key);
    return a;
}

/* table[key] = active: the request filed as ``active`` says (extend()'s new
 * timer); del table[key]: taken out. */
static int Table_ass_subscript(TableObject *self, PyObject *key, PyObject *value)
{
    ActiveObject *a = (ActiveObject *)value;
    PyObject *old;
    int64_t k;
    int r = key_of(key, &k);
    Slot *s;

    if (r < 0)
        return -1;
    if (!value) {
        if (!r || !(s = Table_find(self, k))) {
            PyErr_SetObject(PyExc_KeyError, key);
            return -1;
        }
        Py_DECREF(Table_take(self, s));
        return 0;
    }
    if (!r) {
        PyErr_SetString(PyExc_TypeError, "a table's keys are handles: ints of 64 bits");
        return -1;
    }
    if (!Py_IS_TYPE(value, &ActiveType)) {
        PyErr_Format(PyExc_TypeError, "a table holds Actives, not %.100s", Py_TYPE(value)->tp_name);
        return -1;
    }
    if (!(s = Table_find(self, k))) {
        if (Table_reserve(self) < 0 || room_for(&self->spare, &self->spare_room, Py_SIZE(a)) < 0)
            return -1;
        memcpy(self->spare, a->payload, (size_t)Py_SIZE(a));
        s = Table_put(self, k, (uint32_t)Py_SIZE(a));
        old = NULL;
    } else {
        if (room_for(&s->payload, &s->room, Py_SIZE(a)) < 0)
            return -1;
        memcpy(s->payload, a->payload, (size_t)Py_SIZE(a));
        s->len = (uint32_t)Py_SIZE(a);
        old = s->task;
        self->version++;
    }
    s->handle = a->handle;
    s->deadline_ns = a->deadline_ns;
    s->timeout_ns = a->timeout_ns;
    s->thread = a->thread;
    s->interrupt = a->interrupt;
    s->task = Py_NewRef(a->task);
    Py_XDECREF(old);
    return 0;
}

/* The table's keys and Actives, as a dict (``as_dict``) or a list of keys:
 * copied out of the slots first, so that no Python runs while they are read. */
static PyObject *Table_snapshot(TableObject *self, int as_dict)
{
    Py_ssize_t n = self->used, k, m = 0, size = 0;
    Slot *copy;
    char *bytes = NULL, *p;
    PyObject *out = NULL;

    if (!(copy = PyMem_Calloc((size_t)(n ? n : 1), sizeof(Slot))))
        return PyErr_NoMemory();
    for (k = 0; self->slots && k <= self->mask; k++)
        if (self->slots[k].task)
            size += self->slots[k].len;
    if (as_dict && !(bytes = PyMem_Malloc((size_t)(size ? size : 1)))) {
        PyMem_Free(copy);
        return PyErr_NoMemory();
    }
    for (k = 0, p = bytes; self->slots && k <= self->mask; k++) {
        Slot *s = &self->slots[k];

        if (!s->task || m == n)
            continue;
        copy[m] = *s;
        Py_INCREF(s->task);
        if (as_dict) {
            memcpy(p, s->payload, s->len);
            copy[m].payload = p;
            p += s->len;
        }
        m++;
    }
    /* From here Python may run, and the table change: the copy stands. */
    if (!(out = as_dict ? PyDict_New() : PyList_New(0)))
        goto done;
    for (k = 0; k < m; k++) {
        PyObject *key = PyLong_FromLongLong(copy[k].key);
        ActiveObject *a = NULL;
        int r;

        if (key && as_dict && (a = Active_alloc(copy[k].len)))
            Active_fill(a, &copy[k]);
        r = !key || (as_dict && !a) ? -1
            : as_dict ? PyDict_SetItem(out, key, (PyObject *)a) : PyList_Append(out, key);
        Py_XDECREF(key);
        Py_XDECREF(a);
        if (r < 0) {
            Py_CLEAR(out);
            break;
        }
    }
done:
    for (k = 0; k < m; k++)
        Py_DECREF(copy[k].task);
    PyMem_Free(copy);
    PyMem_Free(bytes);
    return out;
}

static PyObject *Table_copy(TableObject *self, PyObject *Py_UNUSED(ignored))
{
    return Table_snapshot(self, 1);
}

static PyObject *Table_keys(TableObject *self, PyObject *Py_UNUSED(ignored))
{
    return Table_snapshot(self, 0);
}

static PyObject *Table_iter(TableObject *self)
{
    PyObject *keys = Table_snapshot(self, 0), *it;

    if (!keys)
        return NULL;
    it = PyObject_GetIter(keys);
    Py_DECREF(keys);
    return it;
}

/* get(key, default=None) */
static PyObject *Table_get(TableObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    int64_t k;
    int r;
    PyObject *a;

    if (nargs < 1 || nargs > 2) {
        PyErr_SetString(PyExc_TypeError, "get(key, default=None)");
        return NULL;
    }
    if ((r = key_of(args[0], &k)) < 0)
        return NULL;
    if (r && (a = Table_active(self, k)))
        return a;
    return PyErr_Occurred() ? NULL : Py_NewRef(nargs > 1 ? args[1] : Py_None);
}

/* pop(key[, default]) */
static PyObject *Table_pop(TableObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    int64_t k;
    int r;
    PyObject *a = NULL;
    Slot *s;

    if (nargs < 1 || nargs > 2) {
        PyErr_SetString(PyExc_TypeError, "pop(key[, default])");
        return NULL;
    }
    if ((r = key_of(args[0], &k)) < 0)
        return NULL;
    if (r && (a = Table_active(self, k)) && (s = Table_find(self, k)))
        Py_DECREF(Table_take(self, s));     /* still there: Table_active made the Active last */
    if (a || PyErr_Occurred())
        return a;
    if (nargs > 1)
        return Py_NewRef(args[1]);
    PyErr_SetObject(PyExc_KeyError, args[0]);
    return NULL;
}

static PyMappingMethods Table_mapping = {
    .mp_length = (lenfunc)Table_length,
    .mp_subscript = (binaryfunc)Table_subscript,
    .mp_ass_subscript = (objobjargproc)Table_ass_subscript,
};

static PySequenceMethods Table_sequence = {
    .sq_contains = (objobjproc)Table_contains,
};

static PyMethodDef Table_methods[] = {
    {"get", (PyCFunction)(void (*)(void))Table_get, METH_FASTCALL, "get(handle, default=None): its Active."},
    {"pop", (PyCFunction)(void (*)(void))Table_pop, METH_FASTCALL, "pop(handle[, default]): its Active, taken out."},
    {"copy", (PyCFunction)Table_copy, METH_NOARGS, "A dict of the requests in progress: {handle: Active}."},
    {"keys", (PyCFunction)Table_keys, METH_NOARGS, "A list of the handles of the requests in progress."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject TableType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "shmwheel._fast.Table",
    .tp_doc = "Table(): a RequestTimer's requests in progress, as a mapping of handles to Actives.",
    .tp_basicsize = sizeof(TableObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = Table_new,
    .tp_dealloc = (destructor)Table_dealloc,
    .tp_traverse = (traverseproc)Table_traverse,
    .tp_clear = (inquiry)Table_clear,
    .tp_iter = (getiterfunc)Table_iter,
    .tp_as_mapping = &Table_mapping,
    .tp_as_sequence = &Table_sequence,
    .tp_methods = Table_methods,
};

/* ---- Timer ---------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    /* What every request reads, together: a few cache lines. */
    CoreObject *core;
    TableObject *table;         /* the RequestTimer's requests in progress */
    PyObject   *owner;          /* the RequestTimer, for the context's (owner, handle) */
    PyObject   *getcurrent;     /* greenlet.getcurrent, or None */
    PyObject   *interrupted;    /* set: their handles, once interrupted */
    PyObject   *server_wrapper; /* the last wsgi.file_wrapper seen that is no class, or NULL */
    PyObject   *timing_wrapper; /* what stands for it in the environ, or None: it is left */
    PyObject   *timed_file_type; /* the type of the file that stand-in hands the server, or NULL */
    int64_t     look_at;        /* monotonic ns: its next look */
    int64_t     due_ns;         /* the first stage, after the start, for the default timeout */
    int64_t     timeout_ns;     /* the default timeout */
    int64_t     warn_ns;        /* warn_after, or 0 */
    pid_t       pid;            /* the process this Timer serves */
    char        retired;        /* 1 once its RequestTimer has let go of it (retire()) */
    char        interrupt;      /* the Active's interrupt field */
    Py_ssize_t  size;           /* the wheel's payload size */
    char        head[HEAD_SIZE]; /* the record's head with this timer's constants: a copy, no object to reach */
    /* The rest: tasks, and the once-a-second look. */
    int64_t     look_ns;        /* how often the RequestTimer looks at its wheel */
    PyObject   *var;            /* ContextVar: the request in progress here */
    PyObject   *current_tasks;  /* asyncio's {loop: task running}, or None */
    PyObject   *current_task;   /* asyncio.current_task */
    PyObject   *loop;           /* the loop last found running, or NULL */
    PyObject   *holder;         /* asyncio's running-loop holder it was found under, or NULL */
    unsigned long long declined; /* requests it tried and gave back: each then took the waiting path */
} TimerObject;

static PyTypeObject TimerType;

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
static PyObject *Send_make(PyObject *send, PyObject *owner, PyObject *key);

static int Timer_traverse(TimerObject *self, visitproc visit, void *arg)
{
    Py_VISIT(self->core);
    Py_VISIT(self->table);
    Py_VISIT(self->interrupted);
    Py_VISIT(self->var);
    Py_VISIT(self->owner);
    Py_VISIT(self->getcurrent);
    Py_VISIT(self->current_tasks);
    Py_VISIT(self->current_task);
    Py_VISIT(self->loop);
    Py_VISIT(self->holder);
    Py_VISIT(self->server_wrapper);
    Py_VISIT(self->timing_wrapper);
    Py_VISIT(self->timed_file_type);
    /* A 3.11 holder is not tracked by the GC, and holds self->loop (the two
     * are kept together, holds_loop).  Once its thread has let go of it,
     * this Timer holds it alone, and its reference to the loop is this
     * Timer's too: visited as such, so that a loop dropped unclosed, with
     * the requests its tasks hold, can be collected. */
    if (self->holder && self->holder != self->loop && Py_REFCNT(self->holder) == 1)
        Py_VISIT(self->loop);
    return 0;
}

static int Timer_clear(TimerObject *self)
{
    Py_CLEAR(self->core);
    Py_CLEAR(self->table);
    Py_CLEAR(self->interrupted);
    Py_CLEAR(self->var);
    Py_CLEAR(self->owner);
    Py_CLEAR(self->getcurrent);
    Py_CLEAR(self->current_tasks);
    Py_CLEAR(self->current_task);
    Py_CLEAR(self->loop);
    Py_CLEAR(self->holder);
    Py_CLEAR(self->server_wrapper);
    Py_CLEAR(self->timing_wrapper);
    Py_CLEAR(self->timed_file_type);
    return 0;
}

static void Timer_dealloc(TimerObject *self)
{
    PyObject_GC_UnTrack(self);
    Timer_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int Timer_init(TimerObject *self, PyObject *args, PyObject *kwds)
{
    /* Made in one place, with keywords (RequestTimer._make_fast). */
    static char *names[] = {"core", "head", "due_ns", "timeout_ns", "size", "table", "interrupted", "var",
                            "owner", "getcurrent", "interrupt", "warn_ns", "look_ns", "current_tasks",
                            "current_task", NULL};
    PyObject *core, *head, *table, *interrupted, *var, *owner, *getcurrent;
    PyObject *current_tasks = Py_None, *current_task = Py_None;
    long long due, timeout, warn, look;
    Py_ssize_t size;
    int interrupt;

    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!SLLnO!O!OOOpLL|OO:Timer", names,
                                     &CoreType, &core, &head, &due, &timeout, &size, &TableType, &table,
                                     &PySet_Type, &interrupted, &var, &owner, &getcurrent, &interrupt, &warn,
                                     &look, &current_tasks, &current_task))
        return -1;
    if (PyBytes_GET_SIZE(head) != HEAD_SIZE) {
        PyErr_Format(PyExc_ValueError, "head must be %d bytes", HEAD_SIZE);
        return -1;
    }
    if (!PyContextVar_CheckExact(var)) {
        PyErr_SetString(PyExc_TypeError, "var must be a ContextVar");
        return -1;
    }
    if (size < HEAD_SIZE || size > (Py_ssize_t)SHMW_MAX_PAYLOAD || timeout <= 0 || due <= 0 || warn < 0
        || look <= 0) {
        PyErr_SetString(PyExc_ValueError, "a Timer's sizes or times are out of range");
        return -1;
    }
    Timer_clear(self);
    self->core = (CoreObject *)Py_NewRef(core);
    memcpy(self->head, PyBytes_AS_STRING(head), HEAD_SIZE);
    self->due_ns = due;
    self->timeout_ns = timeout;
    self->warn_ns = warn;
    self->look_ns = look;
    self->retired = 0;
    self->look_at = 0;  /* the first request has the look: an AutoDriver that waits for it starts there */
    self->pid = current_pid;
    self->size = size;
    self->table = (TableObject *)Py_NewRef(table);
    self->interrupted = Py_NewRef(interrupted);
    self->var = Py_NewRef(var);
    self->owner = Py_NewRef(owner);
    self->getcurrent = Py_NewRef(getcurrent);
    self->interrupt = (char)interrupt;
    self->current_tasks = PyDict_Check(current_tasks) ? Py_NewRef(current_tasks) : Py_NewRef(Py_None);
    self->current_task = Py_NewRef(current_task);
    return 0;
}

/* Little-endian stores, as the record is packed ("<"): one move each on
 * x86 (gcc -O2 keeps a byte loop a loop). */
static inline void put_u64le(char *p, uint64_t v)
{
#if __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = __builtin_bswap64(v);
#endif
    memcpy(p, &v, sizeof v);
}

static inline void put_u32le(char *p, uint32_t v)
{
#if __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = __builtin_bswap32(v);
#endif
    memcpy(p, &v, sizeof v);
}

/* Whether the str ``kind`` is ``name``, an interned ASCII literal: by
 * identity (the server's literals are interned), else by length and bytes,
 * which tells most types apart at the length. */
static inline int kind_is(PyObject *kind, PyObject *name)
{
    Py_ssize_t n = PyUnicode_GET_LENGTH(name);

    return kind == name || (PyUnicode_IS_ASCII(kind) && PyUnicode_GET_LENGTH(kind) == n
                            && memcmp(PyUnicode_1BYTE_DATA(kind), PyUnicode_1BYTE_DATA(name), (size_t)n) == 0);
}

/* What _record.REQUEST_ID matches: [A-Za-z0-9._:@/+=-]. */
static inline int request_id_char(unsigned char c)
{
    return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '.' || c == '_'
        || c == ':' || c == '@' || c == '/' || c == '+' || c == '=' || c == '-';
}

/* The client's request id as the record takes it: its ASCII bytes if it is
 * all REQUEST_ID's characters, and none if not (the record's own id stands
 * in).  A str, or bytes, which ASGI's headers are: their latin-1 text is
 * kept or not alike.  -1: neither, which RequestTimer.start's own path
 * deals with. */
static Py_ssize_t request_id_of(PyObject *rid, const char **data)
{
    const unsigned char *s;
    Py_ssize_t n, k;

    *data = "";
    if (rid == Py_None)
        return 0;
    if (PyBytes_CheckExact(rid)) {
        s = (const unsigned char *)PyBytes_AS_STRING(rid);
        n = PyBytes_GET_SIZE(rid);
    } else if (PyUnicode_CheckExact(rid)) {
        if (!PyUnicode_IS_ASCII(rid))
            return 0;
        s = PyUnicode_1BYTE_DATA(rid);
        n = PyUnicode_GET_LENGTH(rid);
    } else {
        return -1;
    }
    if (n < 1 || n > SHMW_REQ_MAX_REQUEST_ID)
        return 0;
    for (k = 0; k < n; k++)
        if (!request_id_char(s[k]))
            return 0;
    *data = (const char *)s;
    return n;
}

/* Whether ``t`` is still its RequestTimer's Timer in this process, which
 * a WSGI callable and a Body keep rather than ask the RequestTimer for
 * every request: a Timer is made for one process (the RequestTimer makes
 * another in a forked child) and retired when the RequestTimer lets go of
 * it (RequestTimer._drop_fast: a wheel replaced, a fork). */
static inline int current(const TimerObject *t)
{
    return !t->retired && t->pid == current_pid;
}

/* Whether this Timer serves a request now: 1, yes; 0, no, the caller's own
 * path does (a closed wheel, a Timer made in another process, or one that
 * the RequestTimer's look has just replaced); -1, the look failed.  The
 * look comes at the first request and then once a second. */
static int ready(TimerObject *self, int64_t now)
{
    PyObject *at, *r;
    int mine = self->pid == current_pid;

    if (!self->core->w)
        return 0;
    if (mine) {
        if (now < self->look_at)
            return 1;
        self->look_at = now + self->look_ns;
    }
    /* Not mine: a Timer made before a fork, which the look notices where
     * Python's fork hooks did not run (uWSGI's), and the caller's own path
     * attaches this process. */
    if (!(at = PyLong_FromLongLong(now)))
        return -1;
    r = PyObject_CallMethodOneArg(self->owner, str_look, at);
    Py_DECREF(at);
    if (!r)
        return -1;
    Py_DECREF(r);
    if (!mine)
        return 0;
    /* Still the RequestTimer's Timer: the wheel it looked at is this one. */
    if (!(r = PyObject_GetAttr(self->owner, str_fast)))
        return -1;
    Py_DECREF(r);
    return r == (PyObject *)self;
}

/* The request in progress in this thread, where a plain thread runs it (no
 * asyncio or trio task, no greenlet but its thread's own): what extend()
 * and no_timeout() find (shmwheel._fast.here()).  A request in a task or a
 * greenlet sets the RequestTimer's context variable instead, whose set
 * makes three objects (a mapping, its node and a token), where this makes
 * none.  Filled at the request's start, emptied at its finish if that comes
 * in this thread; one whose finish comes in another thread, or never, is
 * left here until the thread's next, so whoever reads this checks that the
 * table still holds it.  It holds a reference to the RequestTimer, which a
 * thread that ends mid-request keeps.
 *
 * Initial-exec on glibc: one load at a fixed offset from the thread
 * pointer, where the default model for a module loaded with dlopen calls
 * __tls_get_addr, which reads four cache lines a request that a server's
 * other work has long evicted.  glibc keeps room in the static TLS block
 * for modules loaded later; a process out of it fails the import, and the
 * package goes on without this module.  Other C libraries (musl) may
 * refuse the model in a dlopen'ed module: the default there. */
#ifdef __GLIBC__
#define HERE_TLS __attribute__((tls_model("initial-exec")))
#else
#define HERE_TLS
#endif
static __thread HERE_TLS struct {
    PyObject *owner;            /* the RequestTimer, or NULL */
    int64_t   key;              /* the request's handle */
    uint64_t  thread;           /* PyThread_get_thread_ident(), once asked (a fork keeps it) */
} here;

/* This thread's ident, as threading.get_ident() gives it. */
static inline uint64_t this_thread(void)
{
    if (!here.thread)
        here.thread = (uint64_t)PyThread_get_thread_ident();
    return here.thread;
}

/* Files the request of ``key`` as this thread's.  May run Python (the
 * previous one's last reference), so the caller is done with the table. */
static void here_enter(PyObject *owner, int64_t key)
{
    PyObject *old = here.owner;

    here.owner = Py_NewRef(owner);
    here.key = key;
    Py_XDECREF(old);
}

/* Empties this thread's slot if it holds the request of ``key``. */
static void here_leave(PyObject *owner, int64_t key)
{
    PyObject *old = here.owner;

    if (old == owner && here.key == key) {
        here.owner = NULL;
        Py_DECREF(old);
    }
}

/* The request's timer added and the request filed: the record packed from
 * the Timer's head and the request's method, id and path (two pieces, the
 * second may be empty), started at ``started`` and due ``timeout`` ns after
 * it, into the table's spare buffer, which becomes its slot's.  Returns the
 * handle; None, having changed nothing, for the caller's own path to take
 * the request (a record to cut, a method to replace characters of, the
 * segment's lock held by another, the wheel closed, removed or full:
 * anything but the plain case); NULL with an exception.  It may run Python
 * (greenlet's getcurrent) before it writes the record, so the caller holds
 * what the pieces' pointers and ``request_id`` point into. */
static PyObject *start_request(TimerObject *self, int64_t now, int64_t started, int64_t timeout, PyObject *method,
                               const char *p1, Py_ssize_t l1, const char *p2, Py_ssize_t l2, PyObject *request_id,
                               PyObject *task)
{
    PyObject *current = NULL, *key = NULL, *context = NULL, *token, *held = NULL;
    TableObject *table = self->table;
    const char *rid;
    Py_ssize_t mlen, rlen, n;
    uint64_t thread, timeout_ms = 0, queued_ms = 0;
    int64_t handle, due;
    char *buf;
    uint8_t flags;
    Slot *slot;
    shmw_t *w = self->core->w;

    if (!w || !PyUnicode_CheckExact(method) || !PyUnicode_IS_ASCII(method))
        Py_RETURN_NONE;
    mlen = PyUnicode_GET_LENGTH(method);
    if (mlen > SHMW_REQ_MAX_METHOD || (rlen = request_id_of(request_id, &rid)) < 0)
        Py_RETURN_NONE;
    n = HEAD_SIZE + mlen + rlen + l1 + l2;
    if (n > self->size)
        Py_RETURN_NONE;         /* cut to fit, by encode_request */

    flags = (uint8_t)self->head[OFF_FLAGS];
    if (timeout == self->timeout_ns && started == now) {
        due = now + self->due_ns;
    } else {
        /* A timeout of its own (a route), or a start before now (the
         * proxy's X-Request-Start): its stages from its start. */
        int warn = self->warn_ns > 0 && self->warn_ns < timeout;

        if (timeout <= 0 || started > now)
            Py_RETURN_NONE;
        timeout_ms = (uint64_t)(timeout / 1000000) + (timeout % 1000000 != 0);
        queued_ms = (uint64_t)((now - started) / 1000000) + ((now - started) % 1000000 != 0);
        if (timeout_ms > UINT32_MAX || queued_ms > UINT32_MAX)
            Py_RETURN_NONE;
        due = started + (warn ? self->warn_ns : timeout);
        flags = (uint8_t)((flags & ~SHMW_REQ_WARN) | (warn ? SHMW_REQ_WARN : 0));
    }
    if (task != Py_None) {
        /* The asyncio or trio task that runs the request. */
        flags |= SHMW_REQ_TASK;
    } else if (self->getcurrent != Py_None) {
        /* A greenlet that is not its thread's own serves the request. */
        PyObject *parent;

        if (!(current = PyObject_CallNoArgs(self->getcurrent)))
            return NULL;
        if (!(parent = PyObject_GetAttrString(current, "parent"))) {
            Py_DECREF(current);
            return NULL;
        }
        if (parent != Py_None) {
            task = current;
            flags |= SHMW_REQ_GREENLET;
        }
        Py_DECREF(parent);
    }
    thread = this_thread();

    /* Room for the request in the table, and its record written into the
     * spare buffer.  From here until it is filed no Python runs. */
    if (Table_reserve(table) < 0 || room_for(&table->spare, &table->spare_room, n) < 0) {
        Py_XDECREF(current);
        return NULL;
    }
    buf = table->spare;
    memcpy(buf, self->head, HEAD_SIZE);
    buf[OFF_MLEN] = (char)mlen;
    buf[OFF_RLEN] = (char)rlen;
    buf[OFF_FLAGS] = (char)flags;
    put_u64le(buf + OFF_STARTED, (uint64_t)started);
    put_u64le(buf + OFF_THREAD, thread);
    put_u64le(buf + OFF_TASK, task == Py_None ? 0 : (uint64_t)(uintptr_t)task);
    if (timeout_ms) {
        put_u32le(buf + OFF_TIMEOUT, (uint32_t)timeout_ms);
        put_u32le(buf + OFF_QUEUED, (uint32_t)queued_ms);
    }
    memcpy(buf + HEAD_SIZE, PyUnicode_1BYTE_DATA(method), (size_t)mlen);
    memcpy(buf + HEAD_SIZE + mlen, rid, (size_t)rlen);
    memcpy(buf + HEAD_SIZE + mlen + rlen, p1, (size_t)l1);
    if (l2)
        memcpy(buf + HEAD_SIZE + mlen + rlen + l1, p2, (size_t)l2);

    /* The one call under the segment's lock: a try, which the GIL allows. */
    handle = self->core->add_at(w, due > now ? due : now, buf, (uint32_t)n,
                                SHMW_CANCEL_ON_EXIT | SHMW_TRYLOCK);
    if (handle < 0) {
        Py_XDECREF(current);
        Py_RETURN_NONE;
    }
    slot = Table_put(table, handle, (uint32_t)n);
    slot->handle = handle;
    slot->deadline_ns = due;
    slot->timeout_ns = started + timeout;
    slot->thread = thread;
    slot->interrupt = self->interrupt;
    slot->task = Py_NewRef(task);

    /* This thread's, or the context's, as RequestTimer.start files it.  A
     * failure here (memory) takes the request out again, so that no timer
     * outlives an unfiled request. */
    if (!(key = PyLong_FromLongLong(handle)))
        goto undo;
    if (task == Py_None) {
        here_enter(self->owner, handle);
    } else {
        if (!(context = PyTuple_Pack(2, self->owner, key)) || !(token = PyContextVar_Set(self->var, context)))
            goto undo;
        Py_DECREF(token);
        Py_DECREF(context);
    }
    Py_XDECREF(current);
    return key;

undo:
    if ((slot = Table_find(table, handle)))
        held = Table_take(table, slot);
    if (self->core->try_cancel(w, handle) != 1) {
        /* The lock held elsewhere: cancelled the waiting way (the GIL let
         * go), so that no timer outlives an unfiled request. */
        PyObject *t, *v, *tb, *h, *r = NULL;

        PyErr_Fetch(&t, &v, &tb);
        if ((h = PyLong_FromLongLong(handle))) {
            r = PyObject_CallMethodOneArg(self->owner, str_cancel, h);
            Py_DECREF(h);
        }
        if (!r)
            PyErr_WriteUnraisable(self->owner);
        Py_XDECREF(r);
        PyErr_Restore(t, v, tb);
    }
    Py_XDECREF(held);
    Py_XDECREF(current);
    Py_XDECREF(key);
    Py_XDECREF(context);
    return NULL;
}

/* An int argument in ns, or None for ``otherwise``. */
static int ns_arg(PyObject *o, int64_t otherwise, int64_t *out)
{
    long long v;

    if (o == Py_None) {
        *out = otherwise;
        return 0;
    }
    v = as_int64(o);
    if (v == -1 && PyErr_Occurred())
        return -1;
    *out = v;
    return 0;
}

/* ``key`` as start_request() or start_path() gave it back, counted in
 * self->declined if it is None: a request tried and given back. */
static PyObject *declined(TimerObject *self, PyObject *key)
{
    if (key == Py_None)
        self->declined++;
    return key;
}

/* start_request() for a str ``path``, as the record holds it: ASCII as it
 * is, else UTF-8 with the surrogates escaped.  None for a path or an id of
 * another type (the id a str or None, as RequestTimer.start takes it). */
static PyObject *start_path(TimerObject *self, int64_t now, int64_t started, int64_t timeout, PyObject *method,
                            PyObject *path, PyObject *request_id, PyObject *task)
{
    PyObject *encoded = NULL, *key;
    const char *pdata;
    Py_ssize_t plen;

    if (!PyUnicode_CheckExact(path) || PyBytes_Check(request_id))
        Py_RETURN_NONE;
    if (PyUnicode_IS_ASCII(path)) {
        pdata = (const char *)PyUnicode_1BYTE_DATA(path);
        plen = PyUnicode_GET_LENGTH(path);
    } else {
        if (!(encoded = PyUnicode_AsEncodedString(path, "utf-8", "surrogateescape"))) {
            PyErr_Clear();
            Py_RETURN_NONE;
        }
        pdata = PyBytes_AS_STRING(encoded);
        plen = PyBytes_GET_SIZE(encoded);
    }
    key = start_request(self, now, started, timeout, method, pdata, plen, "", 0, request_id, task);
    Py_XDECREF(encoded);
    return key;
}

/* start(now_ns, method, path, request_id, task[, timeout_ns[, started_ns]]):
 * the request's handle; or None, having changed nothing, for the caller's
 * own path (see start_request).  timeout_ns (None: the Timer's) and
 * started_ns (None: now) are a request's own: a route's, a proxy's start. */
static PyObject *Timer_start(TimerObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    int64_t now, timeout, started;
    int r;

    if (nargs < 5 || nargs > 7) {
        PyErr_SetString(PyExc_TypeError, "start(now_ns, method, path, request_id, task[, timeout_ns[, started_ns]])");
        return NULL;
    }
    if (ns_arg(args[0], 0, &now) < 0 || ns_arg(nargs > 5 ? args[5] : Py_None, self->timeout_ns, &timeout) < 0
        || ns_arg(nargs > 6 ? args[6] : Py_None, now, &started) < 0)
        return NULL;
    if ((r = ready(self, now)) <= 0)
        return r < 0 ? NULL : Py_NewRef(Py_None);
    return declined(self, start_path(self, now, started, timeout, args[1], args[2], args[3], args[4]));
}

/* The request of ``key`` taken out of the table and its timer cancelled:
 * None if the table has no such request; True once its timer is cancelled;
 * else its Active, for the caller's own path to cancel (the lock held by
 * another, a timer in a wheel replaced since, one that has fired). */
static PyObject *finish_request(TimerObject *self, PyObject *key)
{
    TableObject *table = self->table;
    PyObject *active;
    shmw_t *w = self->core->w;
    Slot *s;
    int64_t k;
    int r;

    if ((r = key_of(key, &k)) <= 0)
        return r < 0 ? NULL : Py_NewRef(Py_None);
    if (!(s = Table_find(table, k)))
        Py_RETURN_NONE;
    if (PySet_GET_SIZE(self->interrupted)) {
        if (PySet_Discard(self->interrupted, key) < 0)
            return NULL;
        /* Found again: an int's hash and == run no Python, but a set is not the table. */
        if (!(s = Table_find(table, k)))
            Py_RETURN_NONE;
    }
    if (w && self->core->try_cancel(w, s->handle) == 1) {
        Py_DECREF(Table_take(table, s));
        here_leave(self->owner, k);
        Py_RETURN_TRUE;
    }
    if (!(active = Table_active(table, k)))
        return PyErr_Occurred() ? NULL : Py_NewRef(Py_None);
    if ((s = Table_find(table, k)))
        Py_DECREF(Table_take(table, s));
    here_leave(self->owner, k);
    return active;
}

/* finish(handle): as finish_request. */
static PyObject *Timer_finish(TimerObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 1) {
        PyErr_SetString(PyExc_TypeError, "finish(handle)");
        return NULL;
    }
    return finish_request(self, args[0]);
}

/* RequestTimer.finish(key) without its frame: through the RequestTimer's
 * Timer of the moment (a wheel attached again since the start has a new
 * one), the rest of the way in RequestTimer._finished; or finish() itself
 * where no Timer of this process serves.  ``owner`` is the RequestTimer,
 * or the Timer that started the request (a Body's), which ends it itself
 * while it is current.  0, or -1 with an exception. */
static int end_request(PyObject *owner, PyObject *key)
{
    PyObject *fast, *r;

    if (key == Py_None)
        return 0;
    if (Py_IS_TYPE(owner, &TimerType)) {
        TimerObject *t = (TimerObject *)owner;

        if (!(owner = t->owner))
            return 0;           /* cleared by the collector: nothing left to end it with */
        fast = current(t) ? Py_NewRef(t) : PyObject_GetAttr(owner, str_fast);
    } else {
        fast = PyObject_GetAttr(owner, str_fast);
    }
    if (!fast)
        return -1;
    if (Py_IS_TYPE(fast, &TimerType) && ((TimerObject *)fast)->pid == current_pid) {
        r = finish_request((TimerObject *)fast, key);
        Py_DECREF(fast);
        if (!r)
            return -1;
        if (r == Py_None || r == Py_True) {
            Py_DECREF(r);
            return 0;
        }
        fast = r;               /* the Active, for the rest of the way */
        r = PyObject_CallMethodOneArg(owner, str_finished, fast);
    } else {
        r = PyObject_CallMethodOneArg(owner, str_finish, key);
    }
    Py_DECREF(fast);
    if (!r)
        return -1;
    Py_DECREF(r);
    return 0;
}

/* end_request() as a ``finally`` runs it: ``exc`` is the exception being
 * handled meanwhile, so that one raised in there gets it (or what it was
 * raised within) as its __context__, the way Python chains exceptions.
 * 0, or -1 with end_request's exception. */
static int end_handling(PyObject *exc, PyObject *owner, PyObject *key)
{
    PyObject *before = PyErr_GetHandledException();
    int r;

    PyErr_SetHandledException(exc);
    r = end_request(owner, key);
    PyErr_SetHandledException(before);
    Py_XDECREF(before);
    return r;
}

/* end_request() while an exception is being raised: it goes on being
 * raised, or, if end_request fails too, that failure does, chained to it
 * as by a ``finally`` that raises. */
static void end_raising(PyObject *owner, PyObject *key)
{
    PyObject *t, *v, *tb;

    PyErr_Fetch(&t, &v, &tb);
    PyErr_NormalizeException(&t, &v, &tb);
    if (tb && v)
        PyException_SetTraceback(v, tb);
    if (end_handling(v, owner, key) < 0) {
        Py_XDECREF(t);
        Py_XDECREF(v);
        Py_XDECREF(tb);
    } else {
        PyErr_Restore(t, v, tb);
    }
}

static PyObject *Body_make(PyObject *body, PyObject *owner, PyObject *key);

/* An environ's str, borrowed: its value, ``otherwise`` if it has none;
 * NULL without an exception if it is not an ASCII str. */
static PyObject *environ_ascii(PyObject *environ, PyObject *name, PyObject *otherwise)
{
    PyObject *v = PyDict_GetItemWithError(environ, name);

    if (!v)
        return PyErr_Occurred() ? NULL : otherwise;
    return PyUnicode_CheckExact(v) && PyUnicode_IS_ASCII(v) ? v : NULL;
}

/* Puts in the environ what stands for the server's wsgi.file_wrapper where
 * that is a function, uWSGI's (RequestTimer._timing_file_wrapper, asked
 * once for the last one seen): the file goes to the server as a timed one.
 * 1 if it did, 0 if the wrapper is left as it is, -1 with an exception. */
static int timing_file_wrapper(TimerObject *self, PyObject *environ)
{
    PyObject *wrapper = PyDict_GetItemWithError(environ, str_file_wrapper), *timing, *type = NULL, *old[3];
    int r;

    if (!wrapper)
        return PyErr_Occurred() ? -1 : 0;
    if (PyType_Check(wrapper))
        return 0;               /* a class: its body is made again afterwards (_file_body) */
    if (wrapper == self->server_wrapper) {
        timing = Py_XNewRef(self->timing_wrapper);
    } else {
        Py_INCREF(wrapper);
        timing = PyObject_CallMethodOneArg(self->owner, str_timing_file_wrapper, wrapper);
        if (!timing || (timing != Py_None && !(type = PyObject_GetAttr(timing, str_file_type)))) {
            Py_XDECREF(timing);
            Py_DECREF(wrapper);
            return -1;
        }
        /* All three set before any old one goes: a finalizer that runs
         * then may hand the GIL to a thread that reads them. */
        old[0] = self->server_wrapper;
        old[1] = self->timing_wrapper;
        old[2] = self->timed_file_type;
        self->server_wrapper = wrapper;
        self->timing_wrapper = Py_NewRef(timing);
        self->timed_file_type = type;
        Py_XDECREF(old[0]);
        Py_XDECREF(old[1]);
        Py_XDECREF(old[2]);
    }
    r = !timing || timing == Py_None ? 0 : PyDict_SetItem(environ, str_file_wrapper, timing) < 0 ? -1 : 1;
    Py_XDECREF(timing);
    return r;
}

/* Whether ``body`` is the timed file this request's stand-in wrapper handed
 * the server, which then ends the timer when closed (wsgi._is_timed_file):
 * 1, 0, or -1 with an exception. */
static int is_timed_file(TimerObject *self, PyObject *body, PyObject *key)
{
    PyObject *value;
    int r;

    if (!self->timed_file_type || !Py_IS_TYPE(body, (PyTypeObject *)self->timed_file_type))
        return 0;
    if (!(value = PyObject_GetAttr(body, str_timer)))
        return -1;
    r = value == self->owner;
    Py_DECREF(value);
    if (!r)
        return 0;
    if (!(value = PyObject_GetAttr(body, str_for)))
        return -1;
    r = PyObject_RichCompareBool(value, key, Py_EQ);
    Py_DECREF(value);
    /* From here its close() ends the timer. */
    return r <= 0 ? r : PyObject_SetAttr(body, str_handle, key) < 0 ? -1 : 1;
}

/* wsgi(app, environ, start_response): TimeoutMiddleware's call, start to
 * body: the request's timer started from the environ, its handle put in it
 * as ``shmwheel.timer``, the application called, and its body given back
 * in a Body (a file handed to a server's wrapper that is a function: the
 * timed file that wrapper was given); the timer finished if the
 * application raises.
 * NotImplemented, having called nothing, where the middleware's own path
 * takes the request: an environ that is not a dict or has a field that is
 * not an ASCII str.  None, having called nothing, for a request it tried
 * and gave back (what start() gives back None for): the middleware's
 * waiting path takes it (TimeoutMiddleware._serve with declined). */
static PyObject *Timer_wsgi(TimerObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *environ, *method, *script, *path, *rid, *key, *body, *wrapper, *result, *call[2];
    int64_t now;
    int r, swapped = 0;

    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "wsgi(app, environ, start_response)");
        return NULL;
    }
    environ = args[1];
    if (!PyDict_CheckExact(environ))
        Py_RETURN_NOTIMPLEMENTED;
    now = monotonic_ns();
    if ((r = ready(self, now)) <= 0)
        return r < 0 ? NULL : Py_NewRef(Py_NotImplemented);
    if (!(method = PyDict_GetItemWithError(environ, str_request_method))) {
        if (PyErr_Occurred())
            return NULL;
        method = str_dash;
    }
    script = environ_ascii(environ, str_script_name, str_empty);
    path = script ? environ_ascii(environ, str_path_info, str_empty) : NULL;
    if (!path) {
        if (PyErr_Occurred())
            return NULL;
        Py_RETURN_NOTIMPLEMENTED;
    }
    if (!(rid = PyDict_GetItemWithError(environ, str_request_id))) {
        if (PyErr_Occurred())
            return NULL;
        rid = Py_None;
    }
    /* Held: start_request may run Python (greenlet's getcurrent), which may change the environ. */
    Py_INCREF(method);
    Py_INCREF(script);
    Py_INCREF(path);
    Py_INCREF(rid);
    key = declined(self, start_request(self, now, now, self->timeout_ns, method,
                                       (const char *)PyUnicode_1BYTE_DATA(script), PyUnicode_GET_LENGTH(script),
                                       (const char *)PyUnicode_1BYTE_DATA(path), PyUnicode_GET_LENGTH(path), rid,
                                       Py_None));
    Py_DECREF(method);
    Py_DECREF(script);
    Py_DECREF(path);
    Py_DECREF(rid);
    if (!key)
        return NULL;
    if (key == Py_None)
        return key;             /* tried and given back: the waiting path */
    if (PyDict_SetItem(environ, str_environ_key, key) < 0 || (swapped = timing_file_wrapper(self, environ)) < 0)
        goto failed;
    call[0] = environ;
    call[1] = args[2];
    if (!(body = PyObject_Vectorcall(args[0], call, 2, NULL)))
        goto failed;
    /* A file the stand-in wrapper handed the server: the server sends it
     * itself only if it is the body, and its close() ends the timer. */
    if (swapped && (r = is_timed_file(self, body, key)) != 0) {
        if (r < 0) {
            Py_DECREF(body);
            goto failed;
        }
        Py_DECREF(key);
        return body;
    }
    /* A file the server sends itself (its wsgi.file_wrapper, with sendfile):
     * made again around a file whose close() ends the timer, so that the
     * server still sends it itself (RequestTimer._file_body).  Looked up
     * again, as a server whose wrapper is a class does (Gunicorn's
     * isinstance); not where the wrapper is a function that the stand-in
     * took the place of, whose server knows its files by themselves. */
    wrapper = swapped ? NULL : PyDict_GetItemWithError(environ, str_file_wrapper);
    if (wrapper && PyType_Check(wrapper) && Py_IS_TYPE(body, (PyTypeObject *)wrapper)) {
        Py_INCREF(wrapper);
        result = PyObject_CallMethodObjArgs(self->owner, str_file_body, body, wrapper, key, NULL);
        Py_DECREF(wrapper);
        if (!result) {
            Py_DECREF(body);
            goto failed;
        }
        if (result != Py_None) {
            Py_DECREF(body);
            Py_DECREF(key);
            return result;
        }
        Py_DECREF(result);
    } else if (!wrapper && PyErr_Occurred()) {
        PyErr_Clear();          /* a lookup that failed: the body as any other */
    }
    result = Body_make(body, (PyObject *)self, key);
    Py_DECREF(body);
    if (!result)
        goto failed;
    Py_DECREF(key);
    return result;

failed:
    end_raising(self->owner, key);
    Py_DECREF(key);
    return NULL;
}


/* Whether ``holder``, the value under asyncio's running-loop key in a
 * thread's state dict, stands for ``loop``: CPython 3.11's holder (a
 * _RunningLoopHolder, untracked by the GC, whose first field is its loop),
 * or the loop itself (3.12 on).  Anything else is not cached. */
static int holds_loop(PyObject *holder, PyObject *loop)
{
    PyTypeObject *type = Py_TYPE(holder);

    if (holder == loop)
        return 1;
    return strcmp(type->tp_name, "_RunningLoopHolder") == 0 && !PyType_IS_GC(type)
        && type->tp_basicsize >= (Py_ssize_t)(sizeof(PyObject) + sizeof(PyObject *))
        && *(PyObject **)((char *)holder + sizeof(PyObject)) == loop;
}

/* The asyncio task that runs this code: asyncio.current_task() without
 * its get_running_loop(), which on CPython 3.11 asks the kernel for the
 * pid every call.  asyncio keeps the running loop of a thread in a holder
 * in the thread's state dict, a new holder each time a loop starts or
 * stops running there; the holder and loop last found are kept, and while
 * that very holder is the thread's, that loop still runs in it.  New
 * reference; None outside asyncio; NULL with an exception. */
static PyObject *asyncio_task(TimerObject *self)
{
    PyObject *ts_dict = PyThreadState_GetDict(), *holder = NULL, *task;

    if (ts_dict) {
        if (!(holder = PyDict_GetItemWithError(ts_dict, str_running_loop)) && PyErr_Occurred())
            return NULL;
        if (holder && holder == self->holder && self->current_tasks != Py_None) {
            if ((task = PyDict_GetItemWithError(self->current_tasks, self->loop)))
                return Py_NewRef(task);
            return PyErr_Occurred() ? NULL : Py_NewRef(Py_None);
        }
    }
    Py_XINCREF(holder);         /* kept across the call below, which may set another */
    if (self->current_task == Py_None || !(task = PyObject_CallNoArgs(self->current_task))) {
        Py_XDECREF(holder);
        if (self->current_task != Py_None) {
            if (!PyErr_ExceptionMatches(PyExc_RuntimeError))    /* no loop runs here */
                return NULL;
            PyErr_Clear();
        }
        Py_RETURN_NONE;
    }
    if (holder && task != Py_None && self->current_tasks != Py_None) {
        /* The task's loop, for the next request while this holder is the thread's. */
        PyObject *loop = PyObject_CallMethod(task, "get_loop", NULL);

        if (!loop) {
            PyErr_Clear();
        } else if (!holds_loop(holder, loop)) {
            Py_DECREF(loop);
        } else {
            Py_XSETREF(self->loop, loop);
            Py_XSETREF(self->holder, Py_NewRef(holder));
        }
    }
    Py_XDECREF(holder);
    return task;
}

/* The ASGI middleware's start of an HTTP request: its timer started from
 * the scope (its method, path and X-Request-Id, and the asyncio task that
 * runs it), ``*timed_scope`` a copy of the scope with ``shmwheel.timer``
 * (the ASGI spec: a middleware copies a scope it changes) and
 * ``*timed_send`` a Send around the server's.  Returns the handle; None,
 * having started nothing, where the middleware's own path takes the
 * request (what start() gives back None for, a scope that holds what it
 * does not expect, a task that is not asyncio's); NULL with an exception. */
static PyObject *asgi_start(TimerObject *self, PyObject *scope, PyObject *send, PyObject **timed_scope,
                            PyObject **timed_send)
{
    PyObject *method, *path, *headers, *key, *task, *copy;
    PyObject *rid = Py_None;
    int64_t now = monotonic_ns();
    int r;

    if ((r = ready(self, now)) <= 0)
        return r < 0 ? NULL : Py_NewRef(Py_None);
    /* First, as it may run Python (current_task() at a thread's first
     * request): the scope's values read after it are borrowed. */
    if (!(task = asyncio_task(self)) || task == Py_None)
        return task;            /* not in an asyncio task (trio's, say): its own path finds what runs it */
    method = environ_ascii(scope, str_method, str_dash);
    path = method ? PyDict_GetItemWithError(scope, str_path) : NULL;
    if (!path || !PyUnicode_CheckExact(path) || !PyUnicode_IS_ASCII(path) || !PyUnicode_GET_LENGTH(path))
        goto own;               /* none, "", or not ASCII: its own path says "/" or encodes it */
    headers = PyDict_GetItemWithError(scope, str_headers);
    if (headers && PyList_CheckExact(headers)) {
        Py_ssize_t k, n = PyList_GET_SIZE(headers);

        for (k = 0; k < n; k++) {
            PyObject *h = PyList_GET_ITEM(headers, k), *name;

            if (!PyTuple_CheckExact(h) || PyTuple_GET_SIZE(h) != 2)
                goto own;
            name = PyTuple_GET_ITEM(h, 0);
            if (!PyBytes_CheckExact(name))
                goto own;
            if (PyBytes_GET_SIZE(name) == 12 && memcmp(PyBytes_AS_STRING(name), "x-request-id", 12) == 0) {
                rid = PyTuple_GET_ITEM(h, 1);
                break;
            }
        }
    } else if (headers) {
        goto own;
    }
    /* The id's bytes are its latin-1 text, as RequestTimer.start takes it. */
    if (rid != Py_None && !PyBytes_CheckExact(rid))
        goto own;
    key = declined(self, start_request(self, now, now, self->timeout_ns, method,
                                       (const char *)PyUnicode_1BYTE_DATA(path), PyUnicode_GET_LENGTH(path), "", 0,
                                       rid, task));
    Py_DECREF(task);
    if (!key || key == Py_None)
        return key;
    if (!(copy = PyDict_Copy(scope)) || PyDict_SetItem(copy, str_environ_key, key) < 0) {
        Py_XDECREF(copy);
        goto failed;
    }
    if (!(*timed_send = Send_make(send, self->owner, key))) {
        Py_DECREF(copy);
        goto failed;
    }
    *timed_scope = copy;
    return key;

own:
    Py_DECREF(task);
    return PyErr_Occurred() ? NULL : Py_NewRef(Py_None);

failed:
    end_raising(self->owner, key);
    Py_DECREF(key);
    return NULL;
}

static PyObject *Timer_retire(TimerObject *self, PyObject *Py_UNUSED(ignored))
{
    self->retired = 1;
    Py_RETURN_NONE;
}

static PyMethodDef Timer_methods[] = {
    {"start", (PyCFunction)(void (*)(void))Timer_start, METH_FASTCALL,
     "start(now_ns, method, path, request_id, task[, timeout_ns[, started_ns]]): the handle, or None for the "
     "caller's own path."},
    {"finish", (PyCFunction)(void (*)(void))Timer_finish, METH_FASTCALL,
     "finish(handle): None if not in the table, True if cancelled, else the Active taken out."},
    {"wsgi", (PyCFunction)(void (*)(void))Timer_wsgi, METH_FASTCALL,
     "wsgi(app, environ, start_response): the application's body in a Body, or NotImplemented for the "
     "middleware's own path."},
    {"retire", (PyCFunction)Timer_retire, METH_NOARGS,
     "retire(): the RequestTimer has let go of this Timer; whoever kept it asks the RequestTimer again."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef Timer_members[] = {
    {"look_at", T_LONGLONG, offsetof(TimerObject, look_at), 0,
     "time.monotonic_ns() of the RequestTimer's next look at its wheel, which the next start() after it has."},
    {"retired", T_BOOL, offsetof(TimerObject, retired), READONLY, "Whether retire() has been called."},
    {"declined", T_ULONGLONG, offsetof(TimerObject, declined), READONLY,
     "Requests it tried and gave back (the lock held elsewhere, a record to cut, an error), each of which "
     "then took the waiting path, not this one again."},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject TimerType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "shmwheel._fast.Timer",
    .tp_basicsize = sizeof(TimerObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "A RequestTimer's constants in one process, and its start and finish on the GIL-keeping path.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Timer_init,
    .tp_traverse = (traverseproc)Timer_traverse,
    .tp_clear = (inquiry)Timer_clear,
    .tp_dealloc = (destructor)Timer_dealloc,
    .tp_methods = Timer_methods,
    .tp_members = Timer_members,
};

/* ---- what Body, Send, WSGI, ASGI and Hooks share ---------------------------- */

/* Each holds up to three objects right after its head (Send, WSGI and ASGI
 * their vectorcall after them), so one make, traverse, clear and dealloc
 * serves the five types. */
typedef struct {
    PyObject_HEAD
    PyObject *held[3];
} HeldObject;

#define HELD_LAYOUT(T, a, b, c)                                                     \
    _Static_assert(offsetof(T, a) == offsetof(HeldObject, held[0])                  \
                   && offsetof(T, b) == offsetof(HeldObject, held[1])               \
                   && offsetof(T, c) == offsetof(HeldObject, held[2]), #T " is not a HeldObject")

static int Held_traverse(HeldObject *self, visitproc visit, void *arg)
{
    int k;

    for (k = 0; k < 3; k++)
        Py_VISIT(self->held[k]);
    return 0;
}

static int Held_clear(HeldObject *self)
{
    int k;

    for (k = 0; k < 3; k++)
        Py_CLEAR(self->held[k]);
    return 0;
}

static void Held_dealloc(HeldObject *self)
{
    PyObject_GC_UnTrack(self);
    Held_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* A new object of ``type`` holding a, b and c (b and c may be NULL), tracked. */
static HeldObject *Held_make(PyTypeObject *type, PyObject *a, PyObject *b, PyObject *c)
{
    HeldObject *self = PyObject_GC_New(HeldObject, type);

    if (!self)
        return NULL;
    self->held[0] = Py_NewRef(a);
    self->held[1] = Py_XNewRef(b);
    self->held[2] = Py_XNewRef(c);
    PyObject_GC_Track(self);
    return self;
}

/* ---- WSGI ----------------------------------------------------------------- */

/* A TimeoutMiddleware as a C callable: the server's call goes straight to
 * the RequestTimer's Timer of the moment (Timer.wsgi) without a Python
 * frame, and to the middleware itself for what that gives back. */
typedef struct {
    PyObject_HEAD
    PyObject *middleware;       /* the TimeoutMiddleware */
    PyObject *app;              /* its application */
    PyObject *timer;            /* its RequestTimer */
    vectorcallfunc vectorcall;
    PyObject *fast;             /* the RequestTimer's Timer last seen, or NULL */
} WSGIObject;

HELD_LAYOUT(WSGIObject, middleware, app, timer);

static PyTypeObject WSGIType;

static int WSGI_traverse(WSGIObject *self, visitproc visit, void *arg)
{
    Py_VISIT(self->fast);
    return Held_traverse((HeldObject *)self, visit, arg);
}

static int WSGI_clear(WSGIObject *self)
{
    Py_CLEAR(self->fast);
    return Held_clear((HeldObject *)self);
}

static void WSGI_dealloc(WSGIObject *self)
{
    PyObject_GC_UnTrack(self);
    WSGI_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *WSGI_vectorcall(WSGIObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    PyObject *fast, *r, *call[3], *tried;

    if (nargs == 2 && !kwnames && self->timer) {
        /* The Timer kept from the last request, while it is current: the
         * RequestTimer's attribute is not looked up for each. */
        if (self->fast && current((TimerObject *)self->fast)) {
            fast = Py_NewRef(self->fast);
        } else {
            if (!(fast = PyObject_GetAttr(self->timer, str_fast)))
                return NULL;
            Py_XSETREF(self->fast, Py_IS_TYPE(fast, &TimerType) ? Py_NewRef(fast) : NULL);
        }
        if (Py_IS_TYPE(fast, &TimerType)) {
            call[0] = self->app;
            call[1] = args[0];
            call[2] = args[1];
            r = Timer_wsgi((TimerObject *)fast, call, 3);
            Py_DECREF(fast);
            if (r != Py_NotImplemented && r != Py_None)
                return r;
            /* The middleware's own path, told whether this tried the request
             * and gave it back (None), or could not read it. */
            if (!self->middleware) {
                Py_DECREF(r);
                PyErr_SetString(PyExc_ValueError, "the application has been cleared");
                return NULL;
            }
            tried = r == Py_None ? Py_True : Py_False;
            Py_DECREF(r);
            return PyObject_CallMethodObjArgs(self->middleware, str_serve, args[0], args[1], tried, NULL);
        } else {
            Py_DECREF(fast);
        }
    }
    if (!self->middleware) {
        PyErr_SetString(PyExc_ValueError, "the application has been cleared");
        return NULL;
    }
    return PyObject_Vectorcall(self->middleware, args, nargsf, kwnames);
}

static PyObject *WSGI_new(PyTypeObject *Py_UNUSED(type), PyObject *args, PyObject *kwds)
{
    PyObject *middleware, *app, *timer = NULL;
    WSGIObject *self;
    static char *names[] = {"middleware", NULL};

    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O:WSGI", names, &middleware))
        return NULL;
    if (!(app = PyObject_GetAttr(middleware, str_app)) || !(timer = PyObject_GetAttr(middleware, str_timer_attr))) {
        Py_XDECREF(app);
        return NULL;
    }
    self = (WSGIObject *)Held_make(&WSGIType, middleware, app, timer);
    if (self) {
        /* Before the drops below, which may run a collection that traverses it. */
        self->vectorcall = (vectorcallfunc)WSGI_vectorcall;
        self->fast = NULL;
    }
    Py_DECREF(app);
    Py_DECREF(timer);
    return (PyObject *)self;
}

static PyObject *WSGI_get_middleware(WSGIObject *self, void *Py_UNUSED(closure))
{
    return Py_NewRef(self->middleware ? self->middleware : Py_None);
}

static PyGetSetDef WSGI_getset[] = {
    {"middleware", (getter)WSGI_get_middleware, NULL, "The TimeoutMiddleware this calls.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject WSGIType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "shmwheel._fast.WSGI",
    .tp_basicsize = sizeof(WSGIObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "WSGI(middleware): a plain TimeoutMiddleware's call, with no Python frame of its own.",
    .tp_new = WSGI_new,
    .tp_traverse = (traverseproc)WSGI_traverse,
    .tp_clear = (inquiry)WSGI_clear,
    .tp_dealloc = (destructor)WSGI_dealloc,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(WSGIObject, vectorcall),
    .tp_getset = WSGI_getset,
};

/* ---- Gunicorn's hooks -------------------------------------------------------- */

/* install()'s pre_request and post_request, as C methods a worker calls
 * with no Python frame of shmwheel's, where every request takes the
 * timeout of the moment from its start (no routes, no X-Request-Start). */
typedef struct {
    PyObject_HEAD
    PyObject *state;            /* gunicorn._state: its ``timer`` is the worker's RequestTimer, or None */
    PyObject *slow;             /* the Python pre_request, for a request this does not take */
    PyObject *header;           /* the request id's header, as Gunicorn names it: "X-REQUEST-ID" */
} HooksObject;

HELD_LAYOUT(HooksObject, state, slow, header);

static PyTypeObject HooksType;

/* getattr(o, name, None), new; NULL with an exception. */
static PyObject *attr_or_none(PyObject *o, PyObject *name)
{
    PyObject *v;

#if PY_VERSION_HEX >= 0x030D0000
    if (PyObject_GetOptionalAttr(o, name, &v) < 0)
        return NULL;
#else
    if (_PyObject_LookupAttr(o, name, &v) < 0)
        return NULL;
#endif
    return v ? v : Py_NewRef(Py_None);
}

/* The first value of the header ``name`` that is not empty, in a Gunicorn
 * request's headers, a list of (NAME, value) tuples of str: borrowed, None
 * if it has none; NULL, without an exception, for headers of another shape. */
static PyObject *header_of(PyObject *headers, PyObject *name)
{
    Py_ssize_t k;

    if (!PyList_CheckExact(headers))
        return NULL;
    for (k = 0; k < PyList_GET_SIZE(headers); k++) {
        PyObject *item = PyList_GET_ITEM(headers, k), *key;

        if (!PyTuple_CheckExact(item) || PyTuple_GET_SIZE(item) != 2)
            return NULL;
        key = PyTuple_GET_ITEM(item, 0);
        if (!PyUnicode_CheckExact(key))
            return NULL;
        if (kind_is(key, name)) {
            PyObject *value = PyTuple_GET_ITEM(item, 1);

            if (!PyUnicode_CheckExact(value))
                return NULL;
            if (PyUnicode_GET_LENGTH(value))
                return value;
        }
    }
    return Py_None;
}

/* pre_request(worker, req): the request's timer added, its handle kept as
 * req.shmwheel_timer; the Python pre_request takes what this does not:
 * what it cannot read, as slow(worker, req), and what it tried and gave
 * back, as slow(worker, req, declined=True), which takes the waiting path
 * (a keyword, so that Gunicorn still counts two arguments). */
static PyObject *Hooks_pre_request(HooksObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *timer, *fast = NULL, *req, *headers = NULL, *rid, *method = NULL, *path = NULL, *key = NULL, *call[3];
    TimerObject *t;
    int64_t now;
    int r;

    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "pre_request(worker, req)");
        return NULL;
    }
    req = args[1];
    if (!(timer = PyObject_GetAttr(self->state, str_timer_attr)))
        return NULL;
    if (timer == Py_None)
        return timer;
    if (!(fast = PyObject_GetAttr(timer, str_fast)))
        goto done;
    t = (TimerObject *)fast;
    if (!Py_IS_TYPE(fast, &TimerType) || t->pid != current_pid)
        goto slow;
    now = monotonic_ns();
    if ((r = ready(t, now)) <= 0) {
        if (r < 0)
            goto done;
        goto slow;
    }
    /* After ready(), which may run Python: what is read here stays as read. */
    if (!(headers = PyObject_GetAttr(req, str_headers)) || !(method = PyObject_GetAttr(req, str_method))
        || !(path = PyObject_GetAttr(req, str_path)))
        goto done;
    if (!(rid = header_of(headers, self->header)))
        goto slow;
    /* Held: start_request may run Python (greenlet's getcurrent), which may change the headers. */
    Py_INCREF(rid);
    key = declined(t, start_path(t, now, now, t->timeout_ns, method, path, rid, Py_None));
    Py_DECREF(rid);
    if (!key)
        goto done;
    if (key == Py_None) {
        /* Tried and given back: the Python hook's waiting path. */
        Py_CLEAR(key);
        call[0] = args[0];
        call[1] = req;
        call[2] = Py_True;
        key = PyObject_Vectorcall(self->slow, call, 2, declined_kwnames);
        goto done;
    }
    if (PyObject_SetAttr(req, str_req_key, key) < 0) {
        end_raising(timer, key);
        Py_CLEAR(key);
    }
    goto done;

slow:
    key = PyObject_Vectorcall(self->slow, args, 2, NULL);
done:
    Py_DECREF(timer);
    Py_XDECREF(fast);
    Py_XDECREF(headers);
    Py_XDECREF(method);
    Py_XDECREF(path);
    if (!key)
        return NULL;
    Py_DECREF(key);
    Py_RETURN_NONE;
}

/* post_request(worker, req, environ, resp): the timer of req.shmwheel_timer
 * cancelled, as RequestTimer.finish cancels it. */
static PyObject *Hooks_post_request(HooksObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *timer, *key;
    int r;

    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "post_request(worker, req, environ, resp)");
        return NULL;
    }
    if (!(timer = PyObject_GetAttr(self->state, str_timer_attr)))
        return NULL;
    if (timer == Py_None)
        return timer;
    if (!(key = attr_or_none(args[1], str_req_key))) {
        Py_DECREF(timer);
        return NULL;
    }
    r = end_request(timer, key);
    Py_DECREF(timer);
    Py_DECREF(key);
    if (r < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *Hooks_new(PyTypeObject *Py_UNUSED(type), PyObject *args, PyObject *kwds)
{
    PyObject *state, *slow, *header;
    static char *names[] = {"state", "slow", "header", NULL};

    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOU:Hooks", names, &state, &slow, &header))
        return NULL;
    if (!PyCallable_Check(slow)) {
        PyErr_SetString(PyExc_TypeError, "slow must be callable");
        return NULL;
    }
    if (!PyUnicode_IS_ASCII(header)) {
        PyErr_SetString(PyExc_ValueError, "header must be ASCII");
        return NULL;
    }
    return (PyObject *)Held_make(&HooksType, state, slow, header);
}

/* The signatures are Gunicorn's: it checks a hook's arity with inspect. */
static PyMethodDef Hooks_methods[] = {
    {"pre_request", (PyCFunction)(void (*)(void))Hooks_pre_request, METH_FASTCALL,
     "pre_request($self, worker, req, /)\n--\n\nAdd the request's timer."},
    {"post_request", (PyCFunction)(void (*)(void))Hooks_post_request, METH_FASTCALL,
     "post_request($self, worker, req, environ, resp, /)\n--\n\nCancel the request's timer."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject HooksType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "shmwheel._fast.Hooks",
    .tp_basicsize = sizeof(HooksObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "Hooks(state, slow, header): Gunicorn's pre_request and post_request for install().",
    .tp_new = Hooks_new,
    .tp_traverse = (traverseproc)Held_traverse,
    .tp_clear = (inquiry)Held_clear,
    .tp_dealloc = (destructor)Held_dealloc,
    .tp_methods = Hooks_methods,
};

/* ---- Body ----------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    PyObject *body;             /* the application's */
    PyObject *owner;            /* the RequestTimer */
    PyObject *key;              /* the request's handle; NULL once closed, None if it had no timer */
} BodyObject;

HELD_LAYOUT(BodyObject, body, owner, key);

static PyTypeObject BodyType;

static PyObject *Body_make(PyObject *body, PyObject *owner, PyObject *key)
{
    return (PyObject *)Held_make(&BodyType, body, owner, key);
}

static PyObject *Body_new(PyTypeObject *Py_UNUSED(type), PyObject *args, PyObject *kwds)
{
    PyObject *body, *owner, *key;
    static char *names[] = {"body", "timer", "handle", NULL};

    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOO:Body", names, &body, &owner, &key))
        return NULL;
    if (key != Py_None && !PyLong_CheckExact(key)) {
        PyErr_SetString(PyExc_TypeError, "handle must be an int or None");
        return NULL;
    }
    return Body_make(body, owner, key);
}

static PyObject *Body_iter(BodyObject *self)
{
    if (!self->body) {
        PyErr_SetString(PyExc_ValueError, "the body has been cleared");
        return NULL;
    }
    return PyObject_GetIter(self->body);
}

/* close(): the application's body's close(), if it has one, then the
 * request's timer finished, whatever the first did (PEP 3333: the server
 * calls close() once it is done with the body, however that went).  Once:
 * a second call closes the body again, if the server does, and ends
 * nothing. */
static PyObject *Body_close(BodyObject *self, PyObject *Py_UNUSED(ignored))
{
    PyObject *key = self->key, *body = self->body, *close = NULL, *r;
    int failed = 0;

    self->key = NULL;
    /* A list or a tuple, what most applications give, has no close(): not
     * looked up, which would make and drop an AttributeError. */
    if (body && !PyList_CheckExact(body) && !PyTuple_CheckExact(body)) {
        Py_INCREF(body);
        close = PyObject_GetAttr(body, str_close);
        Py_DECREF(body);
        if (!close) {
            if (PyErr_ExceptionMatches(PyExc_AttributeError))
                PyErr_Clear();
            else
                failed = 1;
        }
    }
    if (close) {
        r = PyObject_CallNoArgs(close);
        Py_DECREF(close);
        if (r)
            Py_DECREF(r);
        else
            failed = 1;
    }
    if (key) {
        if (failed)
            end_raising(self->owner, key);
        else if (end_request(self->owner, key) < 0)
            failed = 1;
        Py_DECREF(key);
    }
    if (failed)
        return NULL;
    Py_RETURN_NONE;
}

/* body(): close(), which the body is: see Body_get_close. */
static PyObject *Body_call(BodyObject *self, PyObject *args, PyObject *kwds)
{
    if (PyTuple_GET_SIZE(args) || (kwds && PyDict_GET_SIZE(kwds))) {
        PyErr_SetString(PyExc_TypeError, "close() takes no arguments");
        return NULL;
    }
    return Body_close(self, NULL);
}

/* body.close: the body itself, which a call closes.  A server looks close()
 * up for every request, uWSGI twice (PyObject_HasAttrString, then
 * PyObject_GetAttrString): a method would make a bound method object each
 * time, two allocations and two trips through the collector's bookkeeping
 * a request, where this makes none. */
static PyObject *Body_get_close(BodyObject *self, void *Py_UNUSED(closure))
{
    return Py_NewRef(self);
}

static PyGetSetDef Body_getset[] = {
    {"close", (getter)Body_get_close, NULL,
     "close(): close the application's body, then end the request's timer (the body itself, called).", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject BodyType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "shmwheel._fast.Body",
    .tp_basicsize = sizeof(BodyObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "Body(body, timer, handle): a WSGI body whose close() ends the request's timer (body.close is the "
              "body, called).",
    .tp_new = Body_new,
    .tp_traverse = (traverseproc)Held_traverse,
    .tp_clear = (inquiry)Held_clear,
    .tp_dealloc = (destructor)Held_dealloc,
    .tp_iter = (getiterfunc)Body_iter,
    .tp_call = (ternaryfunc)Body_call,
    .tp_getset = Body_getset,
};

/* ---- ASGI, Send and Then --------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    PyObject *send;             /* the server's */
    PyObject *owner;            /* the RequestTimer */
    PyObject *key;              /* the request's handle; NULL once its timer has ended */
    vectorcallfunc vectorcall;  /* Send_vectorcall: a call without a tuple of its arguments */
} SendObject;

HELD_LAYOUT(SendObject, send, owner, key);

typedef struct {
    PyObject_HEAD
    PyObject   *inner;          /* the iterator of the awaitable it stands for */
    SendObject *send;           /* whose timer ends once that has returned; NULL: none */
    int         whole;          /* the application's call: its timer ends however it ends */
    int         stepped;        /* sent into, thrown into or closed once */
    PyObject   *name;           /* its __qualname__: the function's, for a Coroutine's call; NULL: "Then" */
    /* A Coroutine's call, to start at the first step (see Then_start);
     * NULL once started, or for a Then made started. */
    PyObject   *call[4];        /* the middleware, scope, receive and send */
    PyObject   *func;           /* the coroutine function of the middleware's own path */
    PyObject   *asgi;           /* the middleware's ASGI */
} ThenObject;

static PyTypeObject SendType, ThenType, ASGIType;
typedef struct ASGIObject ASGIObject;
static int asgi_call(ASGIObject *self, PyObject *const *args, PyObject **inner, PyObject **send);

/* End the request's timer, once. */
static int Send_end(SendObject *self)
{
    PyObject *key = self->key;
    int r;

    if (!key)
        return 0;
    self->key = NULL;
    r = end_request(self->owner, key);
    Py_DECREF(key);
    return r;
}

/* Send_end() while an exception is being raised, as end_raising(). */
static void Send_end_raising(SendObject *self)
{
    PyObject *key = self->key;

    if (!key)
        return;
    self->key = NULL;
    end_raising(self->owner, key);
    Py_DECREF(key);
}

/* Whether ``message`` is the last of a response (or closes a websocket):
 * asgi._completes.  -1 with an exception. */
static int completes(PyObject *message)
{
    PyObject *kind, *more;
    int r, body;

    if (PyDict_CheckExact(message)) {
        if (!(kind = PyDict_GetItemWithError(message, str_type))) {
            if (!PyErr_Occurred())
                PyErr_SetObject(PyExc_KeyError, str_type);
            return -1;
        }
        Py_INCREF(kind);
    } else if (!(kind = PyObject_GetItem(message, str_type))) {
        return -1;
    }
    if (!PyUnicode_Check(kind) || PyUnicode_READY(kind) < 0) {
        Py_DECREF(kind);
        return PyErr_Occurred() ? -1 : 0;
    }
    body = kind_is(kind, str_body_type) || kind_is(kind, str_zerocopy_type);
    r = !body && (kind_is(kind, str_pathsend_type) || kind_is(kind, str_ws_close));
    Py_DECREF(kind);
    if (!body)
        return r;
    if (PyDict_CheckExact(message)) {
        if (!(more = PyDict_GetItemWithError(message, str_more_body)))
            return PyErr_Occurred() ? -1 : 1;
        return (r = PyObject_IsTrue(more)) < 0 ? -1 : !r;
    }
    if (!(more = PyObject_CallMethod(message, "get", "OO", str_more_body, Py_False)))
        return -1;
    r = PyObject_IsTrue(more);
    Py_DECREF(more);
    return r < 0 ? -1 : !r;
}

/* Whether the generator ``gen`` is a coroutine made with types.coroutine;
 * -1 with an exception. */
static int iterable_coroutine(PyObject *gen)
{
    PyObject *code = PyObject_GetAttrString(gen, "gi_code");
    int r;

    if (!code)
        return -1;
    r = PyCode_Check(code) && (((PyCodeObject *)code)->co_flags & CO_ITERABLE_COROUTINE);
    Py_DECREF(code);
    return r;
}

/* The iterator that ``await`` takes from ``awaitable`` (whose reference
 * it takes), as ``await`` checks it: a coroutine, a generator made a
 * coroutine (types.coroutine), or what __await__ gives back, an iterator
 * and no coroutine.  NULL with an exception. */
static PyObject *await_iter(PyObject *awaitable, const char *what)
{
    PyObject *inner;
    int r;

    if (PyCoro_CheckExact(awaitable))
        return awaitable;
    if (PyGen_CheckExact(awaitable)) {
        if ((r = iterable_coroutine(awaitable)) != 0) {
            if (r < 0) {
                Py_DECREF(awaitable);
                return NULL;
            }
            return awaitable;
        }
    } else if (Py_TYPE(awaitable)->tp_as_async && Py_TYPE(awaitable)->tp_as_async->am_await) {
        inner = Py_TYPE(awaitable)->tp_as_async->am_await(awaitable);
        Py_DECREF(awaitable);
        if (!inner)
            return NULL;
        if (PyCoro_CheckExact(inner) || (PyGen_CheckExact(inner) && (r = iterable_coroutine(inner)) != 0)) {
            if (!PyErr_Occurred())
                PyErr_Format(PyExc_TypeError, "__await__() of what %s gave back returned a coroutine", what);
            Py_DECREF(inner);
            return NULL;
        }
        if (!PyIter_Check(inner)) {
            PyErr_Format(PyExc_TypeError, "__await__() of what %s gave back returned %.100s, not an iterator",
                         what, Py_TYPE(inner)->tp_name);
            Py_DECREF(inner);
            return NULL;
        }
        return inner;
    }
    PyErr_Format(PyExc_TypeError, "%s gave back %.100s, which cannot be awaited", what, Py_TYPE(awaitable)->tp_name);
    Py_DECREF(awaitable);
    return NULL;
}

/* A Then with every field empty, not yet tracked by the GC. */
static ThenObject *Then_alloc(void)
{
    ThenObject *then = PyObject_GC_New(ThenObject, &ThenType);

    if (then)
        memset((char *)then + sizeof(PyObject), 0, sizeof *then - sizeof(PyObject));
    return then;
}

/* A Then of ``inner`` (whose reference it takes) that ends ``send``'s timer. */
static PyObject *Then_make(PyObject *inner, SendObject *send, int whole)
{
    ThenObject *then = Then_alloc();

    if (!then) {
        Py_DECREF(inner);
        return NULL;
    }
    then->inner = inner;
    then->send = (SendObject *)Py_NewRef(send);
    then->whole = whole;
    PyObject_GC_Track(then);
    return (PyObject *)then;
}

/* A Then of a call of ``func`` (a TimeoutMiddleware.__call__) with
 * ``args`` (the middleware, scope, receive and send) that starts when it is
 * first awaited, as the coroutine of a call starts: through ``asgi`` (the
 * middleware's ASGI), or where that declines, through ``func``. */
static PyObject *Then_pending(PyObject *func, PyObject *asgi, PyObject *const *args)
{
    ThenObject *then = Then_alloc();
    int k;

    if (!then)
        return NULL;
    then->name = Py_NewRef(((PyFunctionObject *)func)->func_qualname);
    for (k = 0; k < 4; k++)
        then->call[k] = Py_NewRef(args[k]);
    then->func = Py_NewRef(func);
    then->asgi = Py_NewRef(asgi);
    PyObject_GC_Track(then);
    return (PyObject *)then;
}

/* Drop a call that has not started; whether there was one. */
static int Then_drop_call(ThenObject *self)
{
    int k;

    if (!self->call[0])
        return 0;
    for (k = 0; k < 4; k++)
        Py_CLEAR(self->call[k]);
    Py_CLEAR(self->func);
    Py_CLEAR(self->asgi);
    return 1;
}

/* The first step of a pending call: the request started and the
 * application called (asgi_call), or the coroutine of the middleware's own
 * path, which is then what this awaits (and ends no timer of its own).
 * Here, not at the call, so that the task that runs the request is the one
 * that awaits it (asyncio.run(app(...)), asyncio.wait_for(app(...)) and
 * create_task(app(...)) call it outside that task).  0, or -1 with an
 * exception, as a coroutine's first line raises it. */
static int Then_start(ThenObject *self)
{
    PyObject *call[4], *func = self->func, *asgi = self->asgi, *inner = NULL, *send = NULL, *coro;
    int k, r;

    for (k = 0; k < 4; k++) {
        call[k] = self->call[k];
        self->call[k] = NULL;
    }
    self->func = self->asgi = NULL;
    r = asgi_call((ASGIObject *)asgi, call + 1, &inner, &send);
    if (r == 0) {
        coro = PyObject_Vectorcall(func, call, 4, NULL);
        r = coro && (inner = await_iter(coro, "TimeoutMiddleware.__call__")) ? 0 : -1;
    } else if (r == 2) {
        /* Tried and given back: the middleware's waiting path, _call(scope, receive, send, True). */
        coro = PyObject_CallMethodObjArgs(call[0], str_call, call[1], call[2], call[3], Py_True, NULL);
        r = coro && (inner = await_iter(coro, "TimeoutMiddleware._call")) ? 0 : -1;
    } else if (r > 0) {
        self->whole = 1;
        r = 0;
    }
    for (k = 0; k < 4; k++)
        Py_DECREF(call[k]);
    Py_DECREF(func);
    Py_DECREF(asgi);
    self->inner = inner;
    self->send = (SendObject *)send;
    return r;
}

static PyObject *Send_vectorcall(SendObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames);

static PyObject *Send_make(PyObject *send, PyObject *owner, PyObject *key)
{
    SendObject *self = (SendObject *)Held_make(&SendType, send, owner, key == Py_None ? NULL : key);

    if (self)
        self->vectorcall = (vectorcallfunc)Send_vectorcall;
    return (PyObject *)self;
}

/* send(message): the server's send's awaitable; for the message that
 * completes the response, in a Then. */
static PyObject *Send_vectorcall(SendObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    PyObject *awaitable, *inner;
    int last;

    if (PyVectorcall_NARGS(nargsf) != 1 || kwnames) {
        PyErr_SetString(PyExc_TypeError, "send(message)");
        return NULL;
    }
    if (!self->send) {
        PyErr_SetString(PyExc_ValueError, "the send has been cleared");
        return NULL;
    }
    if (!self->key)             /* no timer, or it has ended */
        return PyObject_CallOneArg(self->send, args[0]);
    if ((last = completes(args[0])) < 0)
        return NULL;
    if (!(awaitable = PyObject_CallOneArg(self->send, args[0])) || !last)
        return awaitable;
    if (!(inner = await_iter(awaitable, "send()")))
        return NULL;
    return Then_make(inner, self, 0);
}

static PyTypeObject SendType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "shmwheel._fast.Send",
    .tp_basicsize = sizeof(SendObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "An ASGI request's send, which ends its timer once its response is sent.",
    .tp_traverse = (traverseproc)Held_traverse,
    .tp_clear = (inquiry)Held_clear,
    .tp_dealloc = (destructor)Held_dealloc,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(SendObject, vectorcall),
};

static int Then_traverse(ThenObject *self, visitproc visit, void *arg)
{
    int k;

    Py_VISIT(self->inner);
    Py_VISIT(self->send);
    for (k = 0; k < 4; k++)
        Py_VISIT(self->call[k]);
    Py_VISIT(self->func);
    Py_VISIT(self->asgi);
    Py_VISIT(self->name);
    return 0;
}

static int Then_clear(ThenObject *self)
{
    Py_CLEAR(self->inner);
    Py_CLEAR(self->send);
    Py_CLEAR(self->name);
    Then_drop_call(self);
    return 0;
}

/* A Then of the application's call dropped before its end (a coroutine's
 * ``finally`` runs when it is collected): its timer ends now, as the
 * middleware's own way ends it. */
static void Then_finalize(ThenObject *self)
{
    PyObject *t, *v, *tb;

    if (self->call[0]) {
        /* A call never awaited: as Python warns of a coroutine's. */
        PyErr_Fetch(&t, &v, &tb);
        if (PyErr_WarnFormat(PyExc_RuntimeWarning, 1, "coroutine '%S' was never awaited", self->name) < 0)
            PyErr_WriteUnraisable((PyObject *)self);
        PyErr_Restore(t, v, tb);
        return;
    }
    if (!self->whole || !self->send || !self->send->key)
        return;
    PyErr_Fetch(&t, &v, &tb);
    if (Send_end(self->send) < 0)
        PyErr_WriteUnraisable((PyObject *)self);
    PyErr_Restore(t, v, tb);
}

static void Then_dealloc(ThenObject *self)
{
    if (PyObject_CallFinalizerFromDealloc((PyObject *)self) < 0)
        return;                 /* brought back to life by its finalizer */
    PyObject_GC_UnTrack(self);
    Then_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* The inner awaitable has returned ``*result``: the timer ends. */
static PySendResult Then_returned(ThenObject *self, PyObject **result)
{
    if (self->whole)
        Py_SETREF(*result, Py_NewRef(Py_None));    /* the middleware's call gives back None */
    if (self->send && Send_end(self->send) < 0) {
        Py_CLEAR(*result);
        return PYGEN_ERROR;
    }
    return PYGEN_RETURN;
}

/* Whether the inner awaitable has ended, after an error from it: a
 * coroutine or generator is not if the error came before it ran (already
 * running, a value sent to one just started, bad arguments to throw());
 * of any other kind, an error is taken for its end. */
static int inner_ended(PyObject *inner)
{
    PyObject *t, *v, *tb, *frame;
    int ended = 1;

    if (!PyCoro_CheckExact(inner) && !PyGen_CheckExact(inner))
        return 1;
    PyErr_Fetch(&t, &v, &tb);
    if ((frame = PyObject_GetAttrString(inner, PyCoro_CheckExact(inner) ? "cr_frame" : "gi_frame"))) {
        ended = frame == Py_None;
        Py_DECREF(frame);
    }
    PyErr_Restore(t, v, tb);
    return ended;
}

/* The inner awaitable has raised: the application's call, if that ended
 * it, ends its timer. */
static void Then_raised(ThenObject *self)
{
    if (self->whole && inner_ended(self->inner))
        Send_end_raising(self->send);
}

static PySendResult Then_am_send(ThenObject *self, PyObject *arg, PyObject **result)
{
    PySendResult r;

    self->stepped = 1;
    if (self->call[0]) {
        if (arg != Py_None) {
            PyErr_SetString(PyExc_TypeError, "can't send non-None value to a just-started coroutine");
            *result = NULL;
            return PYGEN_ERROR;
        }
        if (Then_start(self) < 0) {
            *result = NULL;
            return PYGEN_ERROR;
        }
    }
    if (!self->inner) {
        PyErr_SetString(PyExc_RuntimeError, "this awaitable has been cleared");
        *result = NULL;
        return PYGEN_ERROR;
    }
    r = PyIter_Send(self->inner, arg, result);
    if (r == PYGEN_RETURN)
        return Then_returned(self, result);
    if (r == PYGEN_ERROR)
        Then_raised(self);
    return r;
}

/* What a generator's send() does with a return: StopIteration(value). */
static PyObject *stop_with(PyObject *value)
{
    PyObject *e;

    if (value == Py_None) {
        Py_DECREF(value);
        PyErr_SetNone(PyExc_StopIteration);
        return NULL;
    }
    e = PyObject_CallOneArg(PyExc_StopIteration, value);
    Py_DECREF(value);
    if (e) {
        PyErr_SetObject(PyExc_StopIteration, e);
        Py_DECREF(e);
    }
    return NULL;
}

static PyObject *Then_iternext(ThenObject *self)
{
    PyObject *result;
    PySendResult r = Then_am_send(self, Py_None, &result);

    if (r == PYGEN_NEXT)
        return result;
    if (r == PYGEN_RETURN) {
        if (result == Py_None) {    /* exhausted: no StopIteration to make */
            Py_DECREF(result);
            return NULL;
        }
        return stop_with(result);
    }
    return NULL;
}

static PyObject *Then_send(ThenObject *self, PyObject *arg)
{
    PyObject *result;
    PySendResult r = Then_am_send(self, arg, &result);

    if (r == PYGEN_NEXT)
        return result;
    return r == PYGEN_RETURN ? stop_with(result) : NULL;
}

/* throw(...): into the inner awaitable (a cancellation, say); a return or
 * a raise there ends the timer as one from send() does. */
/* Raise what throw() was given (the exception, or its type and value). */
static void raise_thrown(PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs < 1) {
        PyErr_SetString(PyExc_TypeError, "throw expected at least 1 argument, got 0");
    } else if (PyExceptionInstance_Check(args[0])) {
        PyErr_SetObject((PyObject *)Py_TYPE(args[0]), args[0]);
    } else if (PyExceptionClass_Check(args[0])) {
        if (nargs > 1 && args[1] != Py_None)
            PyErr_SetObject(args[0], args[1]);
        else
            PyErr_SetNone(args[0]);
    } else {
        PyErr_SetString(PyExc_TypeError, "exceptions must derive from BaseException");
    }
}

static PyObject *Then_throw(ThenObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *meth, *result, *value;

    self->stepped = 1;
    if (self->call[0]) {
        /* Into a call not started: raised from it, which ends it, as from
         * a coroutine that has not run its first line (which bad arguments
         * leave as it was). */
        if (nargs >= 1 && (PyExceptionInstance_Check(args[0]) || PyExceptionClass_Check(args[0])))
            Then_drop_call(self);
        raise_thrown(args, nargs);
        return NULL;
    }
    if (!self->inner) {
        PyErr_SetString(PyExc_RuntimeError, "this awaitable has been cleared");
        return NULL;
    }
    if (!(meth = PyObject_GetAttrString(self->inner, "throw"))) {
        /* An iterator without throw(): the exception is raised at the
         * await, as a coroutine awaiting it would have it. */
        if (!PyErr_ExceptionMatches(PyExc_AttributeError) || nargs < 1) {
            Then_raised(self);
            return NULL;
        }
        PyErr_Clear();
        raise_thrown(args, nargs);
        Then_raised(self);
        return NULL;
    }
    result = PyObject_Vectorcall(meth, args, (size_t)nargs, NULL);
    Py_DECREF(meth);
    if (result)
        return result;
    if (!PyErr_ExceptionMatches(PyExc_StopIteration)) {
        Then_raised(self);
        return NULL;
    }
    {
        PyObject *t, *v, *tb;

        PyErr_Fetch(&t, &v, &tb);
        PyErr_NormalizeException(&t, &v, &tb);
        value = v ? PyObject_GetAttrString(v, "value") : Py_NewRef(Py_None);
        Py_XDECREF(t);
        Py_XDECREF(v);
        Py_XDECREF(tb);
        if (!value)
            return NULL;
    }
    if (Then_returned(self, &value) == PYGEN_ERROR)
        return NULL;
    return stop_with(value);
}

/* close(): the inner awaitable closed (the task that awaits it is being
 * dropped); the application's call ends its timer then too. */
static PyObject *Then_close(ThenObject *self, PyObject *Py_UNUSED(ignored))
{
    PyObject *meth, *key, *exit, *r = NULL;
    int failed;

    if (Then_drop_call(self) || !self->inner)
        Py_RETURN_NONE;         /* a call not started ends with nothing to run */
    if (!(meth = PyObject_GetAttrString(self->inner, "close"))) {
        if (PyErr_ExceptionMatches(PyExc_AttributeError)) {
            PyErr_Clear();
            r = Py_NewRef(Py_None);
        }
    } else {
        r = PyObject_CallNoArgs(meth);
        Py_DECREF(meth);
    }
    if (!self->whole)
        return r;
    if (!r) {
        Send_end_raising(self->send);
        return NULL;
    }
    if ((key = self->send->key)) {
        /* As in a closed coroutine's ``finally``, a GeneratorExit is
         * being handled while the timer ends. */
        self->send->key = NULL;
        if (!(exit = PyObject_CallNoArgs(PyExc_GeneratorExit))) {
            end_raising(self->send->owner, key);
            failed = 1;
        } else {
            failed = end_handling(exit, self->send->owner, key) < 0;
            Py_DECREF(exit);
        }
        Py_DECREF(key);
        if (failed)
            Py_CLEAR(r);
    }
    return r;
}

/* await: itself; as a coroutine, refused while another await holds it
 * suspended (two awaiters would resume the application in turn). */
static PyObject *Then_await(ThenObject *self)
{
    PyObject *at;
    int busy;

    if (self->stepped && self->inner && PyCoro_CheckExact(self->inner)) {
        if (!(at = PyObject_GetAttrString(self->inner, "cr_await")))
            return NULL;
        busy = at != Py_None;
        Py_DECREF(at);
        if (busy) {
            PyErr_SetString(PyExc_RuntimeError, "coroutine is being awaited already");
            return NULL;
        }
    }
    return Py_NewRef(self);
}

/* A coroutine's attribute of the awaitable it stands for, or ``otherwise``
 * (before the start, after a clear, for an iterator without it). */
static PyObject *inner_attr(ThenObject *self, const char *name, PyObject *otherwise)
{
    PyObject *r;

    if (!self->inner)
        return Py_NewRef(otherwise);
    if ((r = PyObject_GetAttrString(self->inner, name)) || !PyErr_ExceptionMatches(PyExc_AttributeError))
        return r;
    PyErr_Clear();
    return Py_NewRef(otherwise);
}

/* cr_running, cr_suspended and cr_frame, which inspect.getcoroutinestate()
 * and asyncio's task repr read of a task's coroutine: the application's. */
static PyObject *Then_get_cr_running(ThenObject *self, void *Py_UNUSED(closure))
{
    return inner_attr(self, "cr_running", Py_False);
}

static PyObject *Then_get_cr_suspended(ThenObject *self, void *Py_UNUSED(closure))
{
    return inner_attr(self, "cr_suspended", Py_False);
}

static PyObject *Then_get_cr_frame(ThenObject *self, void *Py_UNUSED(closure))
{
    return inner_attr(self, "cr_frame", Py_None);
}

static PyObject *Then_get_name(ThenObject *self, void *Py_UNUSED(closure))
{
    return self->name ? Py_NewRef(self->name) : PyUnicode_FromString("Then");
}

/* What it awaits, as a coroutine's cr_await: a timed-out request's stack
 * (_stacks._await_chain) goes down through it to the application's. */
static PyObject *Then_get_cr_await(ThenObject *self, void *Py_UNUSED(closure))
{
    return Py_NewRef(self->inner ? self->inner : Py_None);
}

static PyGetSetDef Then_getset[] = {
    {"cr_await", (getter)Then_get_cr_await, NULL, "The awaitable it stands for.", NULL},
    {"cr_running", (getter)Then_get_cr_running, NULL, "Whether the awaitable it stands for runs.", NULL},
    {"cr_suspended", (getter)Then_get_cr_suspended, NULL, "Whether that is suspended (CPython 3.12 on).", NULL},
    {"cr_frame", (getter)Then_get_cr_frame, NULL, "That's frame: this has none of its own.", NULL},
    {"__name__", (getter)Then_get_name, NULL, NULL, NULL},
    {"__qualname__", (getter)Then_get_name, NULL, NULL, NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMethodDef Then_methods[] = {
    {"send", (PyCFunction)Then_send, METH_O, "send(value): into the awaitable."},
    {"throw", (PyCFunction)(void (*)(void))Then_throw, METH_FASTCALL, "throw(...): into the awaitable."},
    {"close", (PyCFunction)Then_close, METH_NOARGS, "Close the awaitable."},
    {NULL, NULL, 0, NULL},
};

static PyAsyncMethods Then_async = {
    .am_await = (unaryfunc)Then_await,
    .am_send = (sendfunc)Then_am_send,
};

static PyTypeObject ThenType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "shmwheel._fast.Then",
    .tp_basicsize = sizeof(ThenObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "An awaitable that ends a request's timer after another: the server's send of the response's "
              "last message, or the application's whole call.",
    .tp_traverse = (traverseproc)Then_traverse,
    .tp_clear = (inquiry)Then_clear,
    .tp_dealloc = (destructor)Then_dealloc,
    .tp_as_async = &Then_async,
    .tp_iter = PyObject_SelfIter,
    .tp_iternext = (iternextfunc)Then_iternext,
    .tp_methods = Then_methods,
    .tp_getset = Then_getset,
    .tp_finalize = (destructor)Then_finalize,
};

/* A plain ASGI TimeoutMiddleware's call in C: ASGI(middleware)(scope,
 * receive, send) starts an HTTP request's timer (asgi_start) and calls the
 * application with the timed scope and a Send, and gives back its
 * awaitable in a Then, which ends the timer when the application returns,
 * raises or is closed, if the last message has not ended it before.  None,
 * having started nothing, for what the middleware's own path takes: any
 * other scope, one timed already, a process without its Timer yet. */
struct ASGIObject {
    PyObject_HEAD
    PyObject *middleware;       /* the TimeoutMiddleware, whose app is read at each call */
    PyObject *timer;            /* its _timer as last read in this process; NULL: to read */
    PyObject *unheld;           /* the HeldObject's third: NULL */
    vectorcallfunc vectorcall;
    pid_t timer_pid;            /* the process that read it */
};

HELD_LAYOUT(ASGIObject, middleware, timer, unheld);

/* The call of ASGI(middleware) with ``args`` (scope, receive, send): 1
 * with ``*inner``, the application's call as await takes it, and
 * ``*send``, the Send whose request's timer it started; 0, having started
 * nothing, for what the middleware's own path takes; 2, having started
 * nothing, for a request it tried and gave back, which the middleware's
 * waiting path takes; -1 with an exception. */
static int asgi_call(ASGIObject *self, PyObject *const *args, PyObject **inner, PyObject **send)
{
    PyObject *scope, *kind, *timer, *fast, *key, *app, *call[3], *coro;
    PyObject *timed_scope = NULL, *timed_send = NULL;
    unsigned long long declines = 0;
    int r;

    if (!self->middleware) {
        PyErr_SetString(PyExc_ValueError, "the application has been cleared");
        return -1;
    }
    scope = args[0];
    if (!PyDict_CheckExact(scope))
        return 0;
    if (!(kind = PyDict_GetItemWithError(scope, str_type)))
        return PyErr_Occurred() ? -1 : 0;
    if (kind != str_http && (!PyUnicode_CheckExact(kind) || PyUnicode_Compare(kind, str_http) != 0))
        return 0;               /* lifespan, a websocket, ...: two str compare without an error */
    if ((r = PyDict_Contains(scope, str_environ_key)) != 0)
        return r < 0 ? -1 : 0;
    /* The middleware's RequestTimer, read once in a process: it changes
     * only when the middleware makes one for a new process, which the
     * Python path does, after the C path has declined a request. */
    if (!self->timer || self->timer_pid != current_pid) {
        if (!(timer = PyObject_GetAttr(self->middleware, str_timer)))
            return -1;
        if (timer == Py_None) {
            Py_DECREF(timer);
            return 0;
        }
        Py_XSETREF(self->timer, timer);
        self->timer_pid = current_pid;
    }
    if (!(fast = PyObject_GetAttr(self->timer, str_fast)))
        return -1;
    if (Py_IS_TYPE(fast, &TimerType)) {
        declines = ((TimerObject *)fast)->declined;
        key = asgi_start((TimerObject *)fast, scope, args[2], &timed_scope, &timed_send);
        declines = ((TimerObject *)fast)->declined - declines;
    } else {
        key = Py_NewRef(Py_None);
    }
    Py_DECREF(fast);
    if (!key)
        return -1;
    if (key == Py_None) {
        Py_DECREF(key);
        Py_CLEAR(self->timer);  /* read again after the Python path, which may make another */
        return declines ? 2 : 0;
    }
    Py_DECREF(key);             /* the Send holds it */
    *inner = NULL;
    if ((app = PyObject_GetAttr(self->middleware, str_app))) {
        call[0] = timed_scope;
        call[1] = args[1];
        call[2] = timed_send;
        coro = PyObject_Vectorcall(app, call, 3, NULL);
        Py_DECREF(app);
        if (coro)
            *inner = await_iter(coro, "the application");
    }
    Py_DECREF(timed_scope);
    if (!*inner) {
        Send_end_raising((SendObject *)timed_send);
        Py_DECREF(timed_send);
        return -1;
    }
    *send = timed_send;
    return 1;
}

static PyObject *ASGI_vectorcall(ASGIObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    PyObject *inner, *send, *then;
    int r;

    if (PyVectorcall_NARGS(nargsf) != 3 || kwnames) {
        PyErr_SetString(PyExc_TypeError, "asgi(scope, receive, send)");
        return NULL;
    }
    if ((r = asgi_call(self, args, &inner, &send)) != 1)
        return r < 0 ? NULL : Py_NewRef(Py_None);
    then = Then_make(inner, (SendObject *)send, 1);
    if (!then)
        Send_end_raising((SendObject *)send);
    Py_DECREF(send);
    return then;
}

static PyObject *ASGI_new(PyTypeObject *Py_UNUSED(type), PyObject *args, PyObject *kwds)
{
    PyObject *middleware;
    ASGIObject *self;
    static char *names[] = {"middleware", NULL};

    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O:ASGI", names, &middleware))
        return NULL;
    if ((self = (ASGIObject *)Held_make(&ASGIType, middleware, NULL, NULL)))
        self->vectorcall = (vectorcallfunc)ASGI_vectorcall;
    return (PyObject *)self;
}

static PyTypeObject ASGIType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "shmwheel._fast.ASGI",
    .tp_basicsize = sizeof(ASGIObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "ASGI(middleware): a plain TimeoutMiddleware's HTTP request started in C: (scope, receive, send) "
              "gives an awaitable of the application's call, or None for the middleware's own path.",
    .tp_new = ASGI_new,
    .tp_traverse = (traverseproc)Held_traverse,
    .tp_clear = (inquiry)Held_clear,
    .tp_dealloc = (destructor)Held_dealloc,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(ASGIObject, vectorcall),
};

/* TimeoutMiddleware.__call__ itself, around the Python coroutine function
 * it stands for: Coroutine(func)(middleware, scope, receive, send) gives
 * back, for a middleware with an ASGI (its ``_in_c``), a Then that starts
 * at its first step through that ASGI, or through ``func`` where the ASGI
 * declines (Then_start); else the coroutine of ``func``.  The middleware's
 * call then has no coroutine of its own, which costs an ASGI request
 * about 100 ns.  Servers and frameworks tell an ASGI 3 application by its
 * ``__call__`` being a coroutine function (inspect.iscoroutinefunction,
 * asyncio's); inspect takes an object that has a function's attributes
 * (__code__, __name__, __defaults__, __kwdefaults__, __annotations__) for
 * one, so every attribute that the object does not have is ``func``'s,
 * its __code__ with CO_COROUTINE among them, as a Cython coroutine
 * function has them.  A descriptor as a function is: bound to an instance
 * it is a method; a type's call slot calls it with the instance first. */
typedef struct {
    PyObject_HEAD
    PyObject *func;             /* the Python coroutine function */
    vectorcallfunc vectorcall;
} CoroutineObject;

static PyTypeObject CoroutineType;

static PyObject *Coroutine_vectorcall(CoroutineObject *self, PyObject *const *args, size_t nargsf,
                                      PyObject *kwnames)
{
    PyObject *in_c, *r;

    if (!self->func) {
        PyErr_SetString(PyExc_ValueError, "the coroutine function has been cleared");
        return NULL;
    }
    if (PyVectorcall_NARGS(nargsf) == 4 && !kwnames) {
        if (!(in_c = PyObject_GetAttr(args[0], str_in_c))) {
            if (!PyErr_ExceptionMatches(PyExc_AttributeError))
                return NULL;
            PyErr_Clear();      /* a subclass's instance without one: the method's own way */
        } else if (Py_IS_TYPE(in_c, &ASGIType)) {
            r = Then_pending(self->func, in_c, args);
            Py_DECREF(in_c);
            return r;
        } else {
            Py_DECREF(in_c);
        }
    }
    return PyObject_Vectorcall(self->func, args, nargsf, kwnames);
}

static PyObject *Coroutine_new(PyTypeObject *Py_UNUSED(type), PyObject *args, PyObject *kwds)
{
    PyObject *func;
    CoroutineObject *self;
    static char *names[] = {"func", NULL};

    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O:Coroutine", names, &func))
        return NULL;
    if (!PyFunction_Check(func) || !(((PyCodeObject *)PyFunction_GET_CODE(func))->co_flags & CO_COROUTINE)) {
        PyErr_Format(PyExc_TypeError, "Coroutine(func): func must be an async def function, not %.100s",
                     Py_TYPE(func)->tp_name);
        return NULL;
    }
    if (!(self = PyObject_GC_New(CoroutineObject, &CoroutineType)))
        return NULL;
    self->func = Py_NewRef(func);
    self->vectorcall = (vectorcallfunc)Coroutine_vectorcall;
    PyObject_GC_Track(self);
    return (PyObject *)self;
}

static int Coroutine_traverse(CoroutineObject *self, visitproc visit, void *arg)
{
    Py_VISIT(self->func);
    return 0;
}

static int Coroutine_clear(CoroutineObject *self)
{
    Py_CLEAR(self->func);
    return 0;
}

static void Coroutine_dealloc(CoroutineObject *self)
{
    PyObject_GC_UnTrack(self);
    Coroutine_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* Its own attributes, else the function's: __code__, __name__, __doc__... */
static PyObject *Coroutine_getattro(CoroutineObject *self, PyObject *name)
{
    PyObject *r = PyObject_GenericGetAttr((PyObject *)self, name);

    if (r || !self->func || !PyErr_ExceptionMatches(PyExc_AttributeError))
        return r;
    PyErr_Clear();
    return PyObject_GetAttr(self->func, name);
}

static PyObject *Coroutine_get(CoroutineObject *self, PyObject *obj, PyObject *Py_UNUSED(type))
{
    if (obj == NULL || obj == Py_None)
        return Py_NewRef(self);
    return PyMethod_New((PyObject *)self, obj);
}

static PyObject *Coroutine_get_wrapped(CoroutineObject *self, void *Py_UNUSED(closure))
{
    return Py_NewRef(self->func ? self->func : Py_None);
}

static PyObject *Coroutine_get_doc(CoroutineObject *self, void *Py_UNUSED(closure))
{
    return self->func ? PyObject_GetAttrString(self->func, "__doc__") : Py_NewRef(Py_None);
}

static PyGetSetDef Coroutine_getset[] = {
    {"__wrapped__", (getter)Coroutine_get_wrapped, NULL, "The coroutine function it stands for.", NULL},
    {"__doc__", (getter)Coroutine_get_doc, NULL, NULL, NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject CoroutineType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "shmwheel._fast.Coroutine",
    .tp_basicsize = sizeof(CoroutineObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL | Py_TPFLAGS_METHOD_DESCRIPTOR,
    .tp_doc = "Coroutine(func): TimeoutMiddleware.__call__, which takes a plain HTTP request in C and gives "
              "the rest to func, an async def function whose attributes it has.",
    .tp_new = Coroutine_new,
    .tp_traverse = (traverseproc)Coroutine_traverse,
    .tp_clear = (inquiry)Coroutine_clear,
    .tp_dealloc = (destructor)Coroutine_dealloc,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(CoroutineObject, vectorcall),
    .tp_getattro = (getattrofunc)Coroutine_getattro,
    .tp_descr_get = (descrgetfunc)Coroutine_get,
    .tp_getset = Coroutine_getset,
};

/* ---- the module ----------------------------------------------------------- */

/* here(): (RequestTimer, handle) of the request this thread's slot holds,
 * or None. */
static PyObject *fast_here(PyObject *Py_UNUSED(m), PyObject *Py_UNUSED(ignored))
{
    if (!here.owner)
        Py_RETURN_NONE;
    return Py_BuildValue("(OL)", here.owner, (long long)here.key);
}

/* enter(timer, handle) and leave(timer, handle): RequestTimer's own path
 * filing a request in this thread's slot, and taking it out. */
static PyObject *fast_slot(PyObject *const *args, Py_ssize_t nargs, const char *usage, int enter)
{
    int64_t key;
    int r;

    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, usage);
        return NULL;
    }
    if ((r = key_of(args[1], &key)) <= 0) {
        if (!r)
            PyErr_SetString(PyExc_TypeError, "a handle is an int of 64 bits");
        return NULL;
    }
    if (enter)
        here_enter(args[0], key);
    else
        here_leave(args[0], key);
    Py_RETURN_NONE;
}

static PyObject *fast_enter(PyObject *Py_UNUSED(m), PyObject *const *args, Py_ssize_t nargs)
{
    return fast_slot(args, nargs, "enter(timer, handle)", 1);
}

static PyObject *fast_leave(PyObject *Py_UNUSED(m), PyObject *const *args, Py_ssize_t nargs)
{
    return fast_slot(args, nargs, "leave(timer, handle)", 0);
}

static PyMethodDef fast_functions[] = {
    {"here", (PyCFunction)fast_here, METH_NOARGS, "here(): (timer, handle) of this thread's request, or None."},
    {"enter", (PyCFunction)(void (*)(void))fast_enter, METH_FASTCALL, "enter(timer, handle): this thread's request."},
    {"leave", (PyCFunction)(void (*)(void))fast_leave, METH_FASTCALL,
     "leave(timer, handle): no longer this thread's request, if it was."},
    {NULL, NULL, 0, NULL},
};

static int fast_exec(PyObject *m)
{
    static int once;
    /* The names of shmwheel's own Python objects that this module reads,
     * sets or calls: each is a member of a Protocol in shmwheel/_fast.pyi,
     * whose type checking sees a rename on the Python side, and
     * tests/test_layout.py holds this list and those Protocols together. */
    struct { PyObject **name; const char *text; } names[] = {
        /* ---- ours begin */
        {&str_look, "_look"}, {&str_fast, "_fast"}, {&str_finish, "finish"}, {&str_finished, "_finished"},
        {&str_cancel, "_cancel"}, {&str_timing_file_wrapper, "_timing_file_wrapper"},
        {&str_file_body, "_file_body"}, {&str_file_type, "file_type"}, {&str_timer, "_timer"},
        {&str_for, "_for"}, {&str_handle, "_handle"}, {&str_app, "app"}, {&str_timer_attr, "timer"},
        {&str_serve, "_serve"}, {&str_in_c, "_in_c"}, {&str_call, "_call"}, {&str_declined, "declined"},
        /* ---- ours end */
        /* The rest: keys of the environ and the scope, a server's names, values compared with. */
        {&str_close, "close"}, {&str_empty, ""}, {&str_dash, "-"}, {&str_request_method, "REQUEST_METHOD"},
        {&str_script_name, "SCRIPT_NAME"}, {&str_path_info, "PATH_INFO"}, {&str_request_id, "HTTP_X_REQUEST_ID"},
        {&str_environ_key, "shmwheel.timer"}, {&str_method, "method"}, {&str_path, "path"},
        {&str_headers, "headers"}, {&str_type, "type"},
        {&str_running_loop, "__asyncio_running_event_loop__"}, {&str_more_body, "more_body"},
        {&str_body_type, "http.response.body"}, {&str_zerocopy_type, "http.response.zerocopysend"},
        {&str_pathsend_type, "http.response.pathsend"}, {&str_ws_close, "websocket.close"}, {&str_http, "http"},
        {&str_req_key, "shmwheel_timer"}, {&str_file_wrapper, "wsgi.file_wrapper"},
    };
    size_t k;

    if (!once) {
        /* Process-wide, whichever interpreter imports the module first. */
        for (k = 0; k < sizeof names / sizeof names[0]; k++)
            if (!(*names[k].name = PyUnicode_InternFromString(names[k].text)))
                return -1;
        if (!(declined_kwnames = PyTuple_Pack(1, str_declined)))
            return -1;
        current_pid = getpid();
        if (pthread_atfork(NULL, NULL, after_fork_child) != 0) {
            PyErr_SetString(PyExc_OSError, "pthread_atfork failed");
            return -1;
        }
        once = 1;
    }
    if (PyType_Ready(&CoreType) < 0 || PyType_Ready(&ActiveType) < 0 || PyType_Ready(&TableType) < 0
        || PyType_Ready(&TimerType) < 0 || PyType_Ready(&BodyType) < 0
        || PyType_Ready(&SendType) < 0 || PyType_Ready(&ThenType) < 0 || PyType_Ready(&WSGIType) < 0
        || PyType_Ready(&ASGIType) < 0 || PyType_Ready(&HooksType) < 0 || PyType_Ready(&CoroutineType) < 0)
        return -1;
    if (PyModule_AddObjectRef(m, "Core", (PyObject *)&CoreType) < 0
        || PyModule_AddObjectRef(m, "Active", (PyObject *)&ActiveType) < 0
        || PyModule_AddObjectRef(m, "Table", (PyObject *)&TableType) < 0
        || PyModule_AddObjectRef(m, "Timer", (PyObject *)&TimerType) < 0
        || PyModule_AddObjectRef(m, "Body", (PyObject *)&BodyType) < 0
        || PyModule_AddObjectRef(m, "Send", (PyObject *)&SendType) < 0
        || PyModule_AddObjectRef(m, "WSGI", (PyObject *)&WSGIType) < 0
        || PyModule_AddObjectRef(m, "ASGI", (PyObject *)&ASGIType) < 0
        || PyModule_AddObjectRef(m, "Hooks", (PyObject *)&HooksType) < 0
        || PyModule_AddObjectRef(m, "Coroutine", (PyObject *)&CoroutineType) < 0
        || PyModule_AddIntConstant(m, "HEAD_SIZE", HEAD_SIZE) < 0
        || PyModule_AddIntConstant(m, "API_VERSION", SHMW_API_VERSION) < 0)
        return -1;
    return 0;
}

static PyModuleDef_Slot fast_slots[] = {
    {Py_mod_exec, fast_exec},
    {0, NULL},
};

static struct PyModuleDef fast_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "shmwheel._fast",
    .m_doc = "A worker's request timer on a path that keeps the GIL (csrc/python/fast.c).",
    .m_size = 0,
    .m_methods = fast_functions,
    .m_slots = fast_slots,
};

PyMODINIT_FUNC PyInit__fast(void)
{
    return PyModuleDef_Init(&fast_module);
}
