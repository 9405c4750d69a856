"""The kernel cache degrades, never fails: a read-only or full cache directory, a compile killed half way
and a damaged key each leave the step running (on a private temporary cache, or the reference), with one
warning naming the directory and the fix, and no temporary file behind.

The faults are real ones: a directory this user cannot write (the test drops root's privileges, since root
writes anywhere), a tiny tmpfs (or, where mounting is not allowed, a file-size limit), a compiler process
group killed with SIGKILL."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from lowbit_compile.kernels import cpu_build

ROOT = Path(__file__).resolve().parents[1]
NOBODY = 65534
ANSWER = 'extern "C" int lowbit_answer(void) {{ return {}; }}\n'

# One child process: two formats stepped on the reference (which imports everything a step needs while this
# user can still read this Python's files), then, as the user given, on the backend asked for; it prints
# the warnings, the compilations and how far each result is from the reference's.
_CHILD = r"""
import json, os, resource, signal, sys, warnings
import torch
torch.set_num_threads(1)
from lowbit_compile import lowbit_compile
from lowbit_compile.kernels import backends, cpp_printer, cpu, cpu_build  # noqa: F401

def train(fmt, backend):
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(64, 80))
    opt = lowbit_compile(torch.optim.AdamW([p], lr=0.01), fmt, min_8bit_size=0, backend=backend)
    for _ in range(2):
        p.grad = torch.ones_like(p)
        opt.step()
    return p.detach()

formats = ["fp32", "int8"]
reference = [train(fmt, "reference") for fmt in formats]
uid, fsize = int(os.environ.get("TEST_AS_UID", "-1")), int(os.environ.get("TEST_FSIZE", "0"))
if uid >= 0:
    os.setgid(uid)
    os.setuid(uid)
if fsize:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG, as on a full disk
    resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    diffs = [(train(fmt, sys.argv[1]) - ref).abs().max().item() for fmt, ref in zip(formats, reference)]
print(json.dumps({"warnings": [str(w.message) for w in caught], "compiles": cpu_build.compile_count,
                  "diffs": diffs}))
"""


def run_child(cache: Path, backend: str, **env: str) -> dict:
    done = subprocess.run([sys.executable, "-c", _CHILD, backend], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "LOWBIT_COMPILE_CACHE_DIR": str(cache), "TMPDIR": "/tmp",
                                            "OMP_NUM_THREADS": "1", **env})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.fixture
def shared_tmp():
    """A directory every user can reach (pytest's tmp_path is root's alone), removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix="lowbit-cache-test-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def cache_with_key(parent: Path, owner: int) -> Path:
    """A private cache directory that already holds its key, as a run before this one left it."""
    cache = parent / "cache"
    cache.mkdir(mode=0o700)
    key = cache / "hmac.key"
    key.write_bytes(os.urandom(32))
    key.chmod(0o600)
    if owner != os.geteuid():
        os.chown(cache, owner, owner)
        os.chown(key, owner, owner)
    return cache


def cache_warnings(result: dict, cache: Path) -> list[str]:
    return [w for w in result["warnings"] if str(cache) in w]


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["auto", "cpu"])
def test_a_read_only_cache_holding_its_key_builds_in_a_private_one_with_one_warning(shared_tmp, backend):
    """Two kernels are built in a private directory instead; one warning names the cache and the fix; the
    cache is as it was. With backend="cpu" as with "auto": the C++ kernel still runs, only cached elsewhere."""
    user = NOBODY if os.geteuid() == 0 else os.geteuid()  # root writes anywhere: the child becomes nobody
    cache = cache_with_key(shared_tmp, user)
    cache.chmod(0o500)
    result = run_child(cache, backend, TEST_AS_UID=str(user) if user != os.geteuid() else "-1")
    assert result["compiles"] == 2 and result["diffs"][0] == 0.0 and result["diffs"][1] < 1e-3
    [warning] = cache_warnings(result, cache)
    assert "cannot take new kernels" in warning and f"Make {cache} writable" in warning
    assert sorted(p.name for p in cache.iterdir()) == ["hmac.key"]


def _mount_tmpfs(path: Path, size: str) -> bool:
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    path.mkdir()
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)],
                          capture_output=True).returncode == 0


@pytest.mark.slow
@pytest.mark.parametrize("how", ["tmpfs", "file-size limit"])
def test_a_full_cache_disk_leaves_no_temporary_file_and_the_step_runs(shared_tmp, how):
    """A cache on an 8 KiB tmpfs (room for its key, not for a kernel's source): the kernels are built in a
    private directory, with one warning naming the cache and the fix, and nothing half-written stays to
    keep the disk full. Under a file-size limit (where mounting is not allowed) every directory is "full":
    the step runs on the reference, and the cache holds no temporary file either."""
    if how == "tmpfs":
        cache = shared_tmp / "cache"
        if not _mount_tmpfs(cache, "8k"):
            pytest.skip("mounting a tmpfs needs root with CAP_SYS_ADMIN; the file-size limit case runs instead")
        try:
            key = cache / "hmac.key"
            key.write_bytes(os.urandom(32))
            key.chmod(0o600)
            result = run_child(cache, "auto")
            left = sorted(p.name for p in cache.iterdir())
        finally:
            subprocess.run(["umount", str(cache)], check=True)
        assert result["compiles"] == 2 and result["diffs"][0] == 0.0
        [warning] = cache_warnings(result, cache)
        assert "No space left on device" in warning and f"Free space on the file system of {cache}" in warning
    else:
        cache = cache_with_key(shared_tmp, os.geteuid())
        result = run_child(cache, "auto", TEST_FSIZE=str(16 * 1024))
        left = sorted(p.name for p in cache.iterdir())
        assert result["compiles"] == 0 and max(result["diffs"]) < 1e-3  # the reference stepped
        warnings = cache_warnings(result, cache)
        assert warnings and all("File too large" in w for w in warnings)
        assert any("runs on the eager reference" in w for w in warnings)
    assert left == ["hmac.key"]


