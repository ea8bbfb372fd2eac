"""Runs of consecutive layers on kiln's oneDNN primitives (kiln.tactics.onednn_prim's ChainLink) and on C kernels
of kiln's own that can join them (kiln.tactics.base.CallLink: LayerNorm), executed as one C call
(kiln_dnnl_run_chain) instead of one Python kernel call each: ResNet-50 is 53 such layers in a row, a BERT
encoder layer 6 of its 7. Besides the call itself, a Python step after a large kernel finds the interpreter's and
torch's code and data evicted: on the Zen 4 a torch Cast of 128 values took 57 us right after a 128x768x3072
linear layer against 4 us after another Cast.

Per input shapes a run's tensors get fixed buffers, made once: a tensor only the run reads lives in a workspace
arena (tensors with disjoint lifetimes share bytes), a residual summed in place shares its dying buffer with the
output, and a tensor read after the run (or an engine output) is made new per inference, as the interpreter makes
every other. A call then only sets the addresses of the run's inputs and new outputs. Zen 4, 2 threads: a chain of
200 tiny 1x1 convolutions costs 4.7 us a layer, kernel included, against 12.3 run layer by layer."""
from __future__ import annotations

import ctypes
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kiln import native
from kiln.errors import Error
from kiln.plan.liveness import place
from kiln.runtime.donation import sole_owner
from kiln.tactics.base import CallLink, storage_dtype
from kiln.tactics.onednn_prim import R_NONE, R_SUM, ChainLink

MIN_LAYERS = 2
RUNS_KEPT = 4   # per chain, the input shapes whose buffers stay made (a dynamic engine's)
# per call in kiln_dnnl_run_chain: rows, x slot, y slot, residual slot, bytes copied, table, y bytes (a C kernel's:
# its function, x slot, y slot, second input's slot, 0, its parameters, 0)
FIELDS = 7


@dataclass(frozen=True)
class ChainCall:
    """One layer of a chain: its name and op (for errors), its link, the tensors it reads and writes."""

    layer: str
    op_type: str
    link: ChainLink | CallLink
    x: str
    residual: str | None
    y: str


class Chain:
    """steps[start:stop] of an interpreter, run as one. `outputs`: the tensors it writes that are read after it
    (or kept); `frees`: the tensors that die in it; `alias`: an output summed into its residual's dying buffer ->
    that residual; `donated`: the calls whose residual, from before the chain, dies there (its buffer may take
    the output where no one else holds it). Its runs by input shapes are made on first sight."""

    def __init__(self, start: int, stop: int, calls: tuple[ChainCall, ...], outputs: frozenset[str],
                 frees: tuple[str, ...], alias: dict[str, str], donated: frozenset[int]):
        self.start, self.stop, self.calls, self.outputs = start, stop, calls, outputs
        self.frees, self.alias, self.donated = frees, alias, donated
        self.runs: OrderedDict[tuple, ChainRun] = OrderedDict()
        self.last: tuple = ((), None)   # the last inference's (input shapes, run): a static engine's every one
        locks = {id(c.link.lock): c.link.lock for c in calls}
        self.locks = tuple(locks[k] for k in sorted(locks))   # taken in one order: no deadlock
        # the tensors it reads from before it: (name, the dtype its first reader takes or None, that reader's layout)
        produced, reads = set(), {}
        for c in calls:
            for name, dtype in ((c.x, c.link.x_dtype), (c.residual, None)):
                if name is not None and name not in produced and name not in reads:
                    reads[name] = (name, dtype, c.link.memory_format)
            produced.add(c.y)
        self.reads = tuple(reads.values())

    def run(self, env: dict[str, torch.Tensor]) -> None:
        """One inference of the chain on `env` (read, updated with its outputs, its dead tensors dropped)."""
        inputs = []
        for name, dtype, fmt in self.reads:
            t = env[name]
            inputs.append(t.contiguous(memory_format=fmt) if dtype is None or t.dtype == dtype else
                          t.to(dtype, memory_format=fmt))
        key = tuple(t.shape for t in inputs)
        for lock in self.locks:
            lock.acquire()
        try:
            made = self.last[1] if key == self.last[0] else self._made(key)
            made.execute(env, inputs)
        finally:
            for lock in self.locks:
                lock.release()
        for name in self.frees:
            env.pop(name, None)

    def _made(self, key: tuple) -> ChainRun:
        """The run for these input shapes: kept, or made (the least recently used dropped past RUNS_KEPT)."""
        made = self.runs.get(key)
        if made is None:
            made = self.runs[key] = ChainRun(self, {read[0]: shape for read, shape in zip(self.reads, key)})
            if len(self.runs) > RUNS_KEPT:
                self.runs.popitem(last=False)
        else:
            self.runs.move_to_end(key)
        self.last = (key, made)
        return made


