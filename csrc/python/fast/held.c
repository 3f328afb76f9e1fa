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

/* Whether the str ``kind`` is ``name``, an interned ASCII literal: by
 * identity (the server's literals are interned), else by length and bytes,
 * which tells most types apart at the length. */
static inline int kind_is(PyObject *kind, PyObject *name)
{
    Py_ssize_t n = PyUnicode_GET_LENGTH(name);

    return kind == name || (PyUnicode_IS_ASCII(kind) && PyUnicode_GET_LENGTH(kind) == n
                            && memcmp(PyUnicode_1BYTE_DATA(kind), PyUnicode_1BYTE_DATA(name), (size_t)n) == 0);
}

/* An environ's str, borrowed: its value, ``otherwise`` if it has none;
 * NULL without an exception if it is not an ASCII str. */
static PyObject *environ_ascii(PyObject *environ, PyObject *name, PyObject *otherwise)
{
    PyObject *v = PyDict_GetItemWithError(environ, name);

    if (!v)
        return PyErr_Occurred() ? NULL : otherwise;
    return PyUnicode_CheckExact(v) && PyUnicode_IS_ASCII(v) ? v : NULL;
}