_SLOW_COMPILER = """#!/bin/sh
sleep 120
exec g++ "$@"
"""


@pytest.mark.slow
def test_the_next_build_sweeps_what_a_killed_compile_left(tmp_path, monkeypatch):
    """A process killed (SIGKILL, with its compiler) while it builds leaves its temporary source; the next
    build in that cache removes it, and what may still be in use stays: another live process's, another
    machine's (a shared home) and an older version's, unless an hour old."""
    cache = tmp_path / "cache"
    compiler = tmp_path / "slow-g++"
    compiler.write_text(_SLOW_COMPILER)
    compiler.chmod(0o755)
    env = {**os.environ, "LOWBIT_COMPILE_CACHE_DIR": str(cache), "CXX": str(compiler)}
    code = f"from lowbit_compile.kernels import cpu_build; cpu_build.load({ANSWER.format(1)!r})"
    child = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not list(cache.glob("tmp*.cpp")) and time.monotonic() < deadline and child.poll() is None:
            time.sleep(0.05)
        [stale] = cache.glob("tmp*.cpp")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGKILL)  # the child and the compiler it started
        child.wait()
    old = time.time() - 2 * cpu_build.STALE_SECONDS
    kept = [f"tmp+{cpu_build._writer()}+{os.getpid()}+live.cpp",  # a build of a live process
            "tmp+another-host-4026531836+1+theirs.cpp",  # another machine's: its pid means nothing here
            "tmpab12cd34.cpp"]  # as an earlier version named them, still young
    removed = ["tmp+another-host-4026531836+1+old.so", "tmpzz12cd34.so"]
    for name in kept + removed:
        (cache / name).write_bytes(b"")
    for name in removed:
        os.utime(cache / name, (old, old))
    monkeypatch.setenv("LOWBIT_COMPILE_CACHE_DIR", str(cache))
    monkeypatch.setattr(cpu_build, "_loaded", {})
    assert cpu_build.load(ANSWER.format(2)).lowbit_answer() == 2
    assert not stale.exists() and not stale.with_suffix(".so").exists()
    assert sorted(p.name for p in cache.glob("tmp*")) == sorted(kept)


@pytest.fixture
def new_process(monkeypatch):
    """Call to forget what this process knows of its caches (the key, the directories), as a new one would."""
    monkeypatch.setattr(cpu_build, "_loaded", {})

    def forget() -> None:
        cpu_build._loaded.clear()
        cpu_build._secret.cache_clear()
        cpu_build._trusted_dir.cache_clear()

    yield forget
    forget()


@pytest.mark.parametrize("damage", [b"", b"\x01" * 5, b"\x01" * 33], ids=["empty", "truncated", "too long"])
def test_a_damaged_key_is_replaced_once_and_the_libraries_signed_with_it_removed(tmp_path, monkeypatch,
                                                                                   new_process, damage):
    """Every process refused a damaged key (and built its kernels elsewhere, again and again): the first
    to find it replaces it, with a warning, and removes the libraries it signed; the next process loads
    the kernel rebuilt under the new key without compiling and without a word."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("LOWBIT_COMPILE_CACHE_DIR", str(cache))
    source = ANSWER.format(5)
    before = cpu_build.compile_count
    assert cpu_build.load(source).lowbit_answer() == 5 and cpu_build.compile_count == before + 1
    [old] = cache.glob("*.so")
    (cache / "hmac.key").write_bytes(damage)
    new_process()
    with pytest.warns(UserWarning, match=rf"the key of the kernel cache {re.escape(str(cache))} was damaged "
                                         r".*replaced and the 1 kernel libraries signed with it removed"):
        assert cpu_build.load(source).lowbit_answer() == 5
    assert cpu_build.compile_count == before + 2 and not old.exists() and len(list(cache.glob("*.so"))) == 1
    key = cache / "hmac.key"
    assert len(key.read_bytes()) == 32 and key.stat().st_mode & 0o777 == 0o600
    new_process()
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cpu_build.load(source).lowbit_answer() == 5
    assert cpu_build.compile_count == before + 2 and cpu_build.cache_dir() == cache


_TRITON_CHILD = r"""
import json, os, warnings
import torch, triton
from lowbit_compile.formats import StateFormat
from lowbit_compile.kernels.triton_backend import compile_for_target
from lowbit_compile.kernels.triton_printer import quantize_graph
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    built = [compile_for_target(quantize_graph(StateFormat.make("int8", 256, 0, False), torch.float32), arch=90)
             for _ in range(2)]
print(json.dumps({"warnings": [str(w.message) for w in caught], "cubins": [len(b.asm["cubin"]) for b in built],
                  "cache": triton.knobs.cache.dir}))
"""


@pytest.mark.slow
def test_a_triton_cache_that_cannot_take_files_is_replaced_by_a_private_one(tmp_path):
    """Triton's cache where no directory can be (under a file, refused even to root): the kernel compiles
    (offline, for sm_90) into a private directory, with one warning naming the cache and the fix."""
    (tmp_path / "file").write_text("")
    cache = tmp_path / "file" / "triton"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # real compiles, no GPU needed
    done = subprocess.run([sys.executable, "-c", _TRITON_CHILD], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, env={**env, "TRITON_CACHE_DIR": str(cache)})
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.splitlines()[-1])
    assert all(result["cubins"]) and result["cache"] != str(cache)
    [warning] = [w for w in result["warnings"] if str(cache) in w]
    assert "Triton's kernel cache" in warning and "set $TRITON_CACHE_DIR" in warning
