"""Build script for the cffi extensions: ``shmwheel._shmwheel``, the core the
package ships, and ``shmwheel._shmwheel_testing``, the same sources built
with ``SHMW_TESTING`` for the test suite: a crash point before every store,
the test hooks of ``testing.h``, and the segment's structs in its cdef for
the white-box tests.  The shipped module has no test entry points.

setuptools finds both through ``cffi_modules`` in setup.py.  Each cdef is
read from the headers themselves and names every constant with ``...``,
so that the compiler, not Python, supplies the value: a header is the only
place a declaration or a number is written down.
"""

import re
from pathlib import Path

from cffi import FFI

CSRC = Path(__file__).resolve().parent
# Relative to the project's root, where setuptools builds.
CORE_SOURCES = sorted(f"csrc/core/{p.name}" for p in (CSRC / "core").glob("*.c"))
CFLAGS = ["-std=gnu11", "-O2", "-Wall", "-Wextra", "-fvisibility=hidden", "-fno-plt", "-flto"]
# The units are compiled apart and optimised together: the hot path
# crosses wheel.c, slab.c and lock.c, and link-time optimisation inlines it
# as if it were one file.  -fno-plt: a call into libc (the lock's) goes
# through its GOT entry, with no PLT stub, whose code line a worker's
# request would otherwise bring in cold (setup.py says the same for _fast).
LDFLAGS = ["-O2", "-flto"]


def _read(name: str) -> str:
    return (CSRC / name).read_text()


def _between_markers(text: str) -> str:
    return text[text.index("/* ---- cffi begin") : text.index("/* ---- cffi end")]


def constants(text: str) -> str:
    """Every ``#define SHMW_*`` with a value, as ``#define SHMW_* ...``."""
    names = re.findall(r"^#define (SHMW_\w+)\s+\S", text, flags=re.MULTILINE)
    return "".join(f"#define {name} ...\n" for name in names)


def declarations(text: str) -> str:
    """The declarations between the "cffi begin" and "cffi end" markers, as
    they stand, with array sizes given as ``...``."""
    return re.sub(r"\[SHMW_\w+\]", "[...]", _between_markers(text))


def partial_structs(text: str) -> str:
    """The structs between the markers as partial structs: attributes and
    the fields cffi cannot name (the mutex) dropped, and ``...;`` at the
    end of each, so that the compiler places the fields that are left."""
    body = declarations(text)
    body = re.sub(r"__attribute__\(\(\w+\(\d+\)\)\)", "", body)
    body = "\n".join(line for line in body.splitlines() if "pthread_" not in line)
    return re.sub(r"\n}\s*;", "\n    ...;\n};", body)


SHIPPED = _read("shmwheel.h")
RECORD = _read("record.h")  # the request record's numbers, for shmwheel.contrib
TESTING = _read("testing.h")
SEGMENT = _read("core/core.h")

ffibuilder = FFI()
ffibuilder.cdef(constants(SHIPPED) + constants(RECORD) + declarations(SHIPPED))
ffibuilder.set_source(
    "shmwheel._shmwheel",
    '#include "shmwheel.h"\n#include "record.h"',
    sources=CORE_SOURCES,
    include_dirs=["csrc"],
    extra_compile_args=CFLAGS,
    extra_link_args=LDFLAGS,
    libraries=["m", "pthread"],
)

testing_ffibuilder = FFI()
testing_ffibuilder.cdef(
    constants(SHIPPED)
    + constants(RECORD)
    + constants(SEGMENT)
    + constants(TESTING)
    + declarations(SHIPPED)
    + partial_structs(SEGMENT)
    + declarations(TESTING)
)
testing_ffibuilder.set_source(
    "shmwheel._shmwheel_testing",
    '#include "testing.h"\n#include "core/core.h"\n#include "record.h"',
    sources=[*CORE_SOURCES, "csrc/testing.c"],
    include_dirs=["csrc"],
    define_macros=[("SHMW_TESTING", None)],
    extra_compile_args=CFLAGS,
    extra_link_args=LDFLAGS,
    libraries=["m", "pthread"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
    testing_ffibuilder.compile(verbose=True)
