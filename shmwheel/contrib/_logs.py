"""The server's log, as a driver process writes to it.

A driver runs in a process of its own (started by Gunicorn's master, or by
the first ASGI worker that finds none), so it cannot use the server's
logging objects; it is told where the server writes its errors and in what
format instead, and writes its lines there itself.  :class:`LogTarget`
is that description: taken from a logger of the server (Gunicorn's error
log, ``uvicorn.error``, ``hypercorn.error``), passed on the driver's
command line, and turned back into a handler there.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import io
import logging
import logging.handlers
import os
import stat
import sys
import time
from dataclasses import dataclass

__all__ = ["LogTarget"]

PREFIX = "shmwheel: "


@dataclass(frozen=True)
class LogTarget:
    """Where and how a server logs its errors, as a driver process can reproduce it."""

    path: str | None  #: the log file, or None for stderr (which the driver shares with the server)
    fmt: str | None  #: the format string, "%"-style
    datefmt: str | None
    formatter: str | None  #: the formatter's class as "module:qualname", if not logging.Formatter

    @classmethod
    def of(cls, logger: logging.Logger) -> LogTarget | None:
        """The target of the first handler of ``logger`` (or of the loggers
        it propagates to) that writes to a file or to stderr; None if none does."""
        current: logging.Logger | None = logger
        while current is not None:
            for handler in current.handlers:
                target = cls._of_handler(handler)
                if target is not None:
                    return target
            current = current.parent if current.propagate else None
        return None

    @classmethod
    def _of_handler(cls, handler: logging.Handler) -> LogTarget | None:
        if isinstance(handler, logging.FileHandler):
            path: str | None = handler.baseFilename
        elif isinstance(handler, logging.StreamHandler) and handler.stream in (sys.stderr, sys.__stderr__):
            path = None
        else:
            return None
        formatter = handler.formatter
        if formatter is None:
            return cls(path, None, None, None)
        style = getattr(formatter, "_style", None)
        if type(style) is not logging.PercentStyle:  # "{" and "$" styles derive from it
            return cls(path, None, None, None)  # a format the command line does not carry: the default one
        kind = type(formatter)
        name = None if kind is logging.Formatter else f"{kind.__module__}:{kind.__qualname__}"
        if kind.__module__ == "__main__":
            name = None
        return cls(path, style._fmt, formatter.datefmt, name)

    def as_args(self) -> list[str]:
        """The driver command's arguments that carry this target."""
        args = ["--log-to=" + (self.path or "stderr")]
        if self.fmt is not None:
            args.append("--log-format=" + self.fmt)
        if self.datefmt is not None:
            args.append("--log-datefmt=" + self.datefmt)
        if self.formatter is not None:
            args.append("--log-formatter=" + self.formatter)
        return args

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            "--log-to",
            metavar="FILE|stderr",
            help="write the log there, in the format the --log-* options give, each line headed 'shmwheel: ' "
            "(the server's error log: the server adapters pass their server's)",
        )
        parser.add_argument("--log-format", metavar="FMT", help=argparse.SUPPRESS)
        parser.add_argument("--log-datefmt", metavar="FMT", help=argparse.SUPPRESS)
        parser.add_argument("--log-formatter", metavar="MODULE:CLASS", help=argparse.SUPPRESS)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> LogTarget | None:
        if args.log_to is None:
            return None
        return cls(None if args.log_to == "stderr" else args.log_to, args.log_format, args.log_datefmt,
                   args.log_formatter)  # fmt: skip

    def handler(self) -> logging.Handler:
        """A handler that writes as the server does.  A file is reopened when
        it is rotated (moved or removed): the server reopens its own then."""
        handler: logging.Handler
        if self.path is None:
            handler = logging.StreamHandler(sys.stderr)
        else:
            handler = ServerLogFile(self.path)
        handler.setFormatter(self._formatter())
        handler.addFilter(_prefix)
        return handler

    def _formatter(self) -> logging.Formatter:
        try:
            return self._server_formatter()
        except ValueError:  # a format no formatter takes: the driver's own, rather than no driver
            return logging.Formatter()

    def _server_formatter(self) -> logging.Formatter:
        if self.formatter is not None:
            module, _, qualname = self.formatter.partition(":")
            try:
                kind: object = importlib.import_module(module)
                for part in qualname.split("."):
                    kind = getattr(kind, part)
                if isinstance(kind, type) and issubclass(kind, logging.Formatter):
                    return kind(fmt=self.fmt, datefmt=self.datefmt)
            except Exception:  # noqa: BLE001 - the server's own formatter, or the plain one with its format
                pass
        return logging.Formatter(self.fmt, self.datefmt)


