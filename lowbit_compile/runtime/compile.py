"""Trace, rewrite and lower one signature's step into a kernel, cached per process.

A signature is everything a trace depends on (optimizer class, the group's static flags, which
hyperparameters are tensors, param dtype and device type, the state schema) plus the state formats
and the backend. The whole trace-rewrite-build of a step's signatures holds the trace lock, so first
steps taken in several threads at once build each kernel once and never trace concurrently; the C++
compilations of one step's signatures run at the same time.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..config import Config
from ..formats import StateFormat, passthrough
from ..formats.residual import MasterFormat
from ..ir.contract import Role, input_of
from ..kernels.backends import lower
from ..kernels.kernel import Launch, RowLaunch, StepKernel, same_scalar_states
from ..kernels.staged import StagedStep
from ..passes.opmath import LOW_PRECISION
from ..passes.pipeline import Rewrite, rewrite
from ..passes.signs import NonnegProof, prove_nonneg
from ..passes.split import split_prologue
from ..passes.stages import elementwise_stage
from ..passes.trace import BranchFlipped, HyperSlot, Layout, TracedStep, check_branch, hyper_slots
from ..passes.trace_cache import TRACE_LOCK, LruCache, skeleton, trace_group, trace_key, traced
from ..state import sharding
from ..state.kinds import OWN_KEYS
from ..state.schema import StateSchema, example_state


@dataclass
class CompiledStep:
    """One signature's rewritten step, lowered: the kernel and how to bind a parameter to its inputs.

    ``inputs`` says where each top-level input of ``graph`` comes from (see :func:`binding`);
    ``fresh`` lists the per-element states the step creates, with their format and dtype: the runner
    allocates them (unwritten) before the first run, which writes them."""

    kernel: StepKernel
    inputs: tuple[tuple[Role, Any], ...]
    guard: Callable
    graph: torch.fx.GraphModule
    fresh: tuple[tuple[str, StateFormat, torch.dtype], ...] = ()


_compiled: LruCache = LruCache()  # signature -> its compiled steps (one per guard)


@dataclass
class StepRequest:
    """One parameter's step to find or build: its signature (``key``), the values of its
    hyperparameter slots (a compiled step's guard must accept them) and what makes its builder
    (called only when no step of the signature fits)."""

    key: tuple
    values: list
    builder: Callable[[], _Builder]


@dataclass
class _Build:
    """A signature's step being built: its guard now, the step from ``finish()``, and the requests
    (by index) that wait for it."""

    key: tuple
    guard: Callable
    finish: Callable[[], CompiledStep]
    waiting: list[int]


def step_request(opt: torch.optim.Optimizer, group: dict, param: torch.Tensor, state: dict,
                 schema: StateSchema, formats: dict[str, StateFormat], config: Config,
                 master: MasterFormat | None = None) -> StepRequest:
    """The request for this parameter's step, from its state as it is or, when empty, as its first
    step will create it. Changes nothing of ``opt``.

    With ``master``, the step is traced as the fp32 master recipe runs it (fp32 param, grad and
    states; ``schema`` probed so) and rewritten to step the 16-bit ``param`` through its master."""
    tgroup = trace_group(group)
    slots = hyper_slots(tgroup)
    dtype = torch.float32 if master is not None else param.dtype
    state = {k: v for k, v in state.items() if k not in OWN_KEYS}
    example = example_state(state, schema, param)
    opmath = fp32_opmath(group, dtype, formats)  # a master's step is traced in fp32 already
    stochastic = config.stochastic(formats)
    shape = schema.trace_shape(param)
    # a shaped step of a DTensor (FSDP2) runs its torch ops on DTensors of the mesh, as stock does
    placement = sharding.placement(param) if shape is not None else None
    key = (trace_key(opt, tgroup, slots, dtype, param.device, example, schema.per_element, shape), placement,
           tuple(sorted((k, f.tag()) for k, f in formats.items())), config.backend,
           master.tag() if master is not None else None, opmath, tuple(sorted(stochastic)))
    return StepRequest(key, [s.get(tgroup) for s in slots],
                       lambda: _Builder(skeleton(opt), _without_params(tgroup), slots, dtype, param.device, example,
                                        schema, formats, config.backend, master, opmath, stochastic, shape,
                                        placement))


def _without_params(tgroup: dict) -> dict:
    """What a builder keeps of a group (a branching step's builder lives as long as its kernel, in the
    process-wide cache): not the group's parameters."""
    return {k: v for k, v in tgroup.items() if k != "params"}


def compile_steps(requests: Sequence[StepRequest]) -> list[CompiledStep]:
    """The lowered step of each request: one built before, or built now, each signature once, with the
    C++ compilations of different signatures running at the same time. Tracing and rewriting hold the
    trace lock throughout, so threads that ask at once build each signature once; on an error the
    first failing request's is raised once every build has ended."""
    out: list[CompiledStep | None] = [None] * len(requests)
    with TRACE_LOCK:
        building: list[_Build] = []
        for i, request in enumerate(requests):
            found = next((c for c in _compiled.get(request.key, ()) if c.guard(request.values)), None)
            if found is not None:
                out[i] = found
                continue
            pending = next((b for b in building if b.key == request.key and b.guard(request.values)), None)
            if pending is None:
                pending = _Build(request.key, *request.builder().compile(request.values), [])
                building.append(pending)
            pending.waiting.append(i)
        errors = []
        for build in building:
            try:
                compiled = build.finish()
            except Exception as err:  # noqa: BLE001 - the first one is raised below, after every build ends
                errors.append(err)
                continue
            _compiled.setdefault(build.key, []).append(compiled)
            for i in build.waiting:
                out[i] = compiled
        if errors:
            raise errors[0]
    return out  # type: ignore[return-value]


def fp32_opmath(group: dict, dtype: torch.dtype, formats: dict[str, StateFormat]) -> bool:
    """Whether a bf16/fp16 param's update computes in fp32 and rounds once per store (as torch's
    fused optimizers do): with any quantized state, or for a group that asks for ``fused=True``;
    otherwise the step stays the single-tensor one, bit for bit."""
    quantized = any(not f.passthrough for f in formats.values())
    return dtype in LOW_PRECISION and (quantized or bool(group.get("fused")))


@dataclass
class _Builder:
    """Rewrites and lowers traces of one signature; a branching step keeps it to trace and lower the
    other way a branch goes, from the inputs of the step that went that way."""

    opt: torch.optim.Optimizer
    tgroup: dict
    slots: tuple[HyperSlot, ...]
    dtype: torch.dtype
    device: torch.device
    example: dict
    schema: StateSchema
    formats: dict[str, StateFormat]
    backend: str
    master: MasterFormat | None = None
    opmath: bool = False
    stochastic: frozenset[str] = frozenset()  # the states that round stochastically
    shape: Layout | None = None  # a shaped step's (Muon's) param layout: traced and run in stages
    placement: tuple | None = None  # a shaped step's DTensor (device mesh, placements): its torch ops run on those

    def compile(self, values: list) -> tuple[Callable, Callable[[], CompiledStep]]:
        """Trace and rewrite the step for these hyperparameter values and start building its kernel:
        the guard of the result, and what waits for the build and gives it."""
        trace = traced(self.opt, self.tgroup, self.dtype, self.device, self.example, self.schema.per_element,
                       shape=self.shape)
        guard, building = self.lower(trace, values)

        def finish() -> CompiledStep:
            compiled = building()
            if any(n.target is check_branch for n in trace.graph.graph.nodes):
                compiled.kernel = _BranchingRun(self, compiled, trace)
            return compiled

        return guard, finish

    def lower(self, trace: TracedStep, values: list) -> tuple[Callable, Callable[[], CompiledStep]]:
        """Rewrite and lower a trace: the guard of the result, and what waits for its kernel and gives it."""
        request = Rewrite(self.formats, self.stochastic, self.opmath, self.master, staged=self.shape is not None)
        graphs = rewrite(trace.graph, request)
        guard = self._proven(graphs["roles"], trace.guard, values)
        graph = graphs["split"]
        inputs = tuple(binding(n) for n in graph.graph.nodes if n.op == "placeholder")
        fresh = tuple((k, self.formats[k], self.schema.dtypes[k]) for k in trace.fresh)
        kernel = self._staged(graph) if self.shape is not None else lower(graph, self.backend, self.device)
        return guard, lambda: CompiledStep(kernel(), inputs, guard, graph, fresh)

    def _proven(self, roles: torch.fx.GraphModule, guard: Callable, values: list) -> Callable:
        """The guard of a step whose unsigned states the sign pass proves never negative (``guard`` and the
        hyperparameter ranges the proof assumed); a step that can make one negative is refused, and a square
        root of a value kept >= 0 only by cancellation warns."""
        quantized = {k for k, f in self.formats.items() if not f.passthrough}
        if not quantized:
            return guard
        # by slot, not by name: two keys of a param group can give one name ("betas_1", betas[1])
        proof = prove_nonneg(roles, dict(zip(self.slots, values)))
        unsigned = {k for k in quantized if self.formats[k].nonneg}
        if unsigned - proof.states:
            raise RuntimeError(
                f"lowbit-compile stores {sorted(unsigned - proof.states)} unsigned (it proved them never "
                f"negative on the first steps), but this step of {type(self.opt).__name__} with "
                f"{ {s.name: v for s, v in zip(self.slots, values)} } can make them negative; restore() the "
                "optimizer and wrap it again")
        for _, states in proof.fragile_roots:
            if quantized & set(states):
                warnings.warn(
                    f"lowbit-compile: the step of {type(self.opt).__name__} takes a square root of a value "
                    f"computed from {list(states)} that the fp32 step keeps >= 0 only by cancellation; "
                    "the rounding of quantized states can make it negative and the step NaN. Keep these "
                    f"states fp32 (fmt={{..., {', '.join(f'{k!r}: {passthrough().name!r}' for k in states)}}})",
                    stacklevel=3)
        return _and(guard, self.slots, proof) if unsigned else guard

    def _staged(self, graph: torch.fx.GraphModule) -> Callable[[], StagedStep]:
        """The kernel of a staged step: each elementwise stage lowered as a step of its own."""
        building = {name: lower(split_prologue(stage), self.backend, self.device)
                    for name, stage in graph.named_children() if elementwise_stage(name)}
        return lambda: StagedStep(graph, {name: build() for name, build in building.items()}, self.shape.shape,
                                  self.placement)

    def relower(self, args: Sequence[Any], inputs: tuple, exclude: frozenset[int]) -> tuple[TracedStep, CompiledStep]:
        """Trace (or reuse a trace of) the branches the step takes for these inputs, and lower it."""
        tgroup = dict(self.tgroup)
        example = dict(self.example)
        values = []
        for (role, key), value in zip(inputs, args):
            if role is Role.HYPERPARAMETER:
                values.append(value)
                if key.index is None:
                    tgroup[key.key] = value
                else:
                    seq = list(tgroup[key.key])
                    seq[key.index] = value
                    tgroup[key.key] = type(self.tgroup[key.key])(seq)
            elif role is Role.SCALAR_STATE and key not in OWN_KEYS:
                example[key] = value
        with TRACE_LOCK:
            trace = traced(self.opt, tgroup, self.dtype, self.device, example, self.schema.per_element, exclude,
                           self.shape)
            return trace, self.lower(trace, values)[1]()


def _and(guard: Callable, slots: tuple[HyperSlot, ...], proof: NonnegProof) -> Callable:
    """``guard`` and the hyperparameter ranges a non-negativity proof assumed."""
    if not proof.assumptions:
        return guard
    return lambda values: guard(values) and proof.holds(dict(zip(slots, values)))


class _BranchingRun:
    """The kernel of a step whose graph checks branches on values it computes (RAdam's ``rho_t > 5``):
    one lowering per way the branches have gone, the one that ran last tried first.

    Branches depend only on scalar states (the step count) and hyperparameters, so parameters are
    stepped in groups of equal scalar states: a group's first prologue decides the branch for all of
    it, and a lowering whose branch goes the other way raises ``BranchFlipped`` before it writes
    anything of that group. When no lowering fits, the builder traces the branches these inputs take.
    """

    def __init__(self, builder: _Builder, first: CompiledStep, trace: TracedStep) -> None:
        self.builder = builder
        self.inputs = first.inputs
        self.hyper_index = [i for i, (role, _) in enumerate(first.inputs) if role is Role.HYPERPARAMETER]
        self.scalar_states = [i for i, (role, _) in enumerate(first.inputs) if role is Role.SCALAR_STATE]
        self.variants: list[tuple[Callable, StepKernel]] = [(first.guard, first.kernel)]
        self.traced = {id(trace)}
        self.backend = first.kernel.backend

    def launch(self, rows: Sequence[list]) -> RowLaunch:
        return RowLaunch(self._run_groups, rows)

    def _run_groups(self, rows: Sequence[list]) -> None:
        for group in same_scalar_states(rows, self.scalar_states):
            self._run([rows[r] for r in group])

    def _run(self, rows: list) -> None:
        values = [rows[0][i] for i in self.hyper_index]
        for i, (guard, kernel) in enumerate(self.variants):
            if not guard(values):
                continue
            try:
                kernel.launch(rows).run()
            except BranchFlipped:
                continue
            if i:
                self.variants.insert(0, self.variants.pop(i))
            return
        trace, compiled = self.builder.relower(rows[0], self.inputs, frozenset(self.traced))
        self.traced.add(id(trace))
        kernel = _Reordered(compiled.kernel, compiled.inputs, self.inputs)
        self.variants.insert(0, (compiled.guard, kernel))
        kernel.launch(rows).run()


class _Reordered:
    """A kernel taking its inputs in another order (another trace may list the states differently)."""

    def __init__(self, kernel: StepKernel, inputs: tuple, order: tuple) -> None:
        self.kernel = kernel
        self.backend = kernel.backend
        self.index = None if inputs == order else [order.index(b) for b in inputs]

    def launch(self, rows: Sequence[list]) -> Launch:
        if self.index is None:
            return self.kernel.launch(rows)
        return RowLaunch(lambda rows: self.kernel.launch([[row[i] for i in self.index] for row in rows]).run(), rows)


def binding(node: torch.fx.Node) -> tuple[Role, Any]:
    """How the runner finds the value of one top-level input of a compiled step: its role and key (the
    state's name; ``(name, part)`` for a storage tensor; the param-group slot of a hyperparameter)."""
    desc = input_of(node)
    if desc.role is Role.STATE_PART:
        return desc.role, (desc.key, desc.part.value)
    return desc.role, desc.key
