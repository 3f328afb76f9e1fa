/* ---- WSGI ----------------------------------------------------------------- */

/* A TimeoutMiddleware as a C callable: the server's call goes straight to
 * the RequestTimer's Clerk of the moment (Clerk.wsgi) without a Python
 * frame, and to the middleware itself for what that gives back. */
typedef struct {
    PyObject_HEAD
    PyObject *middleware;       /* the TimeoutMiddleware */
    PyObject *app;              /* its application */
    PyObject *timer;            /* its RequestTimer */
    vectorcallfunc vectorcall;
    PyObject *fast;             /* the RequestTimer's Clerk last seen, or NULL */
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
        /* The Clerk kept from the last request, while it is current: the
         * RequestTimer's attribute is not looked up for each. */
        if (self->fast && current((ClerkObject *)self->fast)) {
            fast = Py_NewRef(self->fast);
        } else {
            if (!(fast = PyObject_GetAttr(self->timer, str_fast)))
                return NULL;
            Py_XSETREF(self->fast, Py_IS_TYPE(fast, &ClerkType) ? Py_NewRef(fast) : NULL);
        }
        if (Py_IS_TYPE(fast, &ClerkType)) {
            call[0] = self->app;
            call[1] = args[0];
            call[2] = args[1];
            r = Clerk_wsgi((ClerkObject *)fast, call, 3);
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

/* Puts in the environ what stands for the server's wsgi.file_wrapper where
 * that is a function, uWSGI's (RequestTimer._timing_file_wrapper, asked
 * once for the last one seen): the file goes to the server as a timed one.
 * 1 if it did, 0 if the wrapper is left as it is, -1 with an exception. */
static int timing_file_wrapper(ClerkObject *self, PyObject *environ)
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
static int is_timed_file(ClerkObject *self, PyObject *body, PyObject *key)
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
 * as ``shmwheel.handle``, the application called, and its body given back
 * in a Body (a file handed to a server's wrapper that is a function: the
 * timed file that wrapper was given); the timer finished if the
 * application raises.
 * NotImplemented, having called nothing, where the middleware's own path
 * takes the request: an environ that is not a dict, has a field that is
 * not an ASCII str, or that a middleware outside this one has timed.  None, having called nothing, for a request it tried
 * and gave back (what start() gives back None for): the middleware's
 * waiting path takes it (TimeoutMiddleware._serve with declined). */
static PyObject *Clerk_wsgi(ClerkObject *self, PyObject *const *args, Py_ssize_t nargs)
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
    if ((r = PyDict_Contains(environ, str_environ_key)) != 0)
        return r < 0 ? NULL : Py_NewRef(Py_NotImplemented); /* timed already, outside: the middleware says so */
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
