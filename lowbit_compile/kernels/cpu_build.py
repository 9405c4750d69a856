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

The cache degrades, never fails: a directory that cannot take a new library (read-only, full, a
library that will not load from it) is left, with one warning per process naming it and the fix, for
that private temporary one; a damaged key is replaced and the libraries signed with it removed.
Temporary files carry the host and pid of the process writing them and are removed when a build
fails; the first build of a process in a directory sweeps those of processes that are gone (or, of
another host or an older version, an hour old).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import errno
import fcntl
import functools
import hashlib
import hmac
import os
import platform
import re
import shutil
import socket
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
KEY_BYTES = 32
STALE_SECONDS = 3600  # a temporary file this old whose writer cannot be asked is left over: far beyond a compile
_LIBRARY_NAME = re.compile(r"[0-9a-f]{40}\.[0-9a-f]{64}\.so")  # <cache key>.<HMAC of its bytes>.so
# <what>+<host>+<pid>+<random><suffix>: a temporary file of ours, and who writes it
_TEMPORARY = re.compile(r"tmp\+(?P<host>[^+/]*)\+(?P<pid>[0-9]+)\+[^+/]*")
_OLD_TEMPORARY = re.compile(r"tmp[a-z0-9_]{8}(\.cpp|\.so)?")  # tempfile's names, as earlier versions named them

_loaded: dict[str, ctypes.CDLL] = {}
_building: dict[str, Future] = {}  # the builds under way, by cache key
_lock = threading.Lock()
_left: dict[Path, BaseException] = {}  # cache directories this process stopped building in, and why
_swept: set[Path] = set()
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
    why, fix = "this user has no home directory", _ELSEWHERE
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
    except _Untrusted as err:
        why, fix = str(err), err.fix
    except OSError as err:
        why, fix = str(err), _fix_for(Path(root), err)
    fallback = _private_dir()
    warnings.warn(f"lowbit-compile: not using the kernel cache {root}: {why}. Kernels are cached in {fallback} "
                  f"for this process only; {fix}", stacklevel=3)
    return fallback


_ELSEWHERE = "set $LOWBIT_COMPILE_CACHE_DIR to a directory only you can write"


class _Untrusted(Exception):
    """A cache directory or file that someone other than this user could have written."""

    def __init__(self, message: str, fix: str = _ELSEWHERE) -> None:
        super().__init__(message)
        self.fix = fix


@functools.cache
def _private_dir() -> Path:
    """This process's cache where the configured one is refused or faulty: a fresh private directory
    (0700, a name no one had), removed when the process that made it exits."""
    path = Path(tempfile.mkdtemp(prefix="lowbit_compile-"))
    atexit.register(_remove_private_dir, path, os.getpid())
    return path


def _remove_private_dir(path: Path, owner: int) -> None:
    if os.getpid() == owner:  # not in a forked child, whose parent may still use it
        shutil.rmtree(path, ignore_errors=True)


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


