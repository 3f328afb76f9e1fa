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
