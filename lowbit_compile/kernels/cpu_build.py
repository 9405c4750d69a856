"""Compile emitted C++ kernels into shared libraries, once per source, cached on disk across processes.

The toolchain is the one inductor uses for its CPU kernels: the C++ compiler it would pick (``$CXX``,
else ``g++``), ``-O3 -march=native``, OpenMP resolved to the ``libgomp`` torch already loaded, and
inductor's cache directory (``$TORCHINDUCTOR_CACHE_DIR``, by default ``/tmp/torchinductor_$USER``),
under ``lowbit_compile/``. ``$LOWBIT_COMPILE_CACHE_DIR`` overrides the location.

Unlike inductor's defaults this keeps IEEE semantics: no fast-math, and ``-ffp-contract=off`` so the
only FMAs are the ones the kernel asks for (to round exactly like aten). A library is keyed by the
hash of its source, the flags, the compiler binary and the CPU's feature flags, and written
atomically, so concurrent processes never load a half-written file. A warm process loads it
without invoking the compiler (and without importing inductor). ``load_async`` runs the compiler in a
background thread, so the kernels of one step compile at the same time.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import time
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
    override = os.environ.get("LOWBIT_COMPILE_CACHE_DIR")
    if override:
        root = Path(override)
    else:
        from torch._inductor.runtime.cache_dir_utils import cache_dir as inductor_cache_dir

        root = Path(inductor_cache_dir()) / "lowbit_compile"
    root.mkdir(parents=True, exist_ok=True)
    return root


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
            future = _building[key] = _builder().submit(_load, key, cache_dir() / f"{key}.so", source, extra_flags)
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


def _load(key: str, lib_path: Path, source: str, extra_flags: tuple[str, ...]) -> ctypes.CDLL:
    try:
        if not lib_path.exists():
            _compile(source, lib_path, extra_flags)
        lib = ctypes.CDLL(str(lib_path))
        with _lock:
            _loaded[key] = lib
        return lib
    finally:
        with _lock:
            del _building[key]


def _compile(source: str, lib_path: Path, extra_flags: tuple[str, ...]) -> None:
    global compile_count, compile_seconds
    start = time.perf_counter()
    src_path = lib_path.with_suffix(".cpp")
    fd, tmp_src = tempfile.mkstemp(suffix=".cpp", dir=lib_path.parent)
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
        os.replace(tmp_src, src_path)  # kept next to the library for reading and debugging
        os.replace(tmp_lib, lib_path)
    finally:
        for leftover in (tmp_src, tmp_lib):
            if os.path.exists(leftover):
                os.unlink(leftover)
    with _lock:
        compile_count += 1
        compile_seconds += time.perf_counter() - start
