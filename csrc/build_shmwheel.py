"""Build script for the cffi extension ``shmwheel._shmwheel``.

setuptools finds it through ``cffi_modules`` in setup.py.  The cdef is read
from shmwheel.h itself, and names every constant with ``...`` so that the
compiler, not Python, supplies the value: the header is the only place a
declaration or a number is written down.
"""

import re
from pathlib import Path

from cffi import FFI

HEADER = Path(__file__).with_name("shmwheel.h")


def cdef_from_header(text: str) -> str:
    """The cdef, read from shmwheel.h so that nothing is declared twice.

    Every ``#define SHMW_*`` with a value becomes ``#define SHMW_* ...`` (the
    compiler supplies the number), and the declarations between the "cffi
    begin" and "cffi end" markers are taken as they stand, with array sizes
    given as ``...``.
    """
    names = re.findall(r"^#define (SHMW_\w+)\s+\S", text, flags=re.MULTILINE)
    begin = text.index("/* ---- cffi begin")
    end = text.index("/* ---- cffi end")
    body = re.sub(r"\[SHMW_\w+\]", "[...]", text[begin:end])
    return "\n".join(f"#define {name} ..." for name in names) + "\n" + SEGMENT_STRUCTS + body


# Partial views of the segment's own structs ("...;" lets the compiler fill
# in the rest), for the white-box tests that read or scribble on a segment.
SEGMENT_STRUCTS = """
struct shmw_header {
    uint64_t magic;
    uint32_t version;
    uint32_t capacity;
    uint32_t payload_size;
    uint32_t levels;
    uint32_t stride;
    uint64_t handle_key;
    uint64_t elapsed;
    uint32_t free_head;
    uint32_t free_count;
    uint32_t heap_len;
    uint32_t flags;
    uint32_t removed;
    int32_t  driver_pid;
    uint32_t driver_state;
    int64_t  driver_start;
    uint64_t sleep_until;
    uint32_t inflight_head;
    uint32_t inflight_tail;
    uint32_t inflight_unsent;
    uint32_t inflight;
    uint32_t wake_word;
    struct shmw_lane lanes[...];
    ...;
};
struct shmw_lane {
    uint32_t free_head;
    uint32_t free_count;
    ...;
};
struct shmw_bucket {
    uint64_t expires;
    uint32_t heap_pos;
    uint32_t lanes;
};
struct shmw_list {
    uint32_t head;
    uint32_t tail;
    uint32_t count;
};
struct shmw_entry {
    int64_t  deadline_ns;
    uint64_t generation;
    int64_t  fired_at_ns;
    uint32_t next;
    uint32_t prev;
    uint32_t bucket;
    uint8_t  state;
    uint8_t  flags;
    uint16_t producer;
    int32_t  owner_pid;
    uint32_t payload_len;
};
"""

ffibuilder = FFI()
ffibuilder.cdef(cdef_from_header(HEADER.read_text()))
ffibuilder.set_source(
    "shmwheel._shmwheel",
    '#include "shmwheel.h"',
    sources=["csrc/shmwheel.c"],
    include_dirs=["csrc"],
    extra_compile_args=["-std=gnu11", "-O2", "-Wall", "-Wextra", "-fvisibility=hidden"],
    libraries=["m", "pthread"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
