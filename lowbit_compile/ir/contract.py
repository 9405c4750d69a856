"""The contract between the graph passes and the lowerings, typed: what each input of a step graph is,
which nodes compute per element, the state nodes ``lowbit::dequantize`` / ``lowbit::quantize_`` and
the master nodes ``lowbit::master_read`` / ``lowbit::master_write_``.

The passes write it into ``node.meta`` with the setters here; the passes after them, the runner and
every backend read it with the accessors here (never by string keys of their own), and
:func:`state_access` and :func:`master_access` are the one parsers of those nodes' arguments.
"""

from __future__ import annotations

import enum
import hashlib
import re
from dataclasses import dataclass
from typing import Any

import torch
from torch.fx import Graph, Node

from ..formats import StateFormat
from ..formats import rounding as state_rounding
from ..formats.residual import SEED as MASTER_SEED
from ..formats.residual import SEED_PERIOD, MasterFormat
from . import ops

lowbit = torch.ops.lowbit
aten = torch.ops.aten


class Role(enum.Enum):
    """What one input of a step graph holds."""

    PARAM = "param"
    GRAD = "grad"
    STATE = "state"  # an entry of ``optimizer.state[p]``, until ``roles`` tells which of the two below
    PER_ELEMENT_STATE = "per_element_state"  # shaped like the param (exp_avg, ...)
    SCALAR_STATE = "scalar_state"  # anything else (the step count)
    HYPERPARAMETER = "hyperparameter"  # a float or tensor of the param group (lr, betas, ...)
    STATE_PART = "state_part"  # one storage tensor of a quantized per-element state
    MASTER_PART = "master_part"  # the residual (or its tie bits) of a 16-bit param's fp32 master


class Part(enum.Enum):
    """The storage tensors of one quantized state, in the order the state ops take them."""

    CODES = "codes"
    SCALES = "scales"
    PATCH_VALUES = "patch_values"
    PATCH_INDEX = "patch_index"


PARTS = tuple(Part)
PER_ELEMENT_ROLES = frozenset({Role.PARAM, Role.GRAD, Role.PER_ELEMENT_STATE, Role.STATE_PART, Role.MASTER_PART})


@dataclass(frozen=True)
class GraphInput:
    """One placeholder of a step graph: its role, the state key (or the hyperparameter's slot in the
    param group) and, for a storage tensor, which part of its state it is."""

    role: Role
    key: Any = None
    part: Part | None = None


@dataclass(frozen=True)
class Temporary:
    """The key of a per-element input that is no state: a value one stage of a staged step gives a
    later one (``passes.stages``), alive while one parameter steps."""

    index: int


_PLAIN_KEY = re.compile(r"[a-z][a-z0-9]*(?:_[a-z0-9]+)*")
_HASHED_KEY = re.compile(r"k[0-9a-f]{32}")


def identifier(key: object) -> str:
    """The name generated code (the graph's Python, the C++ and Triton kernels) gives a state or
    hyperparameter ``key``: the key itself where it is a short lower-case name (``exp_avg``, ``lr``),
    else ``k`` and 128 bits of a hash of it. Keys come from param groups and checkpoints, so nothing
    else of one reaches source; no plain key has the hashed form, so two keys never share a name."""
    if (isinstance(key, str) and len(key) <= 48 and _PLAIN_KEY.fullmatch(key)
            and not _HASHED_KEY.fullmatch(key)):
        return key
    return "k" + hashlib.sha256(repr(key).encode("utf-8", "backslashreplace")).hexdigest()[:32]


_INPUT = "lowbit_input"
_PER_ELEMENT = "lowbit_per_element"
_WHOLE_TENSOR = "lowbit_whole_tensor"


def set_input(node: Node, value: GraphInput) -> None:
    node.meta[_INPUT] = value


def input_of(node: Node) -> GraphInput | None:
    """The input description of a placeholder (None for other nodes)."""
    return node.meta.get(_INPUT)


def role_of(node: Node) -> Role | None:
    value = input_of(node)
    return value.role if value is not None else None