class ServerLogFile(logging.handlers.WatchedFileHandler):
    """The server's log file, as the driver writes to it: opened for append
    where the server opened it, and opened again once logrotate has moved
    it, as the server does on its own signal.

    The first open is the server's own, by the same user, moments after it
    (a root master's, before the driver drops to the workers' user): it
    follows a symbolic link as the server did.  A reopen never does: it
    comes after a rotation, when whoever may write the log's directory
    could have put a link where the file was, and it may run as root (nor
    does it open anything but a regular file: a FIFO put there would hold
    the driver until someone read it).  A
    file the reopen creates (logrotate's ``nocreate``) gets mode 0640 less
    the umask.  A reopen that fails (after the drop, a new file the
    workers' user may not write; a link) leaves the driver writing to the
    file it has, rotated, and says so once on stderr, which the server
    keeps; it is tried again a minute later."""

    #: How long after a failed reopen the next is tried.
    RETRY = 60.0

    def __init__(self, path: str) -> None:
        self._reopening = False
        self._retry_at = 0.0
        self._said = False
        super().__init__(path, encoding="utf-8")

    def _open(self) -> io.TextIOWrapper:
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC
        if self._reopening:
            # Not through a link, and not into a FIFO (whose open would wait
            # for a reader, the handler's lock held, and hand it every line).
            flags |= os.O_NOFOLLOW | os.O_NONBLOCK
        fd = os.open(self.baseFilename, flags, 0o640)
        try:
            if self._reopening:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    raise OSError(errno.EINVAL, "not a regular file")
                os.set_blocking(fd, True)
            return open(fd, "a", encoding=self.encoding, errors=self.errors)  # noqa: SIM115 - the handler's stream
        except BaseException:
            os.close(fd)
            raise

    def reopenIfNeeded(self) -> None:  # noqa: N802 - logging's name
        """Before each line: if the path names another file than the one
        open (moved, removed, replaced), open the path, and only then let go
        of the old one."""
        if time.monotonic() < self._retry_at:
            return
        try:
            now = os.stat(self.baseFilename)
        except FileNotFoundError:
            now = None
        if now is not None and (now.st_dev, now.st_ino) == (self.dev, self.ino):
            return
        self._reopening = True
        try:
            stream = self._open()
        except OSError as exc:
            self._retry_at = time.monotonic() + self.RETRY
            if not self._said:
                self._said = True
                print(
                    f"shmwheel: driver {os.getpid()}: cannot open {self.baseFilename} again after it was rotated, "
                    f"as uid {os.geteuid()}: {exc.strerror or exc}; writing on to the rotated file.  Have it "
                    f"created for this user (logrotate's create MODE USER GROUP), or rotate with copytruncate",
                    file=sys.stderr,
                    flush=True,
                )
            return
        old, self.stream = self.stream, stream
        if old is not None:
            old.flush()
            old.close()
        self._statstream()
        self._said = False


def _prefix(record: logging.LogRecord) -> bool:
    """Head each line with "shmwheel: ", which the server's format may not name."""
    message = record.getMessage()
    if not message.startswith(PREFIX):
        record.msg, record.args = PREFIX + message, None
    return True
