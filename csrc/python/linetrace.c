/*
 * linetrace.c - shmwheel._linetrace: a check run by another thread itself,
 * at each line it starts, on CPython 3.11.
 *
 * A timed-out request is ended by raising RequestTimeout in its thread.
 * Raised asynchronously (PyThreadState_SetAsyncExc) it lands at whatever
 * bytecode the thread is at: between a lock's acquire() and the try that
 * releases it, halfway through a finally.  Instead the thread is made to
 * run a check of its own at the start of each line, which raises only
 * where the whole stack is at a safe point (shmwheel/contrib/_safepoint.py
 * decides).  CPython 3.12 and later have sys.monitoring for this; 3.11 has
 * only the trace function, which CPython sets for the calling thread
 * alone.  trace_thread() sets it for another, with the GIL held, through
 * _PyEval_SetTrace (exported by 3.11: threading.settrace's own path),
 * which also turns the thread's tracing on where it next dispatches an
 * instruction.
 *
 * The thread's own trace function (a debugger's, coverage's) is kept: it
 * is called first for every event while the check is armed, and given
 * back when the check disarms, unless something replaced the check
 * meanwhile.  The check is called only for PyTrace_LINE events: True keeps
 * it armed; anything else disarms it; an exception is raised in the thread
 * at that line, as the frame's exception table sees it, in the try that
 * covers the line, and the check stays armed (it may have to raise again:
 * an exception raised in a gc callback or a finalizer is only printed).
 *
 * state_id() names a thread's state uniquely, on every CPython: a check is
 * armed for one thread, not for whichever later thread gets its id.
 *
 * Nothing here runs on a request's path: only the reporter thread arms a
 * check, for a request past its timeout.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#if PY_VERSION_HEX < 0x030C0000

typedef struct {
    PyObject_HEAD
    PyObject *check;    /* check(frame) -> bool, called in the traced thread */
    Py_tracefunc prev;  /* the thread's trace function before, or NULL */
    PyObject *prev_arg; /* its argument (a reference) */
} Armed;

static int Armed_traverse(Armed *self, visitproc visit, void *arg)
{
    Py_VISIT(self->check);
    Py_VISIT(self->prev_arg);
    return 0;
}

static int Armed_clear(Armed *self)
{
    Py_CLEAR(self->check);
    Py_CLEAR(self->prev_arg);
    return 0;
}

static void Armed_dealloc(Armed *self)
{
    PyObject_GC_UnTrack(self);
    Armed_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyTypeObject ArmedType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "shmwheel._linetrace.Armed",
    .tp_basicsize = sizeof(Armed),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "A check armed in a thread's trace function.",
    .tp_traverse = (traverseproc)Armed_traverse,
    .tp_clear = (inquiry)Armed_clear,
    .tp_dealloc = (destructor)Armed_dealloc,
};

/* Give the calling thread its own trace function back, if the check is
 * still the one set. */
static void disarm(Armed *self)
{
    PyThreadState *tstate = PyThreadState_Get();

    if (tstate->c_traceobj != (PyObject *)self)
        return; /* replaced meanwhile (sys.settrace in the request): theirs now */
    Py_INCREF(self); /* the thread's reference goes in the call */
    if (_PyEval_SetTrace(tstate, self->prev, self->prev_arg) < 0)
        PyErr_WriteUnraisable((PyObject *)self);
    Py_DECREF(self);
}

static int trace(PyObject *obj, PyFrameObject *frame, int what, PyObject *arg)
{
    Armed *self = (Armed *)obj;
    PyObject *verdict;
    int keep;

    Py_INCREF(self);
    if (self->prev != NULL && self->prev(self->prev_arg, frame, what, arg) < 0) {
        Py_DECREF(self);
        return -1; /* theirs raised: it goes on as it would have */
    }
    if (what != PyTrace_LINE) {
        Py_DECREF(self);
        return 0;
    }
    verdict = PyObject_CallOneArg(self->check, (PyObject *)frame);
    if (verdict == NULL) {
        Py_DECREF(self);
        return -1; /* raised there; the check stays, to raise again if it must */
    }
    keep = verdict == Py_True;
    Py_DECREF(verdict);
    if (!keep)
        disarm(self);
    Py_DECREF(self);
    return 0;
}

