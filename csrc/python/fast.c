/*
 * fast.c - shmwheel._fast: a worker's request timer on a path that keeps
 * the GIL.
 *
 * cffi releases the GIL around every C call.  For a ~100 ns hold of the
 * segment's lock that costs more than the hold: on a threaded worker the
 * GIL goes to another thread, and getting it back is a context switch or
 * two.  This module makes the request's add and cancel as plain C calls
 * that keep the GIL, into the SAME core the cffi module holds: it links
 * none of csrc/core; the cffi module hands over the addresses of shmw_add
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
 * Timer    one RequestTimer's constants in one process: start() packs the
 *          request record (shmwheel/contrib/_record.py, byte for byte:
 *          tests/test_contrib.py compares), adds it, and files the request
 *          in the RequestTimer's table and context; finish() takes it out
 *          and cancels its timer.
 *
 * Nothing runs under the segment's lock but the core's own code: the record
 * is built, and every Python object made, before the add or after it.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#include "shmwheel.h"

typedef int64_t (*add_fn)(shmw_t *w, double delay_s, const char *payload, uint32_t len, uint32_t flags);
typedef int (*try_cancel_fn)(shmw_t *w, int64_t handle);

/* The request record's head (_record.py's HEAD, "<BBBBIQqQQBBHI"): the
 * offsets of the fields that change from one request to the next.  The
 * others come from the Timer's template, packed by Python. */
#define HEAD_SIZE     48
#define OFF_MLEN      1     /* B  method length */
#define OFF_RLEN      2     /* B  request id length */
#define OFF_FLAGS     3     /* B  flags */
#define OFF_STARTED   16    /* q  request start, monotonic ns */
#define OFF_THREAD    24    /* Q  the OS thread */
#define OFF_TASK      32    /* Q  the greenlet, id(), or 0 */

/* The Active tuple's fields (_stacks.py): payload, due_ns, thread, task,
 * handle, timeout_ns, interrupt. */
#define ACTIVE_FIELDS 7
#define ACTIVE_HANDLE 4

/* ---- Core ----------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    shmw_t        *w;           /* NULL once closed: every call gives up */
    add_fn         add;
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
    PyObject *w, *add, *try_cancel, *keep, *old;
    static char *names[] = {"w", "add", "try_cancel", "keep", NULL};

    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOO:Core", names, &w, &add, &try_cancel, &keep))
        return -1;
    if (!(self->w = address(w, "w")) || !(self->add = (add_fn)address(add, "add"))
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
    .tp_doc = "Core(w, add, try_cancel, keep): an open segment, by the addresses the cffi module gives.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Core_init,
    .tp_dealloc = (destructor)Core_dealloc,
    .tp_methods = Core_methods,
    .tp_getset = Core_getset,
};

/* ---- Timer ---------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    CoreObject *core;
    PyObject   *head;           /* bytes: the record's head with this timer's constants */
    double      delay_s;        /* to the first stage */
    int64_t     due_ns;         /* the first stage, after the start */
    int64_t     timeout_ns;     /* the timeout, after the start */
    Py_ssize_t  size;           /* the wheel's payload size */
    Py_ssize_t  max_method;     /* _record.MAX_METHOD */
    Py_ssize_t  max_request_id; /* _record.MAX_REQUEST_ID */
    uint8_t     task_flag;      /* _record.TASK */
    uint8_t     greenlet_flag;  /* _record.GREENLET */
    PyObject   *active;         /* dict: the RequestTimer's requests in progress */
    PyObject   *interrupted;    /* set: their handles, once interrupted */
    PyObject   *var;            /* ContextVar: the request in progress here */
    PyObject   *owner;          /* the RequestTimer, for the context's (owner, handle) */
    PyTypeObject *active_type;  /* Active, a tuple subclass */
    PyObject   *getcurrent;     /* greenlet.getcurrent, or None */
    PyObject   *interrupt;      /* the Active's interrupt field */
} TimerObject;

static int Timer_traverse(TimerObject *self, visitproc visit, void *arg)
{
    Py_VISIT(self->core);
    Py_VISIT(self->head);
    Py_VISIT(self->active);
    Py_VISIT(self->interrupted);
    Py_VISIT(self->var);
    Py_VISIT(self->owner);
    Py_VISIT(self->active_type);
    Py_VISIT(self->getcurrent);
    Py_VISIT(self->interrupt);
    return 0;
}

