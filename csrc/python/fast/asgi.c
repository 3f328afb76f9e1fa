/* ---- ASGI, Send and Then ---------------------------------------------------- */

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
static PyObject *asyncio_task(ClerkObject *self)
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
 * runs it), ``*timed_scope`` a copy of the scope with ``shmwheel.handle``
 * (the ASGI spec: a middleware copies a scope it changes) and
 * ``*timed_send`` a Send around the server's.  Returns the handle; None,
 * having started nothing, where the middleware's own path takes the
 * request (what start() gives back None for, a scope that holds what it
 * does not expect, a task that is not asyncio's); NULL with an exception. */
static PyObject *asgi_start(ClerkObject *self, PyObject *scope, PyObject *send, PyObject **timed_scope,
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
 * other scope, one timed already, a process without its Clerk yet. */
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
    if (Py_IS_TYPE(fast, &ClerkType)) {
        declines = ((ClerkObject *)fast)->declined;
        key = asgi_start((ClerkObject *)fast, scope, args[2], &timed_scope, &timed_send);
        declines = ((ClerkObject *)fast)->declined - declines;
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