static PyObject *trace_thread(PyObject *Py_UNUSED(m), PyObject *const *args, Py_ssize_t nargs)
{
    unsigned long ident;
    PyThreadState *tstate;
    Armed *armed;

    if (nargs != 2 || !PyLong_Check(args[0]) || !PyCallable_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "trace_thread(ident: int, check: callable)");
        return NULL;
    }
    ident = PyLong_AsUnsignedLong(args[0]);
    if (ident == (unsigned long)-1 && PyErr_Occurred())
        return NULL;
    /* With the GIL held no thread state is unlinked (a thread that ends
     * unlinks its own before it lets the GIL go). */
    for (tstate = PyInterpreterState_ThreadHead(PyThreadState_Get()->interp); tstate != NULL;
         tstate = PyThreadState_Next(tstate))
        if (tstate->thread_id == ident)
            break;
    if (tstate == NULL)
        Py_RETURN_FALSE;
    if (tstate == PyThreadState_Get()) {
        PyErr_SetString(PyExc_ValueError, "trace_thread: the calling thread is not another thread");
        return NULL;
    }
    if (tstate->c_tracefunc == trace) {
        /* Armed already: the new check replaces the old, the thread's own
         * trace function stays the one kept. */
        Armed *old = (Armed *)tstate->c_traceobj;
        Py_INCREF(args[1]);
        Py_SETREF(old->check, args[1]);
        Py_RETURN_TRUE;
    }
    armed = PyObject_GC_New(Armed, &ArmedType);
    if (armed == NULL)
        return NULL;
    armed->check = Py_NewRef(args[1]);
    armed->prev = tstate->c_tracefunc;
    armed->prev_arg = Py_XNewRef(tstate->c_traceobj);
    PyObject_GC_Track(armed);
    if (_PyEval_SetTrace(tstate, trace, (PyObject *)armed) < 0) {
        Py_DECREF(armed);
        return NULL;
    }
    Py_DECREF(armed); /* the thread state holds it */
    Py_RETURN_TRUE;
}

static PyObject *state_id(PyObject *m, PyObject *const *args, Py_ssize_t nargs);

static PyMethodDef linetrace_functions[] = {
    {"trace_thread", (PyCFunction)(void (*)(void))trace_thread, METH_FASTCALL,
     "trace_thread(ident, check): check(frame) in thread ident at each line it starts, until it gives "
     "anything but True (what it raises is raised there); False if there is no such thread."},
    {"state_id", (PyCFunction)(void (*)(void))state_id, METH_FASTCALL,
     "state_id(ident=None): the unique id of a thread's state (this thread's), or None."},
    {NULL, NULL, 0, NULL},
};

static int linetrace_exec(PyObject *Py_UNUSED(m))
{
    return PyType_Ready(&ArmedType);
}

#else /* CPython 3.12 and later: sys.monitoring, from Python */

static PyObject *state_id(PyObject *m, PyObject *const *args, Py_ssize_t nargs);

static PyMethodDef linetrace_functions[] = {
    {"state_id", (PyCFunction)(void (*)(void))state_id, METH_FASTCALL,
     "state_id(ident=None): the unique id of a thread's state (this thread's), or None."},
    {NULL, NULL, 0, NULL},
};

static int linetrace_exec(PyObject *Py_UNUSED(m))
{
    return 0;
}

#endif

/* state_id(ident=None): the interpreter's id of a thread's state, unique
 * for the life of the process, where a thread id is used again once its
 * thread has ended; the calling thread's, or None if no thread has that
 * id.  The greenlets of a thread share it. */
static PyObject *state_id(PyObject *Py_UNUSED(m), PyObject *const *args, Py_ssize_t nargs)
{
    PyThreadState *tstate = PyThreadState_Get();
    unsigned long ident;

    if (nargs > 1 || (nargs == 1 && args[0] != Py_None && !PyLong_Check(args[0]))) {
        PyErr_SetString(PyExc_TypeError, "state_id(ident: int | None = None)");
        return NULL;
    }
    if (nargs == 1 && args[0] != Py_None) {
        ident = PyLong_AsUnsignedLong(args[0]);
        if (ident == (unsigned long)-1 && PyErr_Occurred())
            return NULL;
        for (tstate = PyInterpreterState_ThreadHead(tstate->interp); tstate != NULL;
             tstate = PyThreadState_Next(tstate))
            if (tstate->thread_id == ident)
                break;
        if (tstate == NULL)
            Py_RETURN_NONE;
    }
    return PyLong_FromUnsignedLongLong(PyThreadState_GetID(tstate));
}

static PyModuleDef_Slot linetrace_slots[] = {
    {Py_mod_exec, linetrace_exec},
    {0, NULL},
};

static struct PyModuleDef linetrace_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "shmwheel._linetrace",
    .m_doc = "A check run by another thread at each line it starts, on CPython 3.11 (csrc/python/linetrace.c).",
    .m_size = 0,
    .m_methods = linetrace_functions,
    .m_slots = linetrace_slots,
};

PyMODINIT_FUNC PyInit__linetrace(void)
{
    return PyModuleDef_Init(&linetrace_module);
}