def _private_file(fd: int, path: Path, fix: str = _ELSEWHERE) -> None:
    """Refuse an open file that is not a regular file only this user can read and write."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        raise _Untrusted(f"{path} is not a file of this user's that only it can use (owner uid {st.st_uid}, "
                         f"mode {stat.filemode(st.st_mode)})", fix)


@functools.cache
def _secret(root: Path) -> bytes:
    """The directory's HMAC key (32 random bytes, 0600), made atomically by the first process to need it.
    A damaged one (of another length: truncated, emptied) is replaced, once, under a lock on the
    directory, and the libraries signed with it are removed (they are built again)."""
    path = root / "hmac.key"
    key = _read_key(path)
    if key is None:
        _write_key(root, path, replace=False)  # fails if another process made it first: its key stands
        key = _read_key(path)
    if key is not None and len(key) == KEY_BYTES:
        return key
    with _directory_lock(root):
        key = _read_key(path)  # another process may have replaced it meanwhile
        if key is None or len(key) != KEY_BYTES:
            found = "missing" if key is None else f"{len(key)} bytes, not {KEY_BYTES}"
            _write_key(root, path, replace=True)
            dropped = 0
            for entry in os.scandir(root):
                if _LIBRARY_NAME.fullmatch(entry.name):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(entry.path)
                        dropped += 1
            warnings.warn(f"lowbit-compile: the key of the kernel cache {root} was damaged ({path}: {found}); "
                          f"it was replaced and the {dropped} kernel libraries signed with it removed (they are "
                          "built again when needed)", stacklevel=4)
            key = _read_key(path)
    if key is None or len(key) != KEY_BYTES:
        raise _Untrusted(f"{path} is not a key this library wrote, and replacing it did not hold",
                         f"delete {path} (it is made again), or {_ELSEWHERE}")
    return key


def _read_key(path: Path) -> bytes | None:
    """The bytes of the key file (at most one more than a key), or None when there is none."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    with os.fdopen(fd, "rb") as f:
        _private_file(fd, path, f"delete {path} (it is made again), or {_ELSEWHERE}")
        return f.read(KEY_BYTES + 1)


def _write_key(root: Path, path: Path, replace: bool) -> None:
    """A new random key at ``path``: put in place atomically, over the old one if ``replace``, else only
    where there is none."""
    fd, tmp = tempfile.mkstemp(prefix=_temporary_prefix(), suffix=".key", dir=root)  # 0600
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(os.urandom(KEY_BYTES))
        if replace:
            os.replace(tmp, path)
        else:
            with contextlib.suppress(FileExistsError):
                os.link(tmp, path)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)


@contextlib.contextmanager
def _directory_lock(root: Path):
    """Hold an exclusive lock on ``root`` (released when the process dies) while repairing it."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


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
            future = _building[key] = _builder().submit(_load, key, cache_dir(), source, extra_flags)
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


def _load(key: str, root: Path, source: str, extra_flags: tuple[str, ...]) -> ctypes.CDLL:
    try:
        lib = _library(key, root, source, extra_flags)
        with _lock:
            _loaded[key] = lib
        return lib
    finally:
        with _lock:
            del _building[key]


def _library(key: str, root: Path, source: str, extra_flags: tuple[str, ...]) -> ctypes.CDLL:
    """The library of ``source`` from the cache ``root``, built there if it is not; where ``root`` cannot
    take it (or could not take one before, in this process), from this process's private directory,
    with one warning per directory naming it, why and the fix."""
    fault: BaseException | None = None
    try:
        lib = _open_cached(root / key)  # a directory left for new kernels still serves those it holds
        if lib is not None:
            return lib
        if root not in _left:
            return _build(key, root, source, extra_flags)
    except (OSError, BuildError) as err:
        fault = err
    private = _private_dir()
    if root == private:  # already the fallback (the configured cache was refused): nowhere else to go
        if isinstance(fault, BuildError):
            raise fault
        raise BuildError(f"a lowbit-compile CPU kernel could not be built in {root}: {fault}") from fault
    try:
        lib = _open_cached(private / key) or _build(key, private, source, extra_flags)
    except BuildError:
        raise  # the compiler fails wherever it runs: its own error says why
    except OSError as err:
        raise BuildError(f"a lowbit-compile CPU kernel could not be built in the kernel cache {root} "
                         f"({_reason(fault or _left[root])}) nor in {private}: {err}") from err
    if fault is not None:
        with _lock:
            first = root not in _left
            _left.setdefault(root, fault)
        if first:
            warnings.warn(f"lowbit-compile: the kernel cache {root} cannot take new kernels ({_reason(fault)}); "
                          f"this process builds them in {private}, removed when it exits. {_fix_for(root, fault)}",
                          stacklevel=2)
    return lib


def _open_cached(stem: Path) -> ctypes.CDLL | None:
    path = _cached(stem)
    return None if path is None else ctypes.CDLL(str(path))  # the directory is private: only this user wrote it


def _build(key: str, root: Path, source: str, extra_flags: tuple[str, ...]) -> ctypes.CDLL:
    _sweep(root)
    _compile(source, root / key, extra_flags)
    lib = _open_cached(root / key)
    if lib is None:
        raise BuildError(f"the kernel library just built in {root} was changed before it was loaded")
    return lib


def _reason(err: BaseException) -> str:
    """One line of why a directory failed: an OS error as it is, a compiler's failure by its last line."""
    text = str(err).strip()
    return text.splitlines()[-1] if isinstance(err, BuildError) and text else text


