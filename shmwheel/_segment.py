"""Segments: a wheel's name, where its file lives, how one is opened, and
the look at /dev/shm that tells a wheel from any other program's segment.

posix_ipc makes and opens the shared-memory objects; their errors come out
here in shmwheel's words.
"""

from __future__ import annotations

import errno
import os
import re
import stat
import struct
from pathlib import Path

import posix_ipc

from ._binding import lib
from ._errors import IncompatibleSegmentError, SegmentNotFoundError

__all__ = ["MAGIC", "SHM", "SegmentFile", "bare_name", "open_segment", "segment_name", "wheel_stat"]

_NAME = re.compile(r"[A-Za-z0-9._-]{1,200}")


def segment_name(name: object) -> str:
    """The posix_ipc name for a wheel name, or a clear error."""
    if not isinstance(name, str):
        raise TypeError(f"a wheel name is a str, not {type(name).__name__}")
    bare = name[1:] if name.startswith("/") else name
    if not _NAME.fullmatch(bare) or bare in (".", ".."):
        raise ValueError(
            f"invalid wheel name {name!r}: use 1-200 characters of A-Z a-z 0-9 . _ - "
            "(a leading / is allowed and ignored)"
        )
    return "/" + bare


def bare_name(name: str) -> str:
    return segment_name(name)[1:]


# Where Linux keeps POSIX shared memory, and how a wheel's segment begins
# (the magic, stored in host byte order, last at create).
SHM = Path("/dev/shm")
MAGIC = struct.pack("=Q", lib.SHMW_MAGIC)


def wheel_stat(name: str) -> os.stat_result | None:
    """The stat of /dev/shm/NAME (a bare name) if it begins with the
    shmwheel magic, else None: what the command line and the servers'
    ``create_wheel`` ask before they remove a segment.

    Reads 8 bytes through a file descriptor and maps nothing, so it is safe to
    point at any other program's segment.  OSError if it cannot be read.
    """
    fd = os.open(SHM / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        return st if stat.S_ISREG(st.st_mode) and os.pread(fd, 8, 0) == MAGIC else None
    finally:
        os.close(fd)


def open_segment(shm_name: str) -> posix_ipc.SharedMemory:
    """shm_open(3) of an existing segment, its errors in shmwheel's words."""
    try:
        return posix_ipc.SharedMemory(shm_name)
    except posix_ipc.ExistentialError:
        raise SegmentNotFoundError(errno.ENOENT, f"no shmwheel segment named {shm_name[1:]!r}", shm_name) from None
    except posix_ipc.PermissionsError as exc:
        raise PermissionError(errno.EACCES, f"cannot open segment {shm_name[1:]!r}: {exc}") from None
    except (posix_ipc.Error, ValueError, OSError):
        # A directory (posix_ipc says only "Invalid parameter(s)"), a
        # symbolic link (ELOOP: shm_open does not follow them)...
        try:
            regular = stat.S_ISREG(os.lstat(SHM / shm_name[1:]).st_mode)
        except OSError:
            regular = True  # gone meanwhile: the error as it was
        if regular:
            raise
        raise IncompatibleSegmentError(
            f"segment {shm_name[1:]!r} is not a shmwheel segment: not a regular file"
        ) from None


class SegmentFile:
    """A segment's file descriptor, closed with its owner or when collected:
    a Wheel dropped without close() (a replaced wheel a worker lets go) must
    not leak one, or a long-lived worker runs out of them."""

    __slots__ = ("fd",)

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def close(self) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)

    def __del__(self) -> None:
        self.close()
