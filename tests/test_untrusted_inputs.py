"""Nothing in a checkpoint, a param group or a state dict runs as the user: hostile keys through every
way an optimizer is adopted (the explicit wrap, ``enable()``, ``python -m lowbit_compile run``, the
``lowbit_compile.optim`` classes) leave no trace and step like stock, and no key reaches the
generated Python or C++."""

from __future__ import annotations

import builtins
import copy
import os
import re
from pathlib import Path

import pytest
import torch

from lowbit_compile import enable, lowbit_compile, optim
from lowbit_compile.ir.contract import identifier
from lowbit_compile.kernels import cpu_build

from .helpers import each_param, run_command

SHAPES = [(64, 80), (80,)]  # one tensor quantized (>= min_8bit_size=4096 elements), one kept fp32
SENTINEL = "lowbit_untrusted_code_ran"


def payload(marker: Path) -> str:
    """Python that leaves two traces if it ever runs: the marker file and a builtin."""
    return f"open({str(marker)!r}, 'w').close() or setattr(__import__('builtins'), {SENTINEL!r}, 1)"


def hostile_keys(marker: Path) -> list[object]:
    code = payload(marker)
    return [
        f"x={code}",  # a default argument of the generated forward (the attack that worked)
        f"lr):\n    {code}\n    def f(x",  # closes the signature, runs in the body
        f"a\n{code}\n#",  # newlines
        f"'\"; {code}; #",  # quotes
        f"m\"; }} int lowbit_step() {{ system(\"touch {marker}\"); /*",  # C++ source
        "lr\u2028\u03bb\u00e9\u202e\x00",  # a unicode line separator, an RTL override, a NUL
        "k" * 100_000,  # very long
        "a-b", "a b", "a.b", "a_b", "a_b_1",  # one name after FX's sanitizing
        "betas_0", "param", "grad", "self", "def", "print", "hp_lr", "state_step",  # names the graph makes
        7, ("x", 1),  # not strings (a weights-only load gives them too)
    ]


@pytest.fixture
def marker(tmp_path: Path):
    path = tmp_path / "ran"
    yield path
    assert not path.exists(), "code from a key ran"
    assert not hasattr(builtins, SENTINEL), "code from a key ran"


def make_params() -> list[torch.nn.Parameter]:
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s)) for s in SHAPES]


def set_grads(params: list[torch.Tensor], seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)


def crafted_checkpoint(keys: list[object]) -> dict:
    """A stock AdamW checkpoint after one step, with every key in each param group (a float: a
    hyperparameter slot of the trace) and in each parameter's state (a scalar and a per-element tensor)."""
    params = make_params()
    opt = torch.optim.AdamW(params, lr=1e-2)
    set_grads(params, seed=1)
    opt.step()
    sd = copy.deepcopy(opt.state_dict())
    for i, key in enumerate(keys):
        sd["param_groups"][0][key] = 0.5 + i
        for entry, p in zip(sd["state"].values(), params):
            entry[key] = torch.full(() if i % 2 else p.shape, float(i))
    return sd


def stepped(adopt, sd: dict, steps: int = 2) -> list[torch.Tensor]:
    """Params after loading ``sd`` into ``adopt(params)`` and stepping it."""
    params = make_params()
    opt = adopt(params)
    opt.load_state_dict(copy.deepcopy(sd))
    for s in range(steps):
        set_grads(params, seed=2 + s)
        opt.step()
    return [p.detach().clone() for p in params]