static int Timer_clear(TimerObject *self)
{
    Py_CLEAR(self->core);
    Py_CLEAR(self->head);
    Py_CLEAR(self->active);
    Py_CLEAR(self->interrupted);
    Py_CLEAR(self->var);
    Py_CLEAR(self->owner);
    Py_CLEAR(self->active_type);
    Py_CLEAR(self->getcurrent);
    Py_CLEAR(self->interrupt);
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
    static char *names[] = {"core", "head", "delay", "due_ns", "timeout_ns", "size", "max_method",
                            "max_request_id", "task_flag", "greenlet_flag", "active", "interrupted", "var", "owner",
                            "active_type", "getcurrent", "interrupt", NULL};
    PyObject *core, *head, *active, *interrupted, *var, *owner, *active_type, *getcurrent, *interrupt;
    double delay;
    long long due, timeout;
    Py_ssize_t size, max_method, max_request_id;
    unsigned char task_flag, greenlet_flag;

    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!SdLLnnnbbO!O!OOO!OO:Timer", names,
                                     &CoreType, &core, &head, &delay, &due, &timeout, &size, &max_method,
                                     &max_request_id, &task_flag, &greenlet_flag, &PyDict_Type, &active,
                                     &PySet_Type, &interrupted, &var, &owner, &PyType_Type, &active_type,
                                     &getcurrent, &interrupt))
        return -1;
    if (PyBytes_GET_SIZE(head) != HEAD_SIZE) {
        PyErr_Format(PyExc_ValueError, "head must be %d bytes", HEAD_SIZE);
        return -1;
    }
    if (!PyContextVar_CheckExact(var)) {
        PyErr_SetString(PyExc_TypeError, "var must be a ContextVar");
        return -1;
    }
    if (!PyType_IsSubtype((PyTypeObject *)active_type, &PyTuple_Type)
        || ((PyTypeObject *)active_type)->tp_basicsize != PyTuple_Type.tp_basicsize) {
        PyErr_SetString(PyExc_TypeError, "active_type must be a tuple subclass without slots");
        return -1;
    }
    if (size < HEAD_SIZE || size > (Py_ssize_t)SHMW_MAX_PAYLOAD || max_method < 0 || max_method > 255
        || max_request_id < 0 || max_request_id > 255 || !(delay >= 0.0)) {
        PyErr_SetString(PyExc_ValueError, "a Timer's sizes or delay are out of range");
        return -1;
    }
    Timer_clear(self);
    self->core = (CoreObject *)Py_NewRef(core);
    self->head = Py_NewRef(head);
    self->delay_s = delay;
    self->due_ns = due;
    self->timeout_ns = timeout;
    self->size = size;
    self->max_method = max_method;
    self->max_request_id = max_request_id;
    self->task_flag = task_flag;
    self->greenlet_flag = greenlet_flag;
    self->active = Py_NewRef(active);
    self->interrupted = Py_NewRef(interrupted);
    self->var = Py_NewRef(var);
    self->owner = Py_NewRef(owner);
    self->active_type = (PyTypeObject *)Py_NewRef(active_type);
    self->getcurrent = Py_NewRef(getcurrent);
    self->interrupt = Py_NewRef(interrupt);
    return 0;
}

static inline void put_u64le(char *p, uint64_t v)
{
    int k;

    for (k = 0; k < 8; k++)
        p[k] = (char)(v >> (8 * k));
}

/* What _record.REQUEST_ID matches: [A-Za-z0-9._:@/+=-]. */
static inline int request_id_char(unsigned char c)
{
    return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9')
        || (c != 0 && strchr("._:@/+=-", c) != NULL);
}

/* The client's request id as the record takes it: its ASCII bytes if it is
 * all REQUEST_ID's characters, and none if not (the record's own id stands
 * in).  -1: not a str, which RequestTimer.start's own path deals with. */
