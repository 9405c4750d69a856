"""A checkpoint is untrusted input: every field of a packed state is checked against the live parameter
and the format before anything changes (on every backend), the kernels skip a patch offset outside its
block on their own (and AddressSanitizer sees no access outside a buffer), and a load is all or nothing
(a fuzz over single mutations of valid checkpoints)."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from lowbit_compile import QuantizedState, lowbit_compile
from lowbit_compile.formats import StateFormat, blockquant
from lowbit_compile.formats.residual import SEED_PERIOD

from .helpers import assert_same, saved_and_loaded, text, train

BACKENDS = ["cpu", "reference", "triton"]
SHAPES = [(9, 40), (70,)]  # blocks that span rows, a partial last block
BLOCK = 64
INT16_MAX, INT16_MIN = 2**15 - 1, -(2**15)


def make_params(dtype: torch.dtype = torch.float32) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(3)
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in SHAPES]


def trained(backend: str, dtype: torch.dtype = torch.float32, **options) -> tuple[torch.optim.Optimizer, list]:
    params = make_params(dtype)
    options = {"fmt": "int8", "block_size": BLOCK, "min_8bit_size": 0, "outliers": 2, **options}
    opt = lowbit_compile(torch.optim.AdamW(params, lr=1e-2), backend=backend, **options)
    train(opt, params, 2, seed=1)
    return opt, params


_shared: dict[tuple, tuple[torch.optim.Optimizer, list]] = {}


def shared(backend: str, dtype: torch.dtype = torch.float32, **options) -> tuple[torch.optim.Optimizer, list]:
    """One trained optimizer per configuration for the tests of this module that only refuse loads (a
    refused load changes nothing, so each finds it valid); the Triton interpreter's steps take seconds."""
    key = (backend, dtype, tuple(sorted(options.items())))
    if key not in _shared:
        _shared[key] = trained(backend, dtype, **options)
    return _shared[key]


def snapshot(opt: torch.optim.Optimizer, params: list[torch.Tensor]) -> dict:
    """Every bit of the params, the states and the hyperparameters, and which objects hold the states."""
    states = {}
    for p in params:
        states[p] = {k: ([t.clone() for t in v.storage_parts] if isinstance(v, QuantizedState) else
                         v.clone() if isinstance(v, torch.Tensor) else v) for k, v in opt.state[p].items()}
    return {"params": [p.detach().clone() for p in params], "states": states,
            "objects": {p: dict(opt.state[p]) for p in params},
            "groups": [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]}


def assert_unchanged(opt: torch.optim.Optimizer, params: list[torch.Tensor], before: dict) -> None:
    assert [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] == before["groups"]
    for p, old in zip(params, before["params"]):
        assert_same([p.detach()], [old])
        assert opt.state[p].keys() == before["states"][p].keys()
        for key, value in before["states"][p].items():
            now = opt.state[p][key]
            assert now is before["objects"][p][key]
            if isinstance(now, QuantizedState):
                assert_same(list(now.storage_parts), value)
            elif isinstance(now, torch.Tensor):
                assert_same([now], [value])


def records(packed: dict, name: str, dtype: torch.dtype) -> torch.Tensor:
    """A packed table's records as ``dtype`` (a copy: the saved bytes are views of the live state)."""
    return packed[name].clone().view(dtype)


def with_table(sd: dict, key: str, name: str, dtype: torch.dtype, change, index: int = 0) -> dict:
    """``sd`` with the table ``name`` of state ``key`` of entry ``index`` changed (as ``dtype`` values)."""
    values = records(sd["state"][index][key], name, dtype)
    change(values)
    sd["state"][index] = {**sd["state"][index], key: {**sd["state"][index][key], name: values.view(torch.uint8)}}
    return sd


def refused(opt: torch.optim.Optimizer, params: list, sd: dict, match: str, step: bool = True) -> None:
    """The load fails naming the parameter and ``match``, changes nothing, and the optimizer steps on
    (``step``; the Triton interpreter's tests step in the patch tests only, where the kernels read what
    is checked)."""
    before = snapshot(opt, params)
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[0\].*" + match):
        opt.load_state_dict(sd)
    assert_unchanged(opt, params, before)
    if step:
        train(opt, params, 1, seed=5)


