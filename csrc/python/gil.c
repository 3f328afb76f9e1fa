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
#define Py_BUILD_CORE_MODULE 1
#include <Python.h>

#if PY_VERSION_HEX >= 0x030B0000 && PY_VERSION_HEX < 0x030E0000
#include "internal/pycore_interp.h"
#include "internal/pycore_runtime.h"
#define KNOWN_LAYOUT 1
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
    PyModuleDef_HEAD_INIT, "shmwheel._gil", "Where the GIL counts the times it changed hands.", 0, methods,
};

PyMODINIT_FUNC PyInit__gil(void)
{
    return PyModule_Create(&module);
}
