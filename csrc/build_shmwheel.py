"""Build script for the cffi extensions: ``shmwheel._shmwheel``, the core the
package ships, and ``shmwheel._shmwheel_testing``, the same sources built
with ``SHMW_TESTING`` for the test suite: a crash point before every store,
the test hooks of ``testing.h``, and the segment's structs in its cdef for
the white-box tests.  The shipped module has no test entry points.

setuptools builds the shipped one through ``cffi_modules`` in setup.py.
The tests' one is not shipped: tests/conftest.py builds it in place, into
the package's directory beside its sources (``build_in_place``), once per
CPython and again whenever a source is newer than it, so that the
processes the tests start import it too.  By hand, from anywhere::

    python csrc/build_shmwheel.py            # both modules, into shmwheel/
    python csrc/build_shmwheel.py --testing  # the tests' one only (bench/recovery.py needs it)

Each cdef is read from the headers themselves and names every constant
with ``...``, so that the compiler, not Python, supplies the value: a
header is the only place a declaration or a number is written down.
"""

import argparse
import os
import re
import shutil
import tempfile
from pathlib import Path

from cffi import FFI

CSRC = Path(__file__).resolve().parent
PACKAGE = CSRC.parent / "shmwheel"
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


def newest_source() -> float:
    """The modification time of the newest file a module is built from:
    the C sources and headers (not csrc/python/, the other extensions')
    and this script."""
    files = [*CSRC.glob("*.[ch]"), *(CSRC / "core").glob("*.[ch]"), Path(__file__)]
    return max(f.stat().st_mtime for f in files)


def build_in_place(builder: FFI, package: Path = PACKAGE, verbose: bool = False) -> Path:
    """Compile ``builder``'s module into the directory ``package``, named
    for the running CPython (``_shmwheel_testing.cpython-311-x86_64-linux-gnu.so``:
    that suffix is the one an import tries first), and return its path.

    cffi compiles in the directory it is given, relative source paths
    included, and leaves its C file and objects there: a temporary one,
    with a copy of csrc/.  The module is moved in whole, so that a process
    importing it meanwhile finds either none or all of it."""
    with tempfile.TemporaryDirectory(prefix="shmwheel-build-") as tmp:
        shutil.copytree(CSRC, Path(tmp) / "csrc", ignore=shutil.ignore_patterns("python", "*.o", "__pycache__"))
        built = Path(builder.compile(tmpdir=tmp, verbose=verbose))
        target = package / built.name
        staged = package / f".{built.name}.{os.getpid()}"
        shutil.copyfile(built, staged)
        os.chmod(staged, 0o755)
        os.replace(staged, target)
    return target


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Build the cffi modules into shmwheel/, for this CPython.")
    parser.add_argument("--testing", action="store_true", help="only the tests' module, shmwheel._shmwheel_testing")
    args = parser.parse_args()
    for builder in [testing_ffibuilder] if args.testing else [ffibuilder, testing_ffibuilder]:
        print(build_in_place(builder, verbose=True))