def set_per_element(node: Node, value: bool) -> None:
    node.meta[_PER_ELEMENT] = value


def is_per_element(node: Node) -> bool:
    """Whether ``node`` holds (or computes from) a value per element of the param."""
    return bool(node.meta.get(_PER_ELEMENT, False))


def set_whole_tensor(node: Node) -> None:
    """Mark ``node`` as computing from a per-element value across elements (a matmul, a norm, a
    transpose): it cannot run one block at a time, only as a torch op on the whole tensor."""
    node.meta[_WHOLE_TENSOR] = True


def is_whole_tensor(node: Node) -> bool:
    return bool(node.meta.get(_WHOLE_TENSOR, False))


@dataclass(frozen=True)
class StateAccess:
    """A ``lowbit::dequantize`` (``value`` None), ``lowbit::quantize_`` or ``lowbit::quantize_stochastic_``
    node, parsed: the state's key, format and storage inputs (in :data:`PARTS` order); the stock dtype
    the state is read as; the new value a quantize stores; for stochastic rounding, the step counter
    input and the state's stream (``formats/rounding.py``)."""

    node: Node
    key: str
    fmt: StateFormat
    parts: tuple[Node, Node, Node, Node]
    dtype: torch.dtype
    value: Node | None = None
    seed: Node | None = None
    stream: int = 0

    @property
    def reads(self) -> bool:
        return self.value is None


def state_access(node: Node) -> StateAccess | None:
    """The parsed state node, or None for any other node."""
    if node.target is lowbit.dequantize.default:
        parts, (tag, dtype_name) = node.args[:4], node.args[4:6]  # then a packed format's ``like``
        return StateAccess(node, _key(parts), StateFormat.from_tag(tag), tuple(parts), ops.DTYPES[dtype_name])
    if node.target is lowbit.quantize_.default:
        value, *parts, tag = node.args
        dtype = value.meta["val"].dtype if isinstance(value, Node) else torch.float32
        return StateAccess(node, _key(parts), StateFormat.from_tag(tag), tuple(parts), dtype, value)
    if node.target is lowbit.quantize_stochastic_.default:
        value, *parts, seed, stream, tag = node.args
        dtype = value.meta["val"].dtype if isinstance(value, Node) else torch.float32
        return StateAccess(node, _key(parts), StateFormat.from_tag(tag), tuple(parts), dtype, value, seed, stream)
    return None


def _key(parts: list) -> str:
    inputs = {input_of(p) for p in parts}
    keys = {i.key for i in inputs if i is not None}
    if len(keys) != 1 or any(i is None or i.role is not Role.STATE_PART for i in inputs):
        raise ValueError(f"a state node's storage inputs must be the parts of one state, got {parts}")
    return keys.pop()


def add_dequantize(graph: Graph, parts: tuple[Node, ...], fmt: StateFormat, dtype: torch.dtype, like: Node) -> Node:
    """Insert (at the graph's insertion point) the node that decodes one state as ``dtype``; a 4-bit
    format's takes ``like``, a node of the state's element count (its codes, two a byte, do not say it)."""
    args = (*parts, fmt.tag(), ops.dtype_name(dtype))
    return graph.call_function(lowbit.dequantize.default, (*args, like) if fmt.packed else args)


def add_quantize(graph: Graph, value: Node, parts: tuple[Node, ...], fmt: StateFormat,
                 seed: Node | None = None, stream: int = 0) -> Node:
    """Insert the node that encodes ``value`` into one state's storage: to nearest, or with a step counter
    ``seed`` stochastically, drawing the bits of ``stream``."""
    if seed is None:
        return graph.call_function(lowbit.quantize_.default, (value, *parts, fmt.tag()))
    return graph.call_function(lowbit.quantize_stochastic_.default, (value, *parts, seed, stream, fmt.tag()))


