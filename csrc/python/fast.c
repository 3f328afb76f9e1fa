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
 * Clerk    files one RequestTimer's requests in one process, from its
 *          constants (a clerk, not a timer: the timers are the wheel's,
 *          named by their handles): start() packs the request record
 *          (shmwheel/contrib/_record.py, byte for byte: the tests
 *          compare), adds its timer, and files the request
 *          in the RequestTimer's table, and in its thread's slot or its
 *          context; finish() takes it out and cancels its timer; wsgi() is
 *          the WSGI middleware's call, from the environ to the Body.
 * WSGI     a plain TimeoutMiddleware as a C callable: the server's call
 *          reaches Clerk.wsgi with no Python frame (uWSGI's application).
 * Body     a WSGI response body whose close() ends its request's timer
 *          through the RequestTimer's Clerk of the moment, or its finish().
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
 * No request asks the kernel for anything but the core's lock: a Clerk
 * only serves the process that made it (the pid is kept here, set again in
 * a forked child by pthread_atfork); the clock is the vDSO's; an asyncio
 * task is found without asyncio.current_task(), whose get_running_loop()
 * calls getpid() on CPython 3.11, but for a thread's first request under
 * a loop.  At a request's start, on its first and then once a second, a
 * Clerk gives the RequestTimer its look at the wheel (RequestTimer._look),
 * and goes on unless the look replaced it.
 *
 * Nothing runs under the segment's lock but the core's own code: the record
 * is built, and every Python object made, before the add or after it.
 *
 * One compilation unit in parts, included here in order, each a file of
 * csrc/python/fast/: common.h (what they all share), core.c (Core),
 * table.c (Active, Table and this thread's slot), record.c (packing the
 * record), clerk.c (Clerk: start, finish, the look), held.c (what the
 * adapters' types share), wsgi.c (Clerk.wsgi, WSGI, Body), hooks.c
 * (Gunicorn's Hooks), asgi.c (the task that runs a request, ASGI, Send,
 * Then, Coroutine); the module itself below.  As one unit the compiler
 * sees the hot path whole, as it did in one file: splitting it changed
 * no function's machine code.  The interned names are file globals, not
 * module state, which each use would have to look up: 209 more
 * instructions a uWSGI request, +4.8 % (docs/bench-log.md, "File globals
 * or module state").
 */
#include "fast/common.h"

#include "fast/core.c"
#include "fast/table.c"
#include "fast/record.c"
#include "fast/clerk.c"
#include "fast/held.c"
#include "fast/wsgi.c"
#include "fast/hooks.c"
#include "fast/asgi.c"

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
        {&str_environ_key, "shmwheel.handle"}, {&str_method, "method"}, {&str_path, "path"},
        {&str_headers, "headers"}, {&str_type, "type"},
        {&str_running_loop, "__asyncio_running_event_loop__"}, {&str_more_body, "more_body"},
        {&str_body_type, "http.response.body"}, {&str_zerocopy_type, "http.response.zerocopysend"},
        {&str_pathsend_type, "http.response.pathsend"}, {&str_ws_close, "websocket.close"}, {&str_http, "http"},
        {&str_req_key, "shmwheel_handle"}, {&str_file_wrapper, "wsgi.file_wrapper"},
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
        || PyType_Ready(&ClerkType) < 0 || PyType_Ready(&BodyType) < 0
        || PyType_Ready(&SendType) < 0 || PyType_Ready(&ThenType) < 0 || PyType_Ready(&WSGIType) < 0
        || PyType_Ready(&ASGIType) < 0 || PyType_Ready(&HooksType) < 0 || PyType_Ready(&CoroutineType) < 0)
        return -1;
    if (PyModule_AddObjectRef(m, "Core", (PyObject *)&CoreType) < 0
        || PyModule_AddObjectRef(m, "Active", (PyObject *)&ActiveType) < 0
        || PyModule_AddObjectRef(m, "Table", (PyObject *)&TableType) < 0
        || PyModule_AddObjectRef(m, "Clerk", (PyObject *)&ClerkType) < 0
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
