"""Every benchmark and example script (and the test scripts run by hand) imports (its imports resolve after a module moves), in one fresh
interpreter: the scripts are run by hand, so nothing else in the suite would notice."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(p for folder in ("bench", "examples") for p in (ROOT / folder).glob("*.py") if p.name != "__init__.py")
TEST_SCRIPTS = ("tests.kernel_sources",)  # run by hand too (python -m), imported by no test


def test_every_bench_and_example_script_imports():
    modules = [f"{p.parent.name}.{p.stem}" for p in SCRIPTS] + list(TEST_SCRIPTS)
    assert len(modules) > 20
    code = "import importlib, sys\nfor m in sys.argv[1:]:\n    importlib.import_module(m)\n"
    done = subprocess.run([sys.executable, "-c", code, *modules], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


def test_no_benchmark_imports_the_tests():
    """Benchmarks run without the test suite (nor pytest): what they share with the tests lives in bench/, which the
    tests import."""
    found = []
    for path in sorted((ROOT / "bench").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            found += [f"{path.name}: {n}" for n in names if n.split(".")[0] == "tests"]
    assert not found, found