def set_patch(values: torch.Tensor, offset: int, k: int = 0, block: int = 1) -> None:
    values[block, k] = offset


# -- each field, out of range, on every backend ---------------------------------------------------------
PATCH_OFFSETS = {"negative": -1, "most negative": INT16_MIN, "block size": BLOCK, "max int16": INT16_MAX}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", sorted(PATCH_OFFSETS))
def test_a_patch_offset_outside_its_block_is_refused(backend, case):
    opt, params = shared(backend)
    sd = saved_and_loaded(opt.state_dict())
    offset = PATCH_OFFSETS[case]
    with_table(sd, "exp_avg", "block_patch_index", torch.int16, lambda v: set_patch(v, offset))
    refused(opt, params, sd, rf"'exp_avg'.*patch offset {offset} in block 1 is outside the block's \[0, {BLOCK}\)")


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_patch_offset_twice_in_a_block_is_refused(backend):
    opt, params = shared(backend)
    sd = saved_and_loaded(opt.state_dict())

    def twice(v: torch.Tensor) -> None:
        v[2, 1] = v[2, 0]
    with_table(sd, "exp_avg_sq", "block_patch_index", torch.int16, twice)
    refused(opt, params, sd, r"'exp_avg_sq'.*patch offset \d+ is in block 2 twice", step=backend != "triton")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_a_scale_that_is_not_finite_is_refused(backend, value):
    opt, params = shared(backend)
    sd = saved_and_loaded(opt.state_dict())

    def change(v: torch.Tensor) -> None:
        v[3] = value
    with_table(sd, "exp_avg", "block_scales", torch.float32, change)
    refused(opt, params, sd, r"'exp_avg'.*scale of block 3 is .*, not a finite number", step=backend != "triton")


def with_entry(sd: dict, key: str, change, index: int = 0) -> dict:
    sd["state"][index] = {**sd["state"][index], key: change(dict(sd["state"][index][key]))}
    return sd