class ChainRun:
    """A chain's buffers for one set of input shapes: its primitives' handles, the calls' slots, the workspace."""

    def __init__(self, chain: Chain, input_shapes: dict[str, torch.Size]):
        self.chain = chain
        shapes: dict[str, tuple] = {}   # produced tensor -> (shape, strides, dtype)
        entries = []
        for call in chain.calls:
            x_shape = input_shapes[call.x] if call.x in input_shapes else shapes[call.x][0]
            try:
                if isinstance(call.link, CallLink):   # kiln's own C kernel: its function and parameters
                    params, shape, strides = call.link.bind(torch.Size(x_shape))
                    prim, handle, rows = params, None, call.link.function
                else:
                    prim, handle, rows, shape, strides = call.link.primitives.get(torch.Size(x_shape))
            except RuntimeError as exc:
                raise Error(f"layer '{call.layer}' ({call.op_type}) failed: RuntimeError: {exc}") from None
            entries.append((prim, handle, rows))
            shapes[call.y] = (tuple(shape), tuple(strides), call.link.out_dtype)
        self.primitives = [e[0] for e in entries]   # kept alive: a shape's primitive may leave its layer's cache
        # (a C kernel's: its parameters)
        self.shapes = shapes
        self._slots(chain, input_shapes)
        fresh = [root for root, *_ in self.fresh]
        read = [name for name, _, _ in chain.reads]
        # the donated calls whose output is made per inference: (call, its residual's index in the reads and
        # name, its output's index in `fresh`, the bytes copied when the residual cannot be taken)
        self.donations = [(i, read.index(c.residual), c.residual, fresh.index(self._root(c.y)), self._bytes(c.y))
                          for i, c in enumerate(chain.calls) if i in chain.donated and self._root(c.y) in fresh]
        # the tensors read after the chain: (name, index in `fresh`, the dtype it is viewed as, or None: its own)
        self.outputs = [(name, fresh.index(self._root(name)),
                         None if self.shapes[name][2] == self.shapes[self._root(name)][2] else self.shapes[name][2])
                        for name in chain.outputs]
        n = len(chain.calls)
        self.handles = (ctypes.c_void_p * n)(*(e[1] for e in entries))
        self.calls = (ctypes.c_int64 * (FIELDS * n))()
        for i, call in enumerate(chain.calls):
            fields = self._own_fields(call, entries[i][0]) if isinstance(call.link, CallLink) else \
                self._call_fields(call)
            self.calls[FIELDS * i:FIELDS * i + FIELDS] = [entries[i][2], *fields]
        self.failed = ctypes.c_int64(-1)
        self.run_c = native.library("onednn").kiln_dnnl_run_chain
        self.c_args = (n, *(ctypes.addressof(a) for a in (self.handles, self.calls, self.slots, self.failed)))

    def _root(self, name: str) -> str:
        while name in self.chain.alias:
            name = self.chain.alias[name]
        return name

    def _slots(self, chain: Chain, input_shapes: dict[str, torch.Size]) -> None:
        """A slot per input and per buffer (an alias shares its residual's); workspace offsets for the buffers no
        one reads after the chain."""
        roots = {y: self._root(y) for y in self.shapes}
        fresh_roots = {roots[y] for y in self.shapes if y in chain.outputs}
        self.slot = {name: i for i, name in enumerate(input_shapes)}
        for root in dict.fromkeys(roots.values()):
            self.slot[root] = len(self.slot)
        self.slot.update({y: self.slot[r] for y, r in roots.items()})
        self.fresh = [(root, self.slot[root], *self.shapes[root]) for root in dict.fromkeys(roots.values())
                      if root in fresh_roots]   # (buffer, slot, shape, strides, dtype): made per inference
        index = {call.y: i for i, call in enumerate(chain.calls)}
        last = {}
        for i, call in enumerate(chain.calls):
            for name in (call.x, call.residual, call.y):
                if name in roots:
                    last[roots[name]] = i
        intervals = [(root, index[root], last[root], self._bytes(root))
                     for root in dict.fromkeys(roots.values()) if root not in fresh_roots]
        offsets, total = place(intervals)
        self.workspace = torch.empty(total, dtype=torch.uint8)
        self.slots = (ctypes.c_void_p * len(self.slot))()
        base = self.workspace.data_ptr()
        for root, offset in offsets.items():
            self.slots[self.slot[root]] = base + offset

    def _bytes(self, name: str) -> int:
        shape, strides, dtype = self.shapes[name]
        extent = 1 + sum((d - 1) * s for d, s in zip(shape, strides)) if all(shape) else 0
        return extent * dtype.itemsize

    def _call_fields(self, call: ChainCall) -> list[int]:
        """x slot, y slot, residual slot (-1: none), bytes copied (a residual summed in place is copied into the
        output first unless it is the output's own buffer: an alias; a donated one is decided per inference), the
        output table's address (0: none) and the output's bytes."""
        residual = call.link.residual
        r_slot = -1 if residual == R_NONE else self.slot[call.residual]
        copied = residual == R_SUM and r_slot != self.slot[call.y]
        table = call.link.table
        return [self.slot[call.x], self.slot[call.y], r_slot, self._bytes(call.y) if copied else 0,
                0 if table is None else table.data_ptr(), self._bytes(call.y)]

    def _own_fields(self, call: ChainCall, params: torch.Tensor) -> list[int]:
        """A C kernel's call: x slot, y slot, second input's slot (-1: none), 0, its parameters' address, 0."""
        second = -1 if call.residual is None else self.slot[call.residual]
        return [self.slot[call.x], self.slot[call.y], second, 0, params.data_ptr(), 0]

    def execute(self, env: dict[str, torch.Tensor], inputs: list[torch.Tensor]) -> None:
        slots, calls = self.slots, self.calls
        for k, t in enumerate(inputs):   # the reads' slots come first
            slots[k] = t.data_ptr()
        donors = {}
        for i, k, name, j, copied in self.donations:   # a residual no one else holds: the output takes its buffer
            r = inputs[k]
            donate = r is not env[name] or sole_owner(r, env)
            if donate:
                donors[j] = r
            calls[FIELDS * i + 4] = 0 if donate else copied
        made = []
        for j, (_, slot, shape, strides, dtype) in enumerate(self.fresh):
            t = donors.get(j) if donors else None
            made.append(torch.empty_strided(shape, strides, dtype=dtype) if t is None else t)
            slots[slot] = made[j].data_ptr()
        status = self.run_c(*self.c_args)
        if status:
            call = self.chain.calls[self.failed.value]
            raise Error(f"layer '{call.layer}' ({call.op_type}) failed: RuntimeError: oneDNN's primitive failed "
                        f"(status {status})")
        for name, j, dtype in self.outputs:
            env[name] = made[j] if dtype is None else made[j].view(dtype)


