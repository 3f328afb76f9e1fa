# Everything else is in pyproject.toml; this file exists because
# cffi_modules is a setuptools keyword with no pyproject.toml spelling,
# and ext_modules has none either.
import glob

from setuptools import Extension, setup

setup(
    # The core the package ships.  The same with the test hooks,
    # shmwheel._shmwheel_testing, is not shipped: tests/conftest.py builds it.
    cffi_modules=["csrc/build_shmwheel.py:ffibuilder"],
    ext_modules=[
        # The worker's request timer on a path that keeps the GIL.  It links
        # none of the core: it calls the cffi module's, by the addresses that
        # module gives it (shmwheel/_wheel.py, Wheel.fast_core).  -fno-plt:
        # each call into the interpreter loads its address from the GOT,
        # with no PLT stub between: a request meets these calls with cold
        # caches, and the stubs were about 20 of the code lines it brought
        # in (bench/lines.py).
        # fast.c includes its parts (csrc/python/fast/), one compilation unit.
        Extension(
            "shmwheel._fast",
            sources=["csrc/python/fast.c"],
            depends=sorted(glob.glob("csrc/python/fast/*")) + ["csrc/record.h", "csrc/shmwheel.h"],
            include_dirs=["csrc"],
            # An interpreter API it needs and this CPython lacks is an error
            # here, not a module that fails at import.
            extra_compile_args=[
                "-std=gnu11", "-O2", "-Wall", "-Wextra", "-fvisibility=hidden", "-fno-plt",
                "-Werror=implicit-function-declaration",
            ],
        ),
        # Where the GIL counts the times it changed hands, for the worker's
        # gate before faulthandler's dump (csrc/core/signal.c): the one
        # module built with CPython's internal headers.
        Extension(
            "shmwheel._gil",
            sources=["csrc/python/gil.c"],
            extra_compile_args=["-std=gnu11", "-O2", "-Wall", "-Wextra", "-fvisibility=hidden"],
        ),
        # CPython 3.11's way to have a timed-out request's own thread check,
        # line by line, where it may be interrupted (3.12 and later have
        # sys.monitoring): off every request's path.
        Extension(
            "shmwheel._linetrace",
            sources=["csrc/python/linetrace.c"],
            extra_compile_args=["-std=gnu11", "-O2", "-Wall", "-Wextra", "-fvisibility=hidden"],
        ),
    ],
)