static Py_ssize_t request_id_of(const TimerObject *self, PyObject *rid, const char **data)
{
    const unsigned char *s;
    Py_ssize_t n, k;

    *data = "";
    if (rid == Py_None)
        return 0;
    if (!PyUnicode_CheckExact(rid))
        return -1;
    if (!PyUnicode_IS_ASCII(rid))
        return 0;
    n = PyUnicode_GET_LENGTH(rid);
    if (n < 1 || n > self->max_request_id)
        return 0;
    s = PyUnicode_1BYTE_DATA(rid);
    for (k = 0; k < n; k++)
        if (!request_id_char(s[k]))
            return 0;
    *data = (const char *)s;
    return n;
}

/* start(now_ns, method, path, request_id, task): the request's handle, its timer
 * added and the request filed; or None, having changed nothing, for the
 * caller's own path to take it (a record to cut or a method to replace
 * characters of, the segment's lock held by another, the wheel closed,
 * removed, full or not attached: anything but the plain case). */
static PyObject *Timer_start(TimerObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *method, *path, *encoded = NULL, *payload, *task = Py_None, *current = NULL;
    PyObject *active = NULL, *key = NULL, *context = NULL, *token;
    const char *rid, *pdata;
    Py_ssize_t mlen, rlen, plen, n;
    long long now;
    uint64_t thread;
    int64_t handle;
    char *buf;
    uint8_t flags;
    shmw_t *w = self->core->w;

    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "start(now_ns, method, path, request_id, task)");
        return NULL;
    }
    if (!w)
        Py_RETURN_NONE;
    now = PyLong_AsLongLong(args[0]);
    if (now == -1 && PyErr_Occurred())
        return NULL;
    method = args[1];
    path = args[2];
    if (!PyUnicode_CheckExact(method) || !PyUnicode_IS_ASCII(method) || !PyUnicode_CheckExact(path))
        Py_RETURN_NONE;
    mlen = PyUnicode_GET_LENGTH(method);
    if (mlen > self->max_method || (rlen = request_id_of(self, args[3], &rid)) < 0)
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
    n = HEAD_SIZE + mlen + rlen + plen;
    if (n > self->size) {
        Py_XDECREF(encoded);
        Py_RETURN_NONE;         /* cut to fit, by encode_request */
    }

    flags = (uint8_t)PyBytes_AS_STRING(self->head)[OFF_FLAGS];
    if (args[4] != Py_None) {
        /* The asyncio or trio task that runs the request. */
        task = args[4];
        flags |= self->task_flag;
    } else if (self->getcurrent != Py_None) {
        /* A greenlet that is not its thread's own serves the request. */
        PyObject *parent;
        if (!(current = PyObject_CallNoArgs(self->getcurrent)))
            goto fail;
        if (!(parent = PyObject_GetAttrString(current, "parent")))
            goto fail;
        if (parent != Py_None) {
            task = current;
            flags |= self->greenlet_flag;
        }
        Py_DECREF(parent);
    }
    thread = (uint64_t)PyThread_get_thread_ident();

    if (!(payload = PyBytes_FromStringAndSize(NULL, n)))
        goto fail;
    buf = PyBytes_AS_STRING(payload);
    memcpy(buf, PyBytes_AS_STRING(self->head), HEAD_SIZE);
    buf[OFF_MLEN] = (char)mlen;
    buf[OFF_RLEN] = (char)rlen;
    buf[OFF_FLAGS] = (char)flags;
    put_u64le(buf + OFF_STARTED, (uint64_t)now);
    put_u64le(buf + OFF_THREAD, thread);
    put_u64le(buf + OFF_TASK, task == Py_None ? 0 : (uint64_t)(uintptr_t)task);
    memcpy(buf + HEAD_SIZE, PyUnicode_1BYTE_DATA(method), (size_t)mlen);
    memcpy(buf + HEAD_SIZE + mlen, rid, (size_t)rlen);
    memcpy(buf + HEAD_SIZE + mlen + rlen, pdata, (size_t)plen);
    Py_CLEAR(encoded);

    /* The one call under the segment's lock: a try, which the GIL allows. */
    handle = self->core->add(w, self->delay_s, buf, (uint32_t)n, SHMW_CANCEL_ON_EXIT | SHMW_TRYLOCK);
    if (handle < 0) {
        Py_DECREF(payload);
        Py_XDECREF(current);
        Py_RETURN_NONE;
    }

    /* Filed as RequestTimer.start files it.  A failure here (memory) takes
     * the timer out again, so that no timer outlives an unfiled request. */
    if (!(key = PyLong_FromLongLong(handle)))
        goto undo;
    if (!(active = self->active_type->tp_alloc(self->active_type, ACTIVE_FIELDS)))
        goto undo;
    PyTuple_SET_ITEM(active, 0, payload);       /* the tuple takes these references */
    payload = NULL;
    PyTuple_SET_ITEM(active, 1, PyLong_FromLongLong(now + self->due_ns));
    PyTuple_SET_ITEM(active, 2, PyLong_FromUnsignedLongLong(thread));
    PyTuple_SET_ITEM(active, 3, Py_NewRef(task));
    PyTuple_SET_ITEM(active, ACTIVE_HANDLE, Py_NewRef(key));
    PyTuple_SET_ITEM(active, 5, PyLong_FromLongLong(now + self->timeout_ns));
    PyTuple_SET_ITEM(active, 6, Py_NewRef(self->interrupt));
    if (!PyTuple_GET_ITEM(active, 1) || !PyTuple_GET_ITEM(active, 2) || !PyTuple_GET_ITEM(active, 5))
        goto undo;
    if (!(context = PyTuple_Pack(2, self->owner, key)))
        goto undo;
    if (PyDict_SetItem(self->active, key, active) < 0)
        goto undo;
    if (!(token = PyContextVar_Set(self->var, context))) {
        PyDict_DelItem(self->active, key);
        goto undo;
    }
    Py_DECREF(token);
    Py_DECREF(context);
    Py_DECREF(active);
    Py_XDECREF(current);
    return key;

