/* ---- Clerk ---------------------------------------------------------------- */

struct ClerkObject {
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
    pid_t       pid;            /* the process this Clerk serves */
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
};

static PyTypeObject ClerkType;

static int Clerk_traverse(ClerkObject *self, visitproc visit, void *arg)
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
     * this Clerk holds it alone, and its reference to the loop is this
     * Clerk's too: visited as such, so that a loop dropped unclosed, with
     * the requests its tasks hold, can be collected. */
    if (self->holder && self->holder != self->loop && Py_REFCNT(self->holder) == 1)
        Py_VISIT(self->loop);
    return 0;
}

static int Clerk_clear(ClerkObject *self)
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

static void Clerk_dealloc(ClerkObject *self)
{
    PyObject_GC_UnTrack(self);
    Clerk_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int Clerk_init(ClerkObject *self, PyObject *args, PyObject *kwds)
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

    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!SLLnO!O!OOOpLL|OO:Clerk", names,
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
        PyErr_SetString(PyExc_ValueError, "a Clerk's sizes or times are out of range");
        return -1;
    }
    Clerk_clear(self);
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

/* Whether ``t`` is still its RequestTimer's Clerk in this process, which
 * a WSGI callable and a Body keep rather than ask the RequestTimer for
 * every request: a Clerk is made for one process (the RequestTimer makes
 * another in a forked child) and retired when the RequestTimer lets go of
 * it (RequestTimer._drop_fast: a wheel replaced, a fork). */
static inline int current(const ClerkObject *t)
{
    return !t->retired && t->pid == current_pid;
}

/* Whether this Clerk serves a request now: 1, yes; 0, no, the caller's own
 * path does (a closed wheel, a Clerk made in another process, or one that
 * the RequestTimer's look has just replaced); -1, the look failed.  The
 * look comes at the first request and then once a second. */
static int ready(ClerkObject *self, int64_t now)
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
    /* Not mine: a Clerk made before a fork, which the look notices where
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
    /* Still the RequestTimer's Clerk: the wheel it looked at is this one. */
    if (!(r = PyObject_GetAttr(self->owner, str_fast)))
        return -1;
    Py_DECREF(r);
    return r == (PyObject *)self;
}

/* The request's timer added and the request filed: the record packed from
 * the Clerk's head and the request's method, id and path (two pieces, the
 * second may be empty), started at ``started`` and due ``timeout`` ns after
 * it, into the table's spare buffer, which becomes its slot's.  Returns the
 * handle; None, having changed nothing, for the caller's own path to take
 * the request (a record to cut, a method to replace characters of, the
 * segment's lock held by another, the wheel closed, removed or full:
 * anything but the plain case); NULL with an exception.  It may run Python
 * (greenlet's getcurrent) before it writes the record, so the caller holds
 * what the pieces' pointers and ``request_id`` point into. */
static PyObject *start_request(ClerkObject *self, int64_t now, int64_t started, int64_t timeout, PyObject *method,
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
static PyObject *declined(ClerkObject *self, PyObject *key)
{
    if (key == Py_None)
        self->declined++;
    return key;
}

/* start_request() for a str ``path``, as the record holds it: ASCII as it
 * is, else UTF-8 with the surrogates escaped.  None for a path or an id of
 * another type (the id a str or None, as RequestTimer.start takes it). */
static PyObject *start_path(ClerkObject *self, int64_t now, int64_t started, int64_t timeout, PyObject *method,
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
 * own path (see start_request).  timeout_ns (None: the Clerk's) and
 * started_ns (None: now) are a request's own: a route's, a proxy's start. */
static PyObject *Clerk_start(ClerkObject *self, PyObject *const *args, Py_ssize_t nargs)
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
static PyObject *finish_request(ClerkObject *self, PyObject *key)
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
static PyObject *Clerk_finish(ClerkObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 1) {
        PyErr_SetString(PyExc_TypeError, "finish(handle)");
        return NULL;
    }
    return finish_request(self, args[0]);
}

/* RequestTimer.finish(key) without its frame: through the RequestTimer's
 * Clerk of the moment (a wheel attached again since the start has a new
 * one), the rest of the way in RequestTimer._finished; or finish() itself
 * where no Clerk of this process serves.  ``owner`` is the RequestTimer,
 * or the Clerk that started the request (a Body's), which ends it itself
 * while it is current.  0, or -1 with an exception. */
static int end_request(PyObject *owner, PyObject *key)
{
    PyObject *fast, *r;

    if (key == Py_None)
        return 0;
    if (Py_IS_TYPE(owner, &ClerkType)) {
        ClerkObject *t = (ClerkObject *)owner;

        if (!(owner = t->owner))
            return 0;           /* cleared by the collector: nothing left to end it with */
        fast = current(t) ? Py_NewRef(t) : PyObject_GetAttr(owner, str_fast);
    } else {
        fast = PyObject_GetAttr(owner, str_fast);
    }
    if (!fast)
        return -1;
    if (Py_IS_TYPE(fast, &ClerkType) && ((ClerkObject *)fast)->pid == current_pid) {
        r = finish_request((ClerkObject *)fast, key);
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

static PyObject *Clerk_retire(ClerkObject *self, PyObject *Py_UNUSED(ignored))
{
    self->retired = 1;
    Py_RETURN_NONE;
}

static PyMethodDef Clerk_methods[] = {
    {"start", (PyCFunction)(void (*)(void))Clerk_start, METH_FASTCALL,
     "start(now_ns, method, path, request_id, task[, timeout_ns[, started_ns]]): the handle, or None for the "
     "caller's own path."},
    {"finish", (PyCFunction)(void (*)(void))Clerk_finish, METH_FASTCALL,
     "finish(handle): None if not in the table, True if cancelled, else the Active taken out."},
    {"wsgi", (PyCFunction)(void (*)(void))Clerk_wsgi, METH_FASTCALL,
     "wsgi(app, environ, start_response): the application's body in a Body, or NotImplemented for the "
     "middleware's own path."},
    {"retire", (PyCFunction)Clerk_retire, METH_NOARGS,
     "retire(): the RequestTimer has let go of this Clerk; whoever kept it asks the RequestTimer again."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef Clerk_members[] = {
    {"look_at", T_LONGLONG, offsetof(ClerkObject, look_at), 0,
     "time.monotonic_ns() of the RequestTimer's next look at its wheel, which the next start() after it has."},
    {"retired", T_BOOL, offsetof(ClerkObject, retired), READONLY, "Whether retire() has been called."},
    {"declined", T_ULONGLONG, offsetof(ClerkObject, declined), READONLY,
     "Requests it tried and gave back (the lock held elsewhere, a record to cut, an error), each of which "
     "then took the waiting path, not this one again."},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject ClerkType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "shmwheel._fast.Clerk",
    .tp_basicsize = sizeof(ClerkObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "A RequestTimer's constants in one process, and its start and finish on the GIL-keeping path.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Clerk_init,
    .tp_traverse = (traverseproc)Clerk_traverse,
    .tp_clear = (inquiry)Clerk_clear,
    .tp_dealloc = (destructor)Clerk_dealloc,
    .tp_methods = Clerk_methods,
    .tp_members = Clerk_members,
};
