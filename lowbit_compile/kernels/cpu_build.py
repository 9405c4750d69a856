"""Compile emitted C++ kernels into shared libraries, once per source, cached on disk across processes.

The toolchain is the one inductor uses for its CPU kernels: the C++ compiler it would pick (``$CXX``,
else ``g++``), ``-O3 -march=native``, OpenMP resolved to the ``libgomp`` torch already loaded.

Unlike inductor's defaults this keeps IEEE semantics: no fast-math, and ``-ffp-contract=off`` so the
only FMAs are the ones the kernel asks for (to round exactly like aten). A library is keyed by the
hash of its source, the flags, the compiler binary and the CPU's feature flags, and written
atomically, so concurrent processes never load a half-written file. A warm process loads it
without invoking the compiler (and without importing inductor). ``load_async`` runs the compiler in a
background thread, so the kernels of one step compile at the same time.

The cache loads only what this user built, since loading a library runs its code: it is a private
directory (``$LOWBIT_COMPILE_CACHE_DIR``, else ``$XDG_CACHE_HOME/lowbit_compile``, else
``~/.cache/lowbit_compile``; made 0700 if absent), refused with a warning, for a fresh private one
that lives as long as the process, if it or a directory above it is another user's or writable by
others (a sticky one like ``/tmp`` aside); files are written 0600 (0700 for libraries), and each
library's name carries an HMAC of its bytes under a key of the directory's own (0600), checked before
it is loaded: a library changed or planted after it was written is rebuilt.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import functools
import hashlib
import hmac
import os
import platform
import shutil
import stat
import subprocess
import tempfile
import threading
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from .kernel import BuildError

FLAGS = (
    "-O3", "-DNDEBUG", "-march=native", "-std=c++17", "-shared", "-fPIC", "-fopenmp",
    "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=off",
)

_loaded: dict[str, ctypes.CDLL] = {}
_building: dict[str, Future] = {}  # the builds under way, by cache key
_lock = threading.Lock()
compile_count = 0  # compilations in this process (a warm cache keeps it at 0)
compile_seconds = 0.0


@functools.cache
def compiler() -> str:
    name = os.environ.get("CXX", "g++")
    path = shutil.which(name)
    if path is None:
        raise BuildError(f"no C++ compiler found ({name!r}); install g++ or set $CXX, or use backend='reference'")
    return os.path.realpath(path)


@functools.cache
def _machine_fingerprint() -> str:
    """What -march=native depends on: the CPU's feature flags (and model), plus the compiler binary."""
    cpu = platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("flags", "model name", "Features", "CPU part"))]
        cpu += "".join(sorted(set(lines)))
    except OSError:
        cpu += platform.processor()
    cxx = compiler()
    stat = os.stat(cxx)
    return f"{cpu}|{cxx}|{stat.st_size}|{stat.st_mtime_ns}"


def cache_dir() -> Path:
    """The directory kernels are cached in: the configured one if only this user can change it, else a
    fresh private one (with a warning naming the one refused)."""
    configured = os.environ.get("LOWBIT_COMPILE_CACHE_DIR")
    if not configured:
        xdg, home = os.environ.get("XDG_CACHE_HOME", ""), os.path.expanduser("~")
        base = xdg if os.path.isabs(xdg) else os.path.join(home, ".cache") if os.path.isabs(home) else None
        configured = os.path.join(base, "lowbit_compile") if base else None
    return _trusted_dir(configured)


@functools.cache
def _trusted_dir(configured: str | None) -> Path:
    root: Path | str = "~/.cache/lowbit_compile"
    why = "this user has no home directory"
    try:
        if configured is not None:
            root = Path(configured)
            for path in (*reversed(root.parents), root):  # what is missing made private, as XDG asks
                if os.path.lexists(path):
                    continue
                with contextlib.suppress(FileExistsError):
                    os.mkdir(path, 0o700)  # atomic: made private by this call, or already there (checked below)
                    os.chmod(path, 0o700)  # whatever the umask
            root = Path(os.path.realpath(root))
            why = _not_private(root)
            if why is None:
                _secret(root)
                return root
    except (OSError, _Untrusted) as err:
        why = str(err)
    fallback = Path(tempfile.mkdtemp(prefix="lowbit_compile-"))  # 0700, a name no one had
    atexit.register(shutil.rmtree, fallback, ignore_errors=True)
    warnings.warn(f"lowbit-compile: not using the kernel cache {root}: {why}. Kernels are cached in {fallback} "
                  "for this process only; set $LOWBIT_COMPILE_CACHE_DIR to a directory only you can write",
                  stacklevel=3)
    return fallback


class _Untrusted(Exception):
    """A cache directory or file that someone other than this user could have written."""


def _not_private(root: Path) -> str | None:
    """Why someone other than this user could change what ``root`` (a resolved path) holds, or None: it
    or a directory above it is another user's (root's aside) or writable by others without the sticky
    bit, which keeps them from renaming what is not theirs."""
    user = os.geteuid()
    st = os.stat(root)
    if not stat.S_ISDIR(st.st_mode):
        return "it is not a directory"
    if st.st_uid != user:
        return f"it is owned by uid {st.st_uid}, not by this user (uid {user})"
    if st.st_mode & 0o022:
        return f"others can write to it (mode {stat.filemode(st.st_mode)})"
    for parent in root.parents:
        st = os.stat(parent)
        if st.st_uid not in (0, user):
            return f"{parent}, above it, is owned by uid {st.st_uid}"
        if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            return f"others can write to {parent}, above it (mode {stat.filemode(st.st_mode)})"
    return None