def state_part_inputs(graph: Graph, key: str, after: Node | None = None) -> tuple[Node, ...]:
    """New placeholders for the storage of state ``key``, in :data:`PARTS` order right after ``after``
    (appended to the graph when None)."""
    parts = []
    for part in PARTS:
        if after is None:
            node = graph.placeholder(f"{identifier(key)}_{part.value}")
        else:
            with graph.inserting_after(after):
                node = graph.placeholder(f"{identifier(key)}_{part.value}")
            after = node
        set_input(node, GraphInput(Role.STATE_PART, key, part))
        set_per_element(node, True)
        parts.append(node)
    return tuple(parts)


@dataclass(frozen=True)
class MasterAccess:
    """A ``lowbit::master_read`` (``value`` None) or ``lowbit::master_write_`` node, parsed: the 16-bit
    param, its residual and tie-bit inputs, the step counter a lossy write rounds with, the format,
    and the new fp32 master a write stores."""

    node: Node
    fmt: MasterFormat
    param: Node
    residual: Node
    ties: Node | None
    seed: Node | None = None
    value: Node | None = None

    @property
    def reads(self) -> bool:
        return self.value is None


def master_access(node: Node) -> MasterAccess | None:
    """The parsed master node, or None for any other node."""
    if node.target is lowbit.master_read.default:
        param, residual, ties, tag = node.args
        return MasterAccess(node, MasterFormat.from_tag(tag), param, residual, ties)
    if node.target is lowbit.master_write_.default:
        value, param, residual, ties, seed, tag = node.args
        return MasterAccess(node, MasterFormat.from_tag(tag), param, residual, ties, seed, value)
    return None


def add_master_read(graph: Graph, param: Node, residual: Node, ties: Node | None, fmt: MasterFormat) -> Node:
    """Insert the node that joins a 16-bit param and its residual into the fp32 master."""
    return graph.call_function(lowbit.master_read.default, (param, residual, ties, fmt.tag()))


def add_master_write(graph: Graph, value: Node, param: Node, residual: Node, ties: Node | None,
                     seed: Node | None, fmt: MasterFormat) -> Node:
    """Insert the node that splits the new fp32 master ``value`` into the param and its residual."""
    return graph.call_function(lowbit.master_write_.default, (value, param, residual, ties, seed, fmt.tag()))


STEP_COUNTERS = frozenset({MASTER_SEED, state_rounding.SEED})  # the scalar states add_step_counter makes


def is_step_counter(node: Node) -> bool:
    """Whether a placeholder is a step counter of stochastic rounding (:func:`add_step_counter`): a scalar
    state of ours, which rows that otherwise share a launch may hold at different values."""
    value = input_of(node)
    return value is not None and value.role is Role.SCALAR_STATE and value.key in STEP_COUNTERS


def add_step_counter(graph: Graph, key: str, after: Node, before: Node) -> Node:
    """A step counter for stochastic rounding (the lossy master residual, stochastically rounded states):
    a new 0-d fp32 scalar-state input ``key`` right after ``after``, which each step advances by one,
    modulo ``SEED_PERIOD`` (so it stays an exact integer), just before ``before``; its readers read the
    value from before the step."""
    with graph.inserting_after(after):
        seed = graph.placeholder(f"state_{identifier(key)}")
    seed.meta["val"] = torch.empty((), dtype=torch.float32)
    set_input(seed, GraphInput(Role.SCALAR_STATE, key))
    with graph.inserting_before(before):
        nxt = graph.call_function(aten.add.Tensor, (seed, 1.0))
        wrapped = graph.call_function(aten.remainder.Scalar, (nxt, float(SEED_PERIOD)))
        graph.call_function(aten.copy_.default, (seed, wrapped))
    for node in (seed, nxt, wrapped):
        node.meta.setdefault("val", torch.empty((), dtype=torch.float32))
        set_per_element(node, False)
    for node in seed.users:
        set_per_element(node, False)
    return seed


def is_view(target: object) -> bool:
    """Whether the op ``target`` returns a view of its input."""
    schema = getattr(target, "_schema", None)
    return schema is not None and bool(schema.returns) and schema.returns[0].alias_info is not None