undo:
    (void)self->core->try_cancel(w, handle);
    Py_XDECREF(payload);
    Py_XDECREF(active);
    Py_XDECREF(key);
    Py_XDECREF(context);
fail:
    Py_XDECREF(encoded);
    Py_XDECREF(current);
    return NULL;
}

/* finish(handle): None if the table has no such request; True once its
 * timer is cancelled; else its Active, taken out of the table, for the
 * caller's own path to cancel (the lock held by another, a timer in a wheel
 * replaced since, one that has fired). */
static PyObject *Timer_finish(TimerObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *key, *active;
    long long handle;
    shmw_t *w = self->core->w;

    if (nargs != 1) {
        PyErr_SetString(PyExc_TypeError, "finish(handle)");
        return NULL;
    }
    key = args[0];
    if (!(active = PyDict_GetItemWithError(self->active, key))) {
        if (PyErr_Occurred())
            return NULL;
        Py_RETURN_NONE;
    }
    Py_INCREF(active);
    if (PyDict_DelItem(self->active, key) < 0
        || (PySet_GET_SIZE(self->interrupted) && PySet_Discard(self->interrupted, key) < 0)) {
        Py_DECREF(active);
        return NULL;
    }
    if (!w || !PyTuple_Check(active) || PyTuple_GET_SIZE(active) != ACTIVE_FIELDS)
        return active;
    handle = PyLong_AsLongLong(PyTuple_GET_ITEM(active, ACTIVE_HANDLE));
    if (handle == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        return active;
    }
    if (self->core->try_cancel(w, handle) == 1) {
        Py_DECREF(active);
        Py_RETURN_TRUE;
    }
    return active;
}

static PyMethodDef Timer_methods[] = {
    {"start", (PyCFunction)(void (*)(void))Timer_start, METH_FASTCALL,
     "start(now_ns, method, path, request_id, task): the handle, or None for the caller's own path."},
    {"finish", (PyCFunction)(void (*)(void))Timer_finish, METH_FASTCALL,
     "finish(handle): None if not in the table, True if cancelled, else the Active taken out."},
    {NULL, NULL, 0, NULL},
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
};

/* ---- the module ----------------------------------------------------------- */

static int fast_exec(PyObject *m)
{
    if (PyType_Ready(&CoreType) < 0 || PyType_Ready(&TimerType) < 0)
        return -1;
    if (PyModule_AddObjectRef(m, "Core", (PyObject *)&CoreType) < 0
        || PyModule_AddObjectRef(m, "Timer", (PyObject *)&TimerType) < 0
        || PyModule_AddIntConstant(m, "HEAD_SIZE", HEAD_SIZE) < 0)
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
    .m_slots = fast_slots,
};

PyMODINIT_FUNC PyInit__fast(void)
{
    return PyModuleDef_Init(&fast_module);
}