def assert_same(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def stock(params):
    return torch.optim.AdamW(params, lr=1e-2)


def in_enable_scope(adopt, **options):
    """``adopt`` stepped inside ``enable(**options)``: a stock optimizer rewritten at its first step."""
    class Scoped:
        def __init__(self, params):
            self.opt = adopt(params)

        def load_state_dict(self, sd):
            self.opt.load_state_dict(sd)

        def step(self):
            with enable(**options):
                self.opt.step()

    return Scoped


ADOPTIONS = {
    "wrap": lambda fmt: lambda params: lowbit_compile(stock(params), fmt=fmt, backend="reference"),
    "enable": lambda fmt: in_enable_scope(stock, fmt=fmt, backend="reference"),
    "optim class": lambda fmt: lambda params: optim.AdamW(params, lr=1e-2, fmt=fmt, backend="reference"),
}


@pytest.mark.parametrize("path", sorted(ADOPTIONS))
@pytest.mark.parametrize("fmt", ["fp32", "int8"])
def test_hostile_keys_of_a_checkpoint_run_nothing_and_step_like_without_them(marker, path, fmt):
    """fp32 states: bit for bit the stock step over the same checkpoint (which ignores the keys);
    int8 states: bit for bit the same adoption over the checkpoint without them."""
    keys = hostile_keys(marker)
    adopt = ADOPTIONS[path](fmt)
    got = stepped(adopt, crafted_checkpoint(keys))
    assert_same(got, stepped(stock if fmt == "fp32" else adopt, crafted_checkpoint(keys if fmt == "fp32" else [])))


def test_hostile_keys_in_param_groups_run_nothing(marker):
    """Keys in the groups an optimizer is built with (every float one a hyperparameter of the trace),
    through an optim class and a wrap, and a group's float tuple (its slots named by position)."""
    keys = hostile_keys(marker)

    def groups(params):
        return [{"params": [params[0]], **{k: 0.5 + i for i, k in enumerate(keys)}, "x": (0.1, 0.2)},
                {"params": [params[1]], keys[0]: (1.0, 2.0), "betas": (0.8, 0.9)}]

    def run(make) -> list[torch.Tensor]:
        params = make_params()
        opt = make(groups(params))
        for s in range(2):
            set_grads(params, seed=2 + s)
            opt.step()
        return [p.detach() for p in params]

    expected = run(lambda g: torch.optim.AdamW(g, lr=1e-2))
    assert_same(run(lambda g: optim.AdamW(g, lr=1e-2, fmt="fp32", backend="reference")), expected)
    assert_same(run(lambda g: lowbit_compile(torch.optim.AdamW(g, lr=1e-2), fmt="fp32", backend="reference")),
                expected)


class SquaresEma(torch.optim.Optimizer):
    """RMSprop's second moment with its decay in a tuple, as Adam's betas."""

    def __init__(self, params):
        super().__init__(params, {"lr": 0.01, "decays": (0.9, 0.99)})

    @each_param
    def step(self, group, p, state):
        if not state:
            state["v"] = torch.zeros_like(p)
        v = state["v"]
        v.mul_(group["decays"][1]).addcmul_(p.grad, p.grad, value=1 - group["decays"][1])
        p.addcdiv_(p.grad, v.sqrt().add_(1e-8), value=-group["lr"])


def test_a_key_named_like_a_tuple_slot_does_not_stand_in_for_it_in_a_guard():
    """A group key "decays_1" (as a checkpoint can add) beside decays: the unsigned second moment's
    proof assumes decays[1] in [0, 1], and the step checks decays[1] itself, not the key of the same
    name: decays[1] = 1.5 (which can make v negative) turns v signed and keeps its negative values,
    as without that key."""
    def run(extra: dict) -> tuple[list[torch.Tensor], bool]:
        params = make_params()
        opt = lowbit_compile(SquaresEma(params), "int8", backend="reference")
        opt.param_groups[0].update(extra)
        for s in range(3):
            set_grads(params, seed=1 + s)
            opt.step()
            opt.param_groups[0]["decays"] = (0.9, 1.5)
        v = opt.state[params[0]]["v"]
        return [v.dequantize()], v.fmt.nonneg  # (the params are NaN by now, as stock's)

    with pytest.warns(UserWarning, match="square root"):
        plain, unsigned = run({})
    assert not unsigned
    with pytest.warns(UserWarning, match="square root"):
        colliding, unsigned = run({"decays_1": 0.5})
    assert not unsigned
    assert_same(colliding, plain)


SCRIPT = """
import sys
import torch
torch.manual_seed(0)
params = [torch.nn.Parameter(torch.randn(s)) for s in {shapes}]
opt = torch.optim.AdamW(params, lr=1e-2)
opt.load_state_dict(torch.load(sys.argv[1], weights_only=True))
for s in range(2):
    g = torch.Generator().manual_seed(2 + s)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)
    opt.step()
torch.save([p.detach() for p in params], sys.argv[2])
"""


def test_hostile_keys_through_the_run_command_run_nothing(marker, tmp_path, monkeypatch, capsys):
    """``python -m lowbit_compile run train.py``, in this process: the script loads the crafted
    checkpoint with ``weights_only=True`` (as a careful user does) and steps; fp32 states step like stock."""
    keys = hostile_keys(marker)
    torch.save(crafted_checkpoint(keys), tmp_path / "ckpt.pt")
    (tmp_path / "train.py").write_text(SCRIPT.format(shapes=SHAPES))
    monkeypatch.chdir(tmp_path)
    code = run_command(monkeypatch, "--fmt", "fp32", "--backend", "reference", "train.py", "ckpt.pt", "out.pt")
    assert code in (0, None), capsys.readouterr().err
    assert_same(torch.load(tmp_path / "out.pt"), stepped(stock, crafted_checkpoint(keys)))


def hostile_optimizer(state_key: str, hyper_key: str) -> type[torch.optim.Optimizer]:
    """An optimizer of one's own whose state and hyperparameter keys are C++ (and Python) source (a
    class per pair: what a class's step keeps is probed once per class)."""

    class Hostile(torch.optim.Optimizer):
        def __init__(self, params):
            super().__init__(params, {"lr": 0.1, hyper_key: 0.9})

        @each_param
        def step(self, group, p, state):
            if not state:
                state[state_key] = torch.zeros_like(p)
            state[state_key].mul_(group[hyper_key]).add_(p.grad)
            p.sub_(state[state_key], alpha=group["lr"])

    return Hostile


def test_no_key_reaches_the_generated_cpp(marker, monkeypatch):
    """A per-element state (quantized: its buffers are named in the C++) and a hyperparameter keyed by
    C++ and Python source: the kernel's source holds the keys' identifiers, nothing of the keys, and
    its step is the reference backend's bit for bit."""
    state_key = f'm"; }} int lowbit_step() {{ system("touch {marker}"); /*'
    hyper_key = f"beta\n#include \"{marker}\"\n{payload(marker)}"
    sources = []
    load_async = cpu_build.load_async

    def recording(source, *args):
        sources.append(source)
        return load_async(source, *args)

    monkeypatch.setattr(cpu_build, "load_async", recording)
    results = []
    for backend in ("cpu", "reference"):
        p = torch.nn.Parameter(torch.linspace(-1, 1, 5000))
        opt = lowbit_compile(hostile_optimizer(state_key, hyper_key)([p]), "int8", backend=backend)
        for s in range(2):
            set_grads([p], seed=s)
            opt.step()
        results.append(p.detach())
    assert_same(results[:1], results[1:])
    assert sources
    for source in sources:
        assert identifier(state_key) in source and identifier(hyper_key) in source
        assert "system" not in source and "#include \"" not in source and "touch" not in source


def test_no_key_reaches_the_generated_triton():
    """The same optimizer's Triton kernel (printed for CUDA; run by the GPU tests) names the state's
    storage and the hyperparameter by their identifiers, and holds nothing of the keys."""
    printer = pytest.importorskip("lowbit_compile.kernels.triton_printer")
    from lowbit_compile.kernels.lowering import Target

    from .graphs import body

    state_key, hyper_key = 'm"""; import os; os.system("x"); """', "beta):\n    import os\n#"
    opt = hostile_optimizer(state_key, hyper_key)([torch.nn.Parameter(torch.randn(64))])
    source = printer.emit_kernel(body(opt, "int8"), "hostile_step", Target("cuda")).source
    assert f"{identifier(state_key)}_codes_ptr" in source and f"hp_{identifier(hyper_key)}" in source
    assert "import os" not in source and "system" not in source and '"""' not in source


# ---- the kernel cache ----------------------------------------------------------------------------------
ANSWER = 'extern "C" int lowbit_answer(void) {{ return {}; }}\n'


@pytest.fixture
def fresh_builds(monkeypatch):
    """No library loaded in this process; $LOWBIT_COMPILE_CACHE_DIR unset (a test sets what it needs)."""
    monkeypatch.setattr(cpu_build, "_loaded", {})
    monkeypatch.delenv("LOWBIT_COMPILE_CACHE_DIR", raising=False)


def planted_library(tmp_path: Path, marker: Path) -> bytes:
    """A library another user could plant: its constructor runs when it is loaded, and leaves ``marker``."""
    src = tmp_path / "planted.cpp"
    src.write_text(f'#include <cstdio>\n__attribute__((constructor)) static void planted() {{ '
                   f'std::fclose(std::fopen("{marker}", "w")); }}\n' + ANSWER.format(666))
    import subprocess

    subprocess.run([cpu_build.compiler(), "-shared", "-fPIC", str(src), "-o", str(tmp_path / "planted.so")],
                   check=True)
    return (tmp_path / "planted.so").read_bytes()


def answer(source: str) -> tuple[int, int]:
    """What the library built from ``source`` answers, and how many compilations that took."""
    before = cpu_build.compile_count
    return cpu_build.load(source).lowbit_answer(), cpu_build.compile_count - before


def mode(path: Path) -> int:
    return path.stat().st_mode & 0o777


def test_the_default_cache_is_private_under_xdg_cache_home(fresh_builds, tmp_path, monkeypatch):
    """Made 0700 whatever the umask, under $XDG_CACHE_HOME (never /tmp); library 0700, source and key 0600."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    old = os.umask(0)
    try:
        assert answer(ANSWER.format(1)) == (1, 1)
    finally:
        os.umask(old)
    root = tmp_path / "xdg" / "lowbit_compile"
    assert cpu_build.cache_dir() == root and mode(root) == 0o700
    key = cpu_build.cache_key(ANSWER.format(1))
    [lib] = root.glob(f"{key}.*.so")
    assert mode(lib) == 0o700 and mode(root / f"{key}.cpp") == 0o600 and mode(root / "hmac.key") == 0o600
    cpu_build._loaded.clear()
    assert answer(ANSWER.format(1)) == (1, 0)  # a fresh process would load it without compiling


def refused(configured: Path, match: str) -> Path:
    """The cache a process uses when ``configured`` is refused: a warning names it and why, and the
    kernels go to a fresh private directory elsewhere."""
    with pytest.warns(UserWarning, match=rf"not using the kernel cache {re.escape(str(configured))}: {match}"):
        used = cpu_build.cache_dir()
    assert used != configured and mode(used) == 0o700 and used.stat().st_uid == os.geteuid()
    return used


def test_a_cache_dir_others_can_write_is_refused_and_what_they_planted_never_loads(fresh_builds, tmp_path,
                                                                                    monkeypatch):
    """A world-writable directory made before us (another user's trap in a shared /tmp), holding a
    library under the name a key gives: refused with a warning; the kernel is built elsewhere."""
    marker = tmp_path / "ran"
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    source = ANSWER.format(2)
    key, planted = cpu_build.cache_key(source), planted_library(tmp_path, marker)
    for name in (f"{key}.so", f"{key}.{'0' * 64}.so"):  # this library's old name, and its new form
        (shared / name).write_bytes(planted)
    monkeypatch.setenv("LOWBIT_COMPILE_CACHE_DIR", str(shared))
    refused(shared, "others can write to it")
    assert answer(source) == (2, 1)
    assert not marker.exists()
    assert sorted(p.name for p in shared.iterdir()) == sorted([f"{key}.so", f"{key}.{'0' * 64}.so"])


def test_a_cache_dir_of_another_user_or_under_one_others_can_write_is_refused(fresh_builds, tmp_path, monkeypatch):
    """Owned by uid 65534 (tests run as root: root trusts only what root owns; as another user, the
    root-owned / stands in); and a private directory inside a world-writable, not sticky one, whose
    other users could rename it away and put their own in its place."""
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    if os.geteuid() == 0:
        os.chown(theirs, 65534, 65534)
    else:
        theirs = Path("/")
    monkeypatch.setenv("LOWBIT_COMPILE_CACHE_DIR", str(theirs))
    refused(theirs, r"it is owned by uid \d+, not by this user")
    open_parent = tmp_path / "open"
    open_parent.mkdir()
    open_parent.chmod(0o777)
    monkeypatch.setenv("LOWBIT_COMPILE_CACHE_DIR", str(open_parent / "cache"))
    refused(open_parent / "cache", rf"others can write to {re.escape(str(open_parent))}, above it")
    sticky = tmp_path / "sticky"  # like /tmp: others cannot rename what is ours
    sticky.mkdir()
    sticky.chmod(0o1777)
    monkeypatch.setenv("LOWBIT_COMPILE_CACHE_DIR", str(sticky / "cache"))
    assert cpu_build.cache_dir() == sticky / "cache"


def test_a_changed_or_foreign_library_is_not_loaded_but_rebuilt(fresh_builds, tmp_path, monkeypatch):
    """In the private cache: a library whose bytes changed after it was written (here: replaced by
    one that runs code when loaded), then one of another owner (as root; else one others can write):
    each is removed with a warning and built again; nothing planted runs."""
    marker = tmp_path / "ran"
    monkeypatch.setenv("LOWBIT_COMPILE_CACHE_DIR", str(tmp_path / "cache"))
    source = ANSWER.format(3)
    assert answer(source) == (3, 1)
    [lib] = (tmp_path / "cache").glob("*.so")
    # a new file in its place, as its mode: the library this process loaded stays mapped intact (bytes
    # written into it would change that mapping, and the process crashed at exit)
    planted = lib.with_suffix(".planted")
    planted.write_bytes(planted_library(tmp_path, marker))
    planted.chmod(mode(lib))
    planted.replace(lib)
    cpu_build._loaded.clear()
    with pytest.warns(UserWarning, match=rf"not loading the kernel library {re.escape(str(lib))}: its bytes"):
        assert answer(source) == (3, 1)
    assert not marker.exists()
    [lib] = (tmp_path / "cache").glob("*.so")
    if os.geteuid() == 0:
        os.chown(lib, 65534, 65534)
    else:
        lib.chmod(0o766)
    cpu_build._loaded.clear()
    with pytest.warns(UserWarning, match=r"not a file of this user's that only it can use"):
        assert answer(source) == (3, 1)