def find_chains(steps: Sequence, keep: set[str]) -> list[Chain]:
    """The chains among an interpreter's `steps` (kiln.runtime.interpreter.Step): maximal runs of at least
    MIN_LAYERS layers whose kernels carry a ChainLink, none writing into a Concat's output."""
    chains, start = [], 0
    while start < len(steps):
        stop = start
        while stop < len(steps) and _chainable(steps[stop], steps[start:stop]):
            stop += 1
        if stop - start >= MIN_LAYERS:
            chains.append(_chain(steps, start, stop, keep))
            start = stop
        else:
            start += 1
    return chains


def _link(step) -> ChainLink | CallLink | None:
    link = getattr(step.kernel, "chain_link", None)
    if link is None or step.into_concat is not None or step.concat_rest is not None or len(step.outputs) != 1:
        return None
    return link


def _second(step) -> str | None:
    """The tensor a chained step reads besides its input (a primitive's residual, a C kernel's second input)."""
    at = _link(step).second_at
    return None if at is None else step.args[at][1]


def _reads_tensors(step) -> bool:
    at = _link(step).second_at
    return step.args[0][0] == "tensor" and (at is None or (len(step.args) > at and step.args[at][0] == "tensor"))


def _chainable(step, before: Sequence) -> bool:
    """Whether `step` may follow the chain `before`: a primitive reading its input in the dtype a chained producer
    writes it in, each tensor in the layout its chained producer and every other reader in the chain take, and no
    tensor read both converted (a chain input cast to a primitive's dtype) and as it is (a residual)."""
    link = _link(step)
    if link is None or not _reads_tensors(step):
        return False
    x, residual = step.args[0][1], _second(step)
    for prior in before:
        prior_link = _link(prior)
        if prior.outputs[0] == x and link.x_dtype is not None and prior_link.out_dtype != link.x_dtype:
            return False
        prior_residual = _second(prior)
        touched = {prior.outputs[0], prior.args[0][1], prior_residual} - {None}
        if {x, residual} & touched and prior_link.memory_format != link.memory_format:
            return False
        if (_converts(step) and x == prior_residual) or (_converts(prior) and residual == prior.args[0][1]):
            return False
    return True


def _converts(step) -> bool:
    """Whether the step's primitive casts its input from the type the plan stores it in."""
    x_dtype = _link(step).x_dtype
    return x_dtype is not None and storage_dtype(step.layer.inputs[0].dtype) != x_dtype


def _chain(steps: Sequence, start: int, stop: int, keep: set[str]) -> Chain:
    inner = steps[start:stop]
    calls = tuple(ChainCall(s.layer.name, s.layer.op_type, _link(s), s.args[0][1], _second(s), s.outputs[0])
                  for s in inner)
    produced = {c.y for c in calls}
    read_after = {name for s in steps[stop:] for kind, name in s.args if kind == "tensor"}
    outputs = frozenset(y for y in produced if y in read_after or y in keep)
    frees = tuple(name for s in inner for name in s.free)
    dies = {name: i for i, s in enumerate(inner) for name in s.free}
    alias, donated = {}, set()
    for i, c in enumerate(calls):
        summed_dying = c.link.residual == R_SUM and c.residual != c.x and dies.get(c.residual) == i
        if summed_dying and c.residual in produced:
            alias[c.y] = c.residual
        elif summed_dying and inner[i].in_place is not None:
            donated.add(i)
    return Chain(start, stop, calls, outputs, frees, alias, frozenset(donated))