def _private_file(fd: int, path: Path) -> None:
    """Refuse an open file that is not a regular file only this user can read and write."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        raise _Untrusted(f"{path} is not a file of this user's that only it can use (owner uid {st.st_uid}, "
                         f"mode {stat.filemode(st.st_mode)})")


@functools.cache
def _secret(root: Path) -> bytes:
    """The directory's HMAC key (32 random bytes, 0600), made atomically by the first process to need it."""
    path = root / "hmac.key"
    if not path.exists():
        fd, tmp = tempfile.mkstemp(dir=root)  # 0600
        with os.fdopen(fd, "wb") as f:
            f.write(os.urandom(32))
        try:
            os.link(tmp, path)  # fails if another process made it first: its key stands
        except FileExistsError:
            pass
        finally:
            os.unlink(tmp)
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd, "rb") as f:
        _private_file(fd, path)
        key = f.read()
    if len(key) != 32:
        raise _Untrusted(f"{path} is not a key this library wrote")
    return key


def _tag(root: Path, data: bytes) -> str:
    return hmac.new(_secret(root), data, hashlib.sha256).hexdigest()


def cache_key(source: str, extra_flags: tuple[str, ...] = ()) -> str:
    h = hashlib.sha256()
    for part in (source, " ".join(FLAGS + extra_flags), _machine_fingerprint()):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:40]


def load(source: str, extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL:
    """The shared library built from ``source``, compiled if no process has built it before."""
    return load_async(source, extra_flags).result()


def load_async(source: str, extra_flags: tuple[str, ...] = ()) -> Future[ctypes.CDLL]:
    """:func:`load` with the compiler running in a background thread while the caller goes on; one
    build per source however many threads ask for it (a failed one is retried by the next call)."""
    key = cache_key(source, extra_flags)
    with _lock:
        lib = _loaded.get(key)
        if lib is not None:
            done: Future[ctypes.CDLL] = Future()
            done.set_result(lib)
            return done
        future = _building.get(key)
        if future is None:
            future = _building[key] = _builder().submit(_load, key, cache_dir() / key, source, extra_flags)
    return future


@functools.cache
def _builder() -> ThreadPoolExecutor:
    """The threads that wait for compilers: as many as CPUs, each compiler being one process."""
    return ThreadPoolExecutor(max_workers=os.cpu_count() or 1, thread_name_prefix="lowbit-cxx")


def _forget_builds() -> None:
    """In a forked child: the parent's builder threads and builds under way do not exist here."""
    global _lock
    _lock = threading.Lock()
    _building.clear()
    _builder.cache_clear()


os.register_at_fork(after_in_child=_forget_builds)


def _load(key: str, stem: Path, source: str, extra_flags: tuple[str, ...]) -> ctypes.CDLL:
    try:
        path = _cached(stem)
        if path is None:
            _compile(source, stem, extra_flags)
            path = _cached(stem)
            if path is None:
                raise BuildError(f"the kernel library just built in {stem.parent} was changed before it was loaded")
        lib = ctypes.CDLL(str(path))  # the directory is private: only this user could change it since
        with _lock:
            _loaded[key] = lib
        return lib
    finally:
        with _lock:
            del _building[key]


def _cached(stem: Path) -> Path | None:
    """The library this user built for ``stem`` (``<stem>.<HMAC of its bytes>.so``), or None. Any other
    file of that name (changed after it was written, or someone else's) is removed with a warning."""
    for path in sorted(stem.parent.glob(f"{stem.name}.*.so")):
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
            with os.fdopen(fd, "rb") as f:
                _private_file(fd, path)
                if hmac.compare_digest(path.name.split(".")[1], _tag(stem.parent, f.read())):
                    return path
            why = "its bytes are not the ones written (changed since, or not written by this library)"
        except (OSError, _Untrusted) as err:
            why = str(err)
        warnings.warn(f"lowbit-compile: not loading the kernel library {path}: {why}; building it again",
                      stacklevel=2)
        with contextlib.suppress(OSError):
            path.unlink()
    return None


def _compile(source: str, stem: Path, extra_flags: tuple[str, ...]) -> None:
    """Build ``source`` into ``<stem>.<tag>.so`` (0700; the source beside it as ``<stem>.cpp``, 0600)."""
    global compile_count, compile_seconds
    start = time.perf_counter()
    fd, tmp_src = tempfile.mkstemp(suffix=".cpp", dir=stem.parent)  # 0600
    with os.fdopen(fd, "w") as f:
        f.write(source)
    tmp_lib = f"{tmp_src[:-4]}.so"
    cmd = [compiler(), *FLAGS, *extra_flags, tmp_src, "-o", tmp_lib]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            errors = [line[:300] for line in done.stderr.splitlines() if "error" in line][:10]
            raise BuildError("compiling a lowbit-compile CPU kernel failed:\n" + " ".join(cmd) + "\n"
                               + "\n".join(errors))
        os.chmod(tmp_lib, 0o700)
        with open(tmp_lib, "rb") as f:
            tag = _tag(stem.parent, f.read())
        os.replace(tmp_src, f"{stem}.cpp")  # kept next to the library for reading and debugging
        os.replace(tmp_lib, f"{stem}.{tag}.so")
    finally:
        for leftover in (tmp_src, tmp_lib):
            if os.path.exists(leftover):
                os.unlink(leftover)
    with _lock:
        compile_count += 1
        compile_seconds += time.perf_counter() - start
