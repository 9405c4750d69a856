"""Every benchmark and example script (and the test scripts run by hand) imports (its imports resolve after a module moves), in one fresh
interpreter: the scripts are run by hand, so nothing else in the suite would notice."""

from __future__ import annotations

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
