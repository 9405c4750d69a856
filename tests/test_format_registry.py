"""The format registry is the one place a format is defined: each backend stores every registered format as
the reference does (the completeness test of formats), each kernel library names every format a kernel
stores, and no other library file names a format."""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

import pytest
import torch

import lowbit_compile
from lowbit_compile import QuantizedState
from lowbit_compile import lowbit_compile as wrap
from lowbit_compile.formats import StateFormat, element_format, format_names, registered
from lowbit_compile.kernels import cpp_printer

from .helpers import CORNER_BLOCK, KERNEL_FORMATS, bits, corner_values, each_param

PACKAGE = Path(lowbit_compile.__file__).parent
# where a format's name may be written: its record, and the user options' default and docs
NAMING_FILES = {"formats/builtin.py", "options.py"}


def holding(nonneg: bool) -> type[torch.optim.Optimizer]:
    """An optimizer of one's own whose one state holds the gradient (its magnitude for a non-negative
    state): the step stores exactly the values given, through the backend's own encode."""

    class Hold(torch.optim.Optimizer):
        def __init__(self, params: list[torch.nn.Parameter]) -> None:
            super().__init__(params, {})

    def update(self: torch.optim.Optimizer, group: dict, p: torch.nn.Parameter, state: dict) -> None:
        if not state:
            state["held"] = torch.zeros_like(p)
        state["held"].copy_(p.grad.abs() if nonneg else p.grad)

    Hold.step = each_param(update)
    return Hold


@pytest.mark.parametrize("backend", ["cpu", "triton"])
@pytest.mark.parametrize(("name", "nonneg", "rounding"), [
    pytest.param(n, u, r, id=f"{n}-{'u' if u else 's'}-{r}")
    for n, u, r in itertools.product(KERNEL_FORMATS, (False, True), ("nearest", "stochastic"))])
def test_every_registered_format_is_stored_by_each_backend_as_by_the_reference(name, nonneg, rounding, backend,
                                                                               one_thread):
    """Values built to hit every rounding corner (ties, subnormals, inf and NaN, blocks with patches), stored by
    a step of the fused backend and of the reference: the same codes, scales and patches, bit for bit."""
    if backend == "triton":
        pytest.importorskip("triton")
    fmt = StateFormat.make(name, CORNER_BLOCK, 2, nonneg)
    grad = corner_values(fmt, torch.float32)
    held = {}
    for lowering in ("reference", backend):
        param = torch.nn.Parameter(torch.zeros_like(grad))
        param.grad = grad.clone()
        opt = wrap(holding(nonneg)([param]), fmt=name, block_size=CORNER_BLOCK, outliers=2, min_8bit_size=0,
                   backend=lowering, rounding=rounding)
        opt.step()
        opt.step()  # the second step reads the first's state back
        held[lowering] = opt.state[param]["held"]
    ref, ours = held["reference"], held[backend]
    assert isinstance(ref, QuantizedState) and ref.fmt == fmt
    for part, a, b in zip(("codes", "scales", "patch_values", "patch_index"), ref.storage_parts, ours.storage_parts):
        assert torch.equal(bits(a), bits(b)), part


def test_each_kernel_library_names_every_format_a_kernel_stores():
    """The C++ prelude's enum and triton_lib's constexprs give each format the registry's number, under the
    names its record gives; the passthrough format (the stock tensor) reaches no kernel."""
    from lowbit_compile.kernels import triton_lib

    for spec in registered():
        if spec.passthrough:
            assert spec.cpp_name is None and spec.triton_name is None, spec.name
            continue
        assert f"{spec.cpp_name} = {spec.id}" in cpp_printer.PRELUDE, spec.name
        assert getattr(triton_lib, spec.triton_name).value == spec.id, spec.name
        assert element_format(spec.name) is spec


def test_a_registered_format_is_what_the_options_take():
    assert set(format_names()) == {spec.name for spec in registered()}
    with pytest.raises(ValueError, match="one of"):
        StateFormat("int4")
    with pytest.raises(ValueError, match="registered already"):
        from lowbit_compile.formats.registry import register

        register(element_format("int8"))


def _named_formats(path: Path, names: set[str]) -> list[str]:
    """The string constants of ``path`` that are a format's name (docstrings aside)."""
    tree = ast.parse(path.read_text())
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    return [node.value for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and node.value in names and id(node) not in docstrings]


def test_no_library_file_but_the_registry_and_the_options_names_a_format():
    """A format is switched on by its record's fields, never by its name: a quoted format name in code
    appears only where the format is defined (``formats/builtin.py``) and in the options (the default)."""
    names = set(format_names())
    found = {str(p.relative_to(PACKAGE)): _named_formats(p, names) for p in PACKAGE.rglob("*.py")}
    assert {path for path, named in found.items() if named} <= NAMING_FILES, {
        path: named for path, named in found.items() if named and path not in NAMING_FILES}