def _fix_for(root: Path, err: BaseException) -> str:
    """What a user does about ``err`` in the cache directory ``root``."""
    code = getattr(err, "errno", None)
    if code in (errno.EACCES, errno.EPERM, errno.EROFS):
        return f"Make {root} writable by this user, or set $LOWBIT_COMPILE_CACHE_DIR to a directory that is"
    if code in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return (f"Free space on the file system of {root}, or set $LOWBIT_COMPILE_CACHE_DIR to a directory on "
                "one with room")
    return (f"Check that {root} is writable, has free space and allows executables (not mounted noexec), or set "
            "$LOWBIT_COMPILE_CACHE_DIR to another directory")


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


@functools.cache
def _writer() -> str:
    """This machine in temporary names: its host name and pid namespace (pids are compared within one)."""
    host = re.sub(r"[^A-Za-z0-9.-]", "_", socket.gethostname())
    with contextlib.suppress(OSError):
        host += f"-{os.stat('/proc/self/ns/pid').st_ino}"
    return host


def _temporary_prefix() -> str:
    """The start of a temporary file's name: who writes it (``_sweep`` reads it back)."""
    return f"tmp+{_writer()}+{os.getpid()}+"


def _sweep(root: Path) -> None:
    """Remove, once per process and directory, the temporary files of builds that will never finish: those
    of a process of this machine that is gone, and those (of another machine sharing the directory, or of
    an earlier version) older than :data:`STALE_SECONDS`."""
    with _lock:
        if root in _swept:
            return
        _swept.add(root)
    writer, now = _writer(), time.time()
    with contextlib.suppress(OSError), os.scandir(root) as entries:
        for entry in entries:
            ours = _TEMPORARY.match(entry.name)
            if ours is None and not _OLD_TEMPORARY.fullmatch(entry.name):
                continue
            with contextlib.suppress(OSError):
                if ours is not None and ours["host"] == writer:
                    stale = not _alive(int(ours["pid"]))
                else:
                    stale = now - entry.stat(follow_symlinks=False).st_mtime > STALE_SECONDS
                if stale and entry.is_file(follow_symlinks=False):
                    os.unlink(entry.path)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _compile(source: str, stem: Path, extra_flags: tuple[str, ...]) -> None:
    """Build ``source`` into ``<stem>.<tag>.so`` (0700; the source beside it as ``<stem>.cpp``, 0600).
    Its temporary files are removed whether it succeeds or fails."""
    global compile_count, compile_seconds
    start = time.perf_counter()
    made: list[str] = []
    try:
        fd, tmp_src = tempfile.mkstemp(prefix=_temporary_prefix(), suffix=".cpp", dir=stem.parent)  # 0600
        made.append(tmp_src)
        with os.fdopen(fd, "w") as f:
            f.write(source)
        tmp_lib = f"{tmp_src[:-4]}.so"
        made.append(tmp_lib)
        cmd = [compiler(), *FLAGS, *extra_flags, tmp_src, "-o", tmp_lib]
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
        for leftover in made:
            with contextlib.suppress(OSError):
                os.unlink(leftover)
    with _lock:
        compile_count += 1
        compile_seconds += time.perf_counter() - start
