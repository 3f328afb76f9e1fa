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
