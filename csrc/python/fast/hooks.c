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
 * req.shmwheel_handle; the Python pre_request takes what this does not:
 * what it cannot read, as slow(worker, req), and what it tried and gave
 * back, as slow(worker, req, declined=True), which takes the waiting path
 * (a keyword, so that Gunicorn still counts two arguments). */
static PyObject *Hooks_pre_request(HooksObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *timer, *fast = NULL, *req, *headers = NULL, *rid, *method = NULL, *path = NULL, *key = NULL, *call[3];
    ClerkObject *t;
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
    t = (ClerkObject *)fast;
    if (!Py_IS_TYPE(fast, &ClerkType) || t->pid != current_pid)
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

/* post_request(worker, req, environ, resp): the timer of req.shmwheel_handle
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
