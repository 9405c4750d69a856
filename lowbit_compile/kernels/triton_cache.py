"""Triton's on-disk kernel cache (``$TRITON_CACHE_DIR``, else ``~/.triton/cache``) made to degrade, as
ours does (``cpu_build``): where it cannot take a file, this process caches its Triton kernels in a
private temporary directory instead, with one warning naming the directory and the fix.

Triton writes its cache when it compiles, which a launch can do too (a new specialization), so the
directory is tried once before the first kernel of this process is compiled, and a compile that still
fails on a file operation is retried once in the private directory.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import glob
import os
import shutil
import tempfile
import threading
import warnings
from collections.abc import Callable
from typing import TypeVar

import triton

T = TypeVar("T")
_lock = threading.Lock()
_tried = False
_private: str | None = None  # the directory this process took instead of Triton's, once it took one


def compiling(compile: Callable[[], T]) -> T:
    """``compile()`` (a Triton compile) with Triton's cache known to take files, or in a private one."""
    global _tried
    with _lock:
        if not _tried:
            _tried = True
            directory = triton.knobs.cache.dir
            try:
                os.makedirs(directory, exist_ok=True)
                fd, probe = tempfile.mkstemp(prefix="tmp.lowbit-probe.", dir=directory)
                os.close(fd)
                os.unlink(probe)
            except OSError as err:
                _leave(directory, err)
    try:
        return compile()
    except OSError as err:
        with _lock:
            if _private is not None:
                raise
            _leave(triton.knobs.cache.dir, err)
        return compile()


def _leave(directory: str, err: OSError) -> None:
    """Point Triton at a private directory for the rest of this process, removing what this process left
    half-written in ``directory``, with one warning."""
    global _private
    for leftover in glob.glob(os.path.join(glob.escape(directory), "*", f"tmp.pid_{os.getpid()}_*")):
        shutil.rmtree(leftover, ignore_errors=True)
    _private = tempfile.mkdtemp(prefix="lowbit_compile-triton-")
    atexit.register(_remove, _private, os.getpid())
    triton.knobs.cache.dir = _private
    if err.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        fix = f"free space on the file system of {directory}"
    else:
        fix = f"make {directory} a directory this user can write"
    warnings.warn(f"lowbit-compile: Triton's kernel cache {directory} cannot take new kernels ({err}); this process "
                  f"caches them in {_private}, removed when it exits. Fix: {fix}, or set $TRITON_CACHE_DIR to "
                  "one that is", stacklevel=3)


def _remove(path: str, owner: int) -> None:
    if os.getpid() == owner:  # not in a forked child, whose parent may still use it
        with contextlib.suppress(OSError):
            shutil.rmtree(path)
