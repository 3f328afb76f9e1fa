/* gil.c - where this interpreter's GIL counts the times it changed hands.
 *
 * The worker's gate before faulthandler's dump of every thread
 * (csrc/core/signal.c, shmw_signal_gate_dump) lets the driver's dump
 * through only on evidence that no Python runs: the reporter thread has
 * waited for the GIL, and the GIL has not changed hands since.  A thread
 * that runs bytecode while another waits gives the GIL up within a switch
 * interval, and the count goes up; one in a C call that holds it never
 * does.  The count is the GIL's own (switch_number), which CPython keeps
 * in a structure of its internal headers: this module is the one place
 * that reads them, kept apart from the rest so that nothing else is built
 * with Py_BUILD_CORE.  It gives the count's address, and the switch
 * interval's, which the gate reads from a signal handler (aligned words,
 * read as they are); 0 where this CPython's layout is not known here.
 */
#include <patchlevel.h> /* PY_VERSION_HEX, before Python.h: the internal headers only where known */

#if PY_VERSION_HEX >= 0x030B0000 && PY_VERSION_HEX < 0x030E0000
#define Py_BUILD_CORE_MODULE 1
#define KNOWN_LAYOUT 1
#endif

#include <Python.h>

#ifdef KNOWN_LAYOUT
#include "internal/pycore_interp.h"
#include "internal/pycore_runtime.h"
#endif

static PyObject *switches_address(PyObject *module, PyObject *unused)
{
    (void)module;
    (void)unused;
#if defined(KNOWN_LAYOUT) && PY_VERSION_HEX >= 0x030C0000
    PyInterpreterState *interp = PyInterpreterState_Get(); /* 3.12 on: a GIL of each interpreter's */
    if (interp->ceval.gil != NULL)
        return PyLong_FromVoidPtr((void *)&interp->ceval.gil->switch_number);
#elif defined(KNOWN_LAYOUT)
    PyInterpreterState *interp = PyInterpreterState_Get(); /* 3.11: the runtime's one */
    return PyLong_FromVoidPtr((void *)&interp->runtime->ceval.gil.switch_number);
#endif
    return PyLong_FromLong(0);
}

static PyObject *interval_address(PyObject *module, PyObject *unused)
{
    (void)module;
    (void)unused;
#if defined(KNOWN_LAYOUT) && PY_VERSION_HEX >= 0x030C0000
    PyInterpreterState *interp = PyInterpreterState_Get();
    if (interp->ceval.gil != NULL)
        return PyLong_FromVoidPtr((void *)&interp->ceval.gil->interval);
#elif defined(KNOWN_LAYOUT)
    PyInterpreterState *interp = PyInterpreterState_Get();
    return PyLong_FromVoidPtr((void *)&interp->runtime->ceval.gil.interval);
#endif
    return PyLong_FromLong(0);
}

static PyMethodDef methods[] = {
    {"interval_address", interval_address, METH_NOARGS,
     "interval_address()\n--\n\nThe address of the switch interval of this interpreter's GIL, in microseconds "
     "(an unsigned long), or 0 where this CPython's layout is not known."},
    {"switches_address", switches_address, METH_NOARGS,
     "switches_address()\n--\n\nThe address of the count of the times this interpreter's GIL changed hands "
     "(an unsigned long), or 0 where this CPython's layout is not known."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    .m_base = PyModuleDef_HEAD_INIT,
    .m_name = "shmwheel._gil",
    .m_doc = "Where the GIL counts the times it changed hands, and keeps its switch interval.",
    .m_size = 0,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__gil(void)
{
    return PyModule_Create(&module);
}
