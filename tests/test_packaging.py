"""The wheel adds exactly one top-level name, and it imports outside the source tree."""

from __future__ import annotations

import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_wheel_has_one_top_level_name_and_imports(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path)],
        check=True, cwd=tmp_path,
    )
    (wheel,) = tmp_path.glob("lowbit_compile-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top == {"lowbit_compile"}
    assert "lowbit_compile/passes/trace.py" in names and "lowbit_compile/formats/registry.py" in names
    assert "lowbit_compile/py.typed" in names  # PEP 561: type checkers read the package's hints
    assert "lowbit_compile/kernels/cpu_prelude.h" in names  # the C++ prelude the CPU kernels include
    info = next(n.rsplit("/", 1)[0] for n in names if n.endswith(".dist-info/METADATA"))
    assert f"{info}/licenses/LICENSE" in names
    metadata = zipfile.ZipFile(wheel).read(f"{info}/METADATA").decode()
    assert "License-Expression: BSD-3-Clause" in metadata.splitlines()
    requires = [line.removeprefix("Requires-Dist: ") for line in metadata.splitlines() if line.startswith("Requires-Dist:")]
    # triton only with the gpu extra: a CPU-only torch install is not handed a triton it cannot use; the
    # oldest torch supported (2.9) pins triton 3.5
    assert [r for r in requires if r.startswith("triton")] == ["triton>=3.5; platform_system == \"Linux\" and extra == \"gpu\""]

    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
                   check=True)
    code = (
        "import lowbit_compile, torch;"
        "from lowbit_compile import lowbit_compile as lc, restore;"
        "from lowbit_compile import formats;"
        f"assert lowbit_compile.__file__.startswith({str(target)!r}), lowbit_compile.__file__;"
        "p = torch.nn.Parameter(torch.randn(5000)); o = lc(torch.optim.Adam([p]));"
        "p.grad = torch.ones_like(p); o.step(); print(type(o.state[p]['exp_avg']).__name__)"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True,
                         cwd=tmp_path, env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"})
    assert out.stdout.strip() == "QuantizedState"


def test_the_changelog_names_the_version_of_the_package():
    import lowbit_compile

    (version,) = re.findall(r'^version = "([^"]+)"$', (ROOT / "pyproject.toml").read_text(), re.MULTILINE)
    assert lowbit_compile.__version__ == version
    assert f"## [{version}] - " in (ROOT / "CHANGELOG.md").read_text()


def test_no_directory_at_the_repository_root_shadows_kernels_or_passes():
    """pytest and ``python -m`` put the repository root first on sys.path: a top-level ``kernels`` or
    ``passes`` there shadowed Hugging Face's ``kernels`` package, which transformers imports."""
    top = {p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file() or p.suffix == ".py"}
    assert top <= {"lowbit_compile", "tests", "examples", "bench"}, top
    code = "import importlib.util as u; s = u.find_spec('kernels'); print(s and s.origin)"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, cwd=ROOT)
    assert not out.stdout.strip().startswith(str(ROOT / "kernels")), out.stdout


@pytest.mark.slow
def test_importing_loads_neither_triton_nor_inductor_nor_dynamo():
    """``import lowbit_compile`` adds a few dozen modules to ``import torch``; the tracing machinery,
    inductor's toolchain and triton load when a step is first traced and its kernel built."""
    code = ("import sys, torch; before = set(sys.modules); import lowbit_compile;"
            "heavy = [m for m in ('triton', 'torch._inductor', 'torch._dynamo', 'sympy', 'torch.distributed.tensor')"
            " if m in sys.modules]; print(len(set(sys.modules) - before), heavy)")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, cwd=ROOT)
    count, heavy = out.stdout.split(" ", 1)
    assert heavy.strip() == "[]" and int(count) < 100, out.stdout