# each a packed field set to what no writer writes: (key, field, new value or a function of the packed
# state, what the error says)
HEADER_FIELDS = {
    "patch count negative": ("exp_avg", "lowbit_format", text("int8:64:-1:s"), r"'exp_avg'.*outlier count"),
    "patch count past the block": ("exp_avg", "lowbit_format", text("int8:64:65:s"), r"'exp_avg'.*outlier count"),
    "patch count of another table": ("exp_avg", "lowbit_format", text("int8:64:1:s"),
                                     r"'exp_avg'.*'block_patch_values' has shape \(\d+, 4\), not \(\d+, 2\)"),
    "block size negative": ("exp_avg", "lowbit_format", text("int8:-64:2:s"), r"'exp_avg'.*block size"),
    "block size max int16 + 2": ("exp_avg", "lowbit_format", text(f"int8:{INT16_MAX + 2}:2:s"), r"'exp_avg'.*block size"),
    "codes of another size": ("exp_avg", "codes", lambda d: d["codes"][:, :-1],
                              r"'exp_avg'.*'codes' has shape \(9, 39\), not \(9, 40\)"),
    "codes of another dtype": ("exp_avg", "codes", lambda d: d["codes"].to(torch.int16),
                               r"'exp_avg'.*'codes' has dtype torch.int16"),
    "scales of another size": ("exp_avg", "block_scales", lambda d: d["block_scales"][:-1],
                               r"'exp_avg'.*'block_scales' has shape"),
    "scales of another dtype": ("exp_avg", "block_scales", lambda d: d["block_scales"].view(torch.float32),
                                r"'exp_avg'.*'block_scales' has shape \(6, 1\), not \(6, 4\)"),
    "dtype fp16 for an fp32 param": ("exp_avg", "dtype", text("float16"),
                                     r"'exp_avg' was saved as torch.float16 for a torch.float32 parameter"),
    "dtype bf16 for an fp32 param": ("exp_avg_sq", "dtype", text("bfloat16"),
                                     r"'exp_avg_sq' was saved as torch.bfloat16 for a torch.float32"),
    "dtype fp64 for an fp32 param": ("exp_avg", "dtype", text("float64"), r"saved as torch.float64"),
    "row splits negative": ("exp_avg", "row_splits", text("0,-1,9"), r"row_splits \[0, -1, 9\] do not split"),
    "row splits past the rows": ("exp_avg", "row_splits", text(f"0,{INT16_MAX},9"), r"do not split the 9 rows"),
    "row splits out of order": ("exp_avg", "row_splits", text("0,7,3,9"), r"row_splits \[0, 7, 3, 9\] do not split"),
    "row splits every 0 rows": ("exp_avg", "row_splits", text("*0"), r"split the rows every 0"),
    "shape of another param": ("exp_avg", "shape", text("70"), r"saved for a parameter of shape \(70,\)"),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", sorted(HEADER_FIELDS))
def test_each_packed_field_out_of_range_is_refused(backend, name):
    key, field, value, match = HEADER_FIELDS[name]
    opt, params = shared(backend)
    sd = saved_and_loaded(opt.state_dict())
    with_entry(sd, key, lambda d: {**d, field: value(d) if callable(value) else value})
    refused(opt, params, sd, match, step=backend != "triton")


COUNTERS = {"negative": -1.0, "the period": float(SEED_PERIOD), "max int32": 2.0**31, "a fraction": 0.5,
            "nan": float("nan"), "inf": float("inf")}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("key", ["rounding_seed", "master_seed"])
@pytest.mark.parametrize("case", sorted(COUNTERS))
def test_a_rounding_counter_out_of_range_is_refused(backend, key, case):
    """The step counters of stochastic rounding (of the states and of an 8bit master): the kernels
    take them as unsigned 32-bit integers, which only a whole number in [0, 2**24) is as every step
    leaves it."""
    opt, params = shared(backend, torch.bfloat16, master_weights="8bit", rounding="stochastic")
    sd = saved_and_loaded(opt.state_dict())
    number = torch.tensor([COUNTERS[case]], dtype=torch.float32).view(torch.uint8)
    with_entry(sd, key, lambda d: {**d, "bytes": number})
    refused(opt, params, sd, rf"'{key}' is {COUNTERS[case]}, not a whole number in \[0, {SEED_PERIOD}\)",
            step=backend != "triton")


RESIDUAL_FIELDS = {
    "residual of a third width": ("master_residual", lambda d: {**d, "lowbit_master_residual": 3},
                                  r"'master_residual' are not a table of int8 or int16 codes"),
    "residual of another size": ("master_residual", lambda d: {**d, "bytes": d["bytes"][:, :-2]},
                                 r"'master_residual' of shape \(9, 78\) do not fit"),
    "residual of other rows": ("master_residual", lambda d: {**d, "bytes": d["bytes"][:-1]},
                               r"does not have the parameter's 9 rows"),
    "tie bits of another size": ("master_ties", lambda d: {**d, "bits": d["bits"][:, :-1]},
                                 r"'master_ties' of shape \(9, 4\) do not fit"),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", sorted(RESIDUAL_FIELDS))
def test_a_master_residual_field_out_of_range_is_refused(backend, name):
    key, change, match = RESIDUAL_FIELDS[name]
    opt, params = shared(backend, torch.bfloat16, master_weights="exact")
    sd = saved_and_loaded(opt.state_dict())
    with_entry(sd, key, change)
    refused(opt, params, sd, match, step=backend != "triton")


def test_a_16_bit_params_states_load_saved_with_or_without_master_weights():
    """The dtype a checkpoint may hold a bf16 param's states in: bf16 (its stock step) or fp32 (its
    master's step), read as the one this optimizer keeps; any other is refused above."""
    for saved, loading in (("exact", None), (None, "exact")):
        opt, params = trained("reference", torch.bfloat16, master_weights=saved)
        sd = saved_and_loaded(opt.state_dict())
        other = lowbit_compile(torch.optim.AdamW(params, lr=1e-2), "int8", block_size=BLOCK, min_8bit_size=0,
                               outliers=2, backend="reference", master_weights=loading)
        other.load_state_dict(sd)
        for p in params:
            for key in ("exp_avg", "exp_avg_sq"):
                assert other.state[p][key].dtype == (torch.float32 if loading else torch.bfloat16)
                assert_same(list(other.state[p][key].storage_parts), list(opt.state[p][key].storage_parts))
        train(other, params, 1, seed=5)


# -- the kernels on their own -------------------------------------------------------------------------
def out_of_range_patches(backend: str, value: float) -> list[torch.Tensor]:
    """One step over states whose patches point outside their blocks (put there directly, past every
    check of the loader), with ``value`` in those patches: the param after the step."""
    opt, params = trained(backend)
    for p in params:
        for key in ("exp_avg", "exp_avg_sq"):
            state = opt.state[p][key]
            blocks = state.patch_index.shape[0]
            bad = torch.tensor([-1, INT16_MIN, BLOCK, INT16_MAX], dtype=torch.int16)
            state.patch_index[:, 0] = bad.repeat(-(-blocks // 4))[:blocks]
            state.patch_values[:, 0] = value
    train(opt, params, 1, seed=7)
    return [p.detach().clone() for p in params]


@pytest.mark.parametrize("backend", ["cpu", "triton"])
def test_the_kernels_put_no_patch_outside_its_block(backend):
    """Patches with offsets outside their block are skipped by the C++ and Triton kernels themselves
    (the C++ kernel wrote such a patch's value outside its SIMD vector): whatever their value, the
    step is the same (``test_no_access_outside_a_buffer_under_address_sanitizer`` runs this under
    AddressSanitizer)."""
    small, huge = out_of_range_patches(backend, 1.0), out_of_range_patches(backend, 3e38)
    for a, b in zip(small, huge):
        assert torch.isfinite(a).all()
        assert_same([a], [b])


def test_the_records_check_is_what_quantize_writes():
    """Every record ``quantize_into`` writes passes the check (partial blocks, all-zero blocks, inf and
    NaN in flagged blocks, patches in the padding), so a valid checkpoint is never refused."""
    fmt = StateFormat("int8", 16, 4, False)
    x = torch.randn(16 * 5 + 3)
    x[:16] = 0
    x[20], x[40], x[41] = float("inf"), float("nan"), float("-inf")
    q = blockquant.quantize(x, fmt)
    assert blockquant.invalid_records(q.scales, q.patch_index, fmt) is None
    assert bool((q.scales[1:3] < 0).all())  # flagged blocks, negative scales, accepted


@pytest.mark.slow
def test_no_access_outside_a_buffer_under_address_sanitizer(tmp_path):
    """The C++ kernels built with ``-fsanitize=address`` (the runtime preloaded: python is not built
    with it) run the patch tests of this file: the loader's refusals and the kernels' own skipping of
    offsets outside the block. Reverting the kernel's check makes this fail with ASan's
    stack-buffer-overflow report."""
    runtime = subprocess.run(["g++", "-print-file-name=libasan.so"], capture_output=True, text=True).stdout.strip()
    assert os.path.isabs(runtime) and os.path.exists(runtime), "gcc's libasan is needed for this test"
    cache = tmp_path / "cache"
    tests = ["test_the_kernels_put_no_patch_outside_its_block and cpu",
             "test_a_patch_offset and cpu"]
    code = ("import sys, pytest; from lowbit_compile.kernels import cpu_build; "
            "cpu_build.FLAGS += ('-fsanitize=address', '-fno-omit-frame-pointer'); "
            f"sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', '-x', {__file__!r}, '-k', {' or '.join(f'({t})' for t in tests)!r}]))")
    logs = tmp_path / "asan"  # ASan's reports (pytest captures the standard error of the tests it runs)
    env = {**os.environ, "LD_PRELOAD": runtime, "ASAN_OPTIONS": f"detect_leaks=0:abort_on_error=1:log_path={logs}",
           "LOWBIT_COMPILE_CACHE_DIR": str(cache), "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parent.parent, env=env,
                          capture_output=True, text=True, timeout=1200)
    reports = "".join(path.read_text()[:5000] for path in tmp_path.glob("asan.*"))
    assert done.returncode == 0 and not reports, reports + done.stdout[-2000:] + done.stderr[-3000:]
    assert " passed" in done.stdout
    libraries = list(cache.glob("*.so"))
    assert libraries and all(b"__asan_report" in lib.read_bytes() for lib in libraries)  # the kernels ran built so


# -- all or nothing: one mutation at a time -----------------------------------------------------------------
FUZZ_CONFIGS = {
    "int8 with patches": (torch.optim.AdamW, {"lr": 1e-2}, torch.float32, {"fmt": "int8", "outliers": 2}),
    "sqrt8 stochastic, amsgrad": (torch.optim.AdamW, {"amsgrad": True}, torch.float32,
                                  {"fmt": "sqrt8", "rounding": "stochastic"}),
    "dynamic8, exact bf16 masters": (torch.optim.Adam, {"weight_decay": 0.1}, torch.bfloat16,
                                     {"fmt": "dynamic8", "outliers": 1, "master_weights": "exact"}),
    "fp8, 8bit masters": (torch.optim.AdamW, {}, torch.bfloat16, {"fmt": "fp8_e4m3", "master_weights": "8bit"}),
    "SGD": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}, torch.float32, {"fmt": "int8", "outliers": 1}),
    "Adafactor": (torch.optim.Adafactor, {"lr": 1e-2}, torch.float32, {"fmt": "int8"}),
    "sqrt4 m, sqrt8 v, exact bf16 masters": (torch.optim.AdamW, {}, torch.bfloat16,
                                             {"fmt": {"exp_avg": "sqrt4", "exp_avg_sq": "sqrt8"},
                                              "master_weights": "exact"}),
}
FUZZ_SHAPES = [(9, 40), (70,), (9, 40)]  # two of one shape: another param's states fit


def fuzz_optimizer(name: str, seed: int) -> tuple[torch.optim.Optimizer, list[torch.nn.Parameter]]:
    cls, kwargs, dtype, options = FUZZ_CONFIGS[name]
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in FUZZ_SHAPES]
    opt = lowbit_compile(cls(params, **kwargs), backend="reference", block_size=BLOCK, min_8bit_size=0, **options)
    train(opt, params, 2, seed=seed)
    return opt, params


def values_for(value: object, other: object) -> list[object]:
    """What one entry is replaced by: wrong types, NaN, wrong shapes, huge sizes, another param's."""
    out: list[object] = ["x", None, float("nan"), 10**30, -1, [1, 2], {"a": 1}, other]
    if isinstance(value, torch.Tensor):
        out += [value.new_zeros(value.shape[:-1] + (value.shape[-1] + 1,)) if value.dim() else value.new_zeros(2),
                torch.full_like(value, float("nan"), dtype=torch.float32), value.to(torch.int64)]
    elif isinstance(value, dict):
        out += [{}]
    return out


def mutations(sd: dict):
    """``(where, state dict)`` with one entry changed, removed or added, each in turn (deterministic)."""
    def replaced(path: tuple, new: object, drop: bool = False) -> dict:
        top = dict(sd)
        node = top
        for key in path[:-1]:
            child = node[key]
            child = list(child) if isinstance(child, list) else dict(child)
            node[key] = child
            node = child
        if drop:
            del node[path[-1]]
        else:
            node[path[-1]] = new
        return top

    yield "extra top-level key", replaced(("extra",), 1)
    for key in ("state", "param_groups"):
        yield f"no {key}", replaced((key,), None, drop=True)
        for new in ("x", None, [1]):
            yield f"{key} = {new!r}", replaced((key,), new)
    group = sd["param_groups"][0]
    for key, value in group.items():
        news = [[0], ["a", "b", "c"], [2, 1, 0], [0, 0, 1]] if key == "params" else values_for(value, 0.5)
        for new in news:
            yield f"group {key} = {new!r:.40}", replaced(("param_groups", 0, key), new)
        yield f"group without {key}", replaced(("param_groups", 0, key), None, drop=True)
    yield "group with an extra key", replaced(("param_groups", 0, "extra"), "x")
    indices = list(sd["state"])
    for i, idx in enumerate(indices):
        other = sd["state"][indices[(i + 1) % len(indices)]]
        for new in ("x", None, {}, other):
            yield f"state[{idx}] = {type(new).__name__}", replaced(("state", idx), new)
        yield f"no state[{idx}]", replaced(("state", idx), None, drop=True)
        yield f"state[{idx}] with an extra key", replaced(("state", idx, "extra"), torch.zeros(3))
        for key, value in sd["state"][idx].items():
            for new in values_for(value, other.get(key)):
                yield f"state[{idx}][{key!r}] = {type(new).__name__}", replaced(("state", idx, key), new)
            yield f"state[{idx}] without {key!r}", replaced(("state", idx, key), None, drop=True)
            if isinstance(value, dict):
                for field, part in value.items():
                    theirs = other.get(key, {}).get(field) if isinstance(other.get(key), dict) else None
                    for new in values_for(part, theirs):
                        yield (f"state[{idx}][{key!r}][{field!r}] = {type(new).__name__}",
                               replaced(("state", idx, key, field), new))
                    yield f"state[{idx}][{key!r}] without {field!r}", replaced(("state", idx, key, field), None,
                                                                               drop=True)
    yield "an extra state entry", replaced(("state", 99), dict(sd["state"][indices[0]]))


def structure(opt: torch.optim.Optimizer, params: list[torch.Tensor]) -> list:
    """What a clean load and step give each state: its kind, format, dtype and shape."""
    return [{k: (type(v).__name__, getattr(v, "fmt", None), getattr(v, "dtype", None), getattr(v, "shape", None))
             for k, v in opt.state[p].items()} for p in params]


FUZZ_FAST = 250  # mutations per configuration in the fast tier (every k-th of them, in order); the slow tier runs all


@pytest.mark.parametrize("every", [pytest.param(False, id="sampled"), pytest.param(True, id="all", marks=pytest.mark.slow)])
@pytest.mark.parametrize("name", sorted(FUZZ_CONFIGS))
def test_a_load_is_all_or_nothing_whatever_one_entry_holds(name, every, one_thread):
    """Each entry of a valid checkpoint changed in turn (wrong types, strings, None, NaN, wrong shapes,
    huge numbers, missing and extra keys, another param's tensors): the load either raises a
    ValueError or TypeError that names what is wrong and leaves every param, state and hyperparameter
    bit for bit as it was, or it succeeds and the optimizer steps, its states as a clean load's (and
    an unknown key kept, as the stock loader keeps one)."""
    source, _ = fuzz_optimizer(name, seed=1)
    sd = saved_and_loaded(source.state_dict())
    clean, clean_params = fuzz_optimizer(name, seed=2)
    clean.load_state_dict(sd)
    train(clean, clean_params, 1, seed=3)
    expected = structure(clean, clean_params)
    live, params = fuzz_optimizer(name, seed=2)
    count, loaded = 0, 0
    cases = list(mutations(sd))
    stride = 1 if every else -(-len(cases) // FUZZ_FAST)
    for where, mutated in [c for i, c in enumerate(cases) if i % stride == 0 or "extra" in c[0]]:
        count += 1
        before = snapshot(live, params)
        try:
            live.load_state_dict(mutated)
        except (ValueError, TypeError) as err:
            assert any(w in str(err) for w in ("param_groups", "state", "parameter")), f"{where}: {err!r}"
            assert_unchanged(live, params, before)
            continue
        except Exception as err:
            raise AssertionError(f"{where}: the load raised {type(err).__name__}: {err}") from err
        loaded += 1
        try:
            train(live, params, 1, seed=3)
        except Exception as err:
            raise AssertionError(f"{where}: loaded, then the step raised {type(err).__name__}: {err}") from err
        got = structure(live, params)  # an unknown key is kept, as the stock loader keeps it
        assert [{k: g.get(k) for k in e} for g, e in zip(got, expected)] == expected, where
        live, params = fuzz_optimizer(name, seed=2)
    assert count > (250 if every else 140) and 0 < loaded < count


# -- other libraries' state dicts ---------------------------------------------------------------------------
def foreign(opt: torch.optim.Optimizer, entry) -> dict:
    """A state dict of ``opt``'s groups whose every entry is ``entry(param)``."""
    sd = opt.state_dict()
    params = [p for g in opt.param_groups for p in g["params"]]
    return {"param_groups": sd["param_groups"], "state": {i: entry(p) for i, p in enumerate(params)}}


def bnb_entry(p: torch.Tensor, wrapped: bool) -> dict:
    """A bitsandbytes AdamW8bit entry: blockwise uint8 states, their absmax and maps, wrapped since
    0.48 under one key (FSDP's gathering skips it), at the top before."""
    blocks = -(-p.numel() // 256)
    quant = {"state1": torch.zeros(p.shape, dtype=torch.uint8), "state2": torch.zeros(p.shape, dtype=torch.uint8),
             "qmap1": torch.zeros(256), "qmap2": torch.zeros(256),
             "absmax1": torch.zeros(blocks), "absmax2": torch.zeros(blocks)}
    return {"step": 3, "__bnb_optimizer_quant_state__": quant} if wrapped else {"step": 3, **quant}


_TORCHAO = {name: type(name, (torch.Tensor,), {"__module__": f"torchao.optim.subclass_{bits}"})
            for name, bits in (("OptimState8bit", "8bit"), ("OptimStateFp8", "fp8"), ("OptimState4bit", "4bit"))}


def torchao_entry(p: torch.Tensor, name: str) -> dict:
    """A torchao low-bit AdamW entry: the stock keys, each state one of its tensor subclasses (told
    by class name and module: torchao itself is not imported)."""
    state = lambda: torch.Tensor._make_subclass(_TORCHAO[name], torch.zeros(p.shape))
    return {"step": torch.tensor(3.0), "exp_avg": state(), "exp_avg_sq": state()}


@pytest.mark.parametrize("layout", ["bitsandbytes wrapped", "bitsandbytes", *sorted(_TORCHAO)])
def test_another_librarys_state_dict_is_refused_naming_it_and_what_to_do(layout):
    opt, params = shared("reference")
    if layout.startswith("bitsandbytes"):
        sd, library = foreign(opt, lambda p: bnb_entry(p, layout.endswith("wrapped"))), "bitsandbytes"
    else:
        sd, library = foreign(opt, lambda p: torchao_entry(p, layout)), "torchao"
    refused(opt, params, sd, rf"saved by a {library} optimizer .*convert it first, which keeps its moments .*: "
            r"optimizer\.load_state_dict\(lowbit_compile\.checkpoint\.from_peer_state_dict\(state_dict\)\)")


def test_a_stock_state_dict_of_other_parameters_is_refused_naming_what_to_do():
    opt, params = shared("reference")
    sd = foreign(opt, lambda p: {"step": torch.tensor(3.0), "exp_avg": torch.zeros(p.shape[::-1]),
                                 "exp_avg_sq": torch.zeros(p.shape[::-1])})
    refused(opt, params, sd, r"'exp_avg' of a parameter of shape \(9, 40\) has shape \(40, 9\); the optimizer "
            r"state does not belong to these parameters .*load only the model's and start the optimizer afresh")


def test_a_checkpoint_of_another_layout_loads_with_one_warning_naming_both():
    opt, params = trained("reference")
    sd = saved_and_loaded(opt.state_dict())
    other = lowbit_compile(torch.optim.AdamW(make_params(), lr=1e-2), "sqrt8", block_size=128, min_8bit_size=0,
                           backend="reference")
    with pytest.warns(UserWarning) as caught:
        other.load_state_dict(sd)
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "4 states saved as int8 (blocks of 64, 2 outliers), now sqrt8 (blocks of 128)" in message
    assert caught[0].filename == __file__  # the caller's load_state_dict
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.load_state_dict(sd)  # the same layout: no warning
