"""Optimization profiles (TensorRT's min/opt/max shapes per input): validation, and the two shape points the
importer infers at — `opt` (what tactics are tuned for) and a probe point that tells dynamic axes apart."""
from __future__ import annotations

import logging

import onnx

from kiln.errors import ModelError
from kiln.plan.model import Shape, ShapeRange

log = logging.getLogger("kiln")

Profile = dict[str, ShapeRange]


def declared_inputs(proto: onnx.ModelProto) -> dict[str, list[int]]:
    """Each runtime input's dims as the model declares them (-1 where symbolic or missing)."""
    inits = {i.name for i in proto.graph.initializer}
    out = {}
    for inp in proto.graph.input:
        if inp.name not in inits:
            dims = inp.type.tensor_type.shape.dim
            out[inp.name] = [d.dim_value if d.HasField("dim_value") else -1 for d in dims]
    return out


def _check_shape(name: str, what: str, shape: Shape, declared: list[int]) -> None:
    if len(shape) != len(declared) or any(d not in (-1, s) for d, s in zip(declared, shape)):
        raise ModelError(f"input '{name}': {what} shape {list(shape)} does not match the model's {declared}")
    if any(s <= 0 for s in shape):
        raise ModelError(f"input '{name}': {what} shape {list(shape)} has a dimension < 1")


def resolve_profiles(proto: onnx.ModelProto, input_shapes: dict[str, Shape] | None,
                     profiles: list[dict[str, tuple[Shape, Shape, Shape]]] | None) -> list[Profile]:
    """Every input gets a range in every profile: `input_shapes` fix an input (min=opt=max), dynamic inputs
    that nothing mentions are fixed to 1 in their dynamic axes, as trtexec does (with its warning)."""
    declared = declared_inputs(proto)
    input_shapes, profiles = dict(input_shapes or {}), list(profiles or [])
    named = set(input_shapes) | {n for p in profiles for n in p}
    unknown = sorted(named - set(declared))
    if unknown:
        raise ModelError(f"shape given for unknown input(s) {unknown}; model inputs are {sorted(declared)}")
    resolved: list[Profile] = [{} for _ in profiles or [{}]]
    for name, dims in declared.items():
        for k, profile in enumerate(profiles or [{}]):
            if name in input_shapes:
                fixed = tuple(int(d) for d in input_shapes[name])
                _check_shape(name, "given", fixed, dims)
                resolved[k][name] = ShapeRange(fixed, fixed, fixed)
            elif name in profile:
                resolved[k][name] = _checked_range(name, k, profile[name], dims)
            elif -1 in dims:
                if k == 0:
                    fixed = [1 if d == -1 else d for d in dims]
                    log.warning("Dynamic dimensions required for input: %s, but no shapes were provided. "
                                "Automatically overriding shape to: %s", name, "x".join(map(str, fixed)))
                fixed = tuple(1 if d == -1 else d for d in dims)
                resolved[k][name] = ShapeRange(fixed, fixed, fixed)
            else:
                resolved[k][name] = ShapeRange(tuple(dims), tuple(dims), tuple(dims))
    return resolved


def _checked_range(name: str, index: int, spec, dims: list[int]) -> ShapeRange:
    lo, opt, hi = (tuple(int(d) for d in s) for s in spec)
    for what, shape in (("min", lo), ("opt", opt), ("max", hi)):
        _check_shape(name, f"profile {index} {what}", shape, dims)
    if not all(a <= b <= c for a, b, c in zip(lo, opt, hi)):
        raise ModelError(f"input '{name}', profile {index}: need min <= opt <= max on every axis, got "
                         f"min {list(lo)}, opt {list(opt)}, max {list(hi)}")
    return ShapeRange(lo, opt, hi)


def dynamic_axes(profiles: list[Profile]) -> dict[str, tuple[int, ...]]:
    """Axes whose size is not the same single value in every profile."""
    out = {}
    for name in profiles[0]:
        ranges = [p[name] for p in profiles]
        out[name] = tuple(i for i in range(len(ranges[0].opt))
                          if len({r.min[i] for r in ranges} | {r.max[i] for r in ranges}) > 1)
    return out


def opt_and_probe_shapes(profiles: list[Profile]) -> tuple[dict[str, Shape], dict[str, Shape]]:
    """Profile 0's opt shapes, and shapes that differ from them on every dynamic axis (within some profile)."""
    opt = {name: r.opt for name, r in profiles[0].items()}
    probe = {}
    for name, axes in dynamic_axes(profiles).items():
        if not axes:
            continue
        shape = list(opt[name])
        for i in axes:
            options = [v for p in profiles for v in (p[name].max[i], p[name].min[i]) if v != opt[name][i]]
            shape[i] = options[0]
        probe[name] = tuple(shape)
    return opt, probe


def parse_shape_list(text: str) -> dict[str, Shape]:
    """trtexec's `name:1x3x224x224,other:1x128` (quoted names with ':' allowed as 'a:b':1x2)."""
    out: dict[str, Shape] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        name, sep, dims = item.rpartition(":")
        if not sep or not name:
            raise ModelError(f"bad shape spec '{item}': expected name:1x3x224x224")
        try:
            out[name.strip("'\"")] = tuple(int(d) for d in dims.lower().split("x"))
        except ValueError:
            raise ModelError(f"bad shape spec '{item}': dimensions must be integers joined by 'x'") from None
    return out


def profiles_from_specs(mins: list[str], opts: list[str], maxs: list[str]) -> list[dict[str, tuple[Shape, ...]]]:
    """Profiles from repeated --min/--opt/--max-shapes flags (the k-th of each makes profile k); opt defaults
    to max and min to opt where one is left out, as trtexec does."""
    count = max(len(mins), len(opts), len(maxs))
    out = []
    for k in range(count):
        lo = parse_shape_list(mins[k]) if k < len(mins) else {}
        mid = parse_shape_list(opts[k]) if k < len(opts) else {}
        hi = parse_shape_list(maxs[k]) if k < len(maxs) else {}
        profile = {}
        for name in list(dict.fromkeys([*lo, *mid, *hi])):
            o = mid.get(name) or hi.get(name) or lo[name]
            profile[name] = (lo.get(name, o), o, hi.get(name, o))
        out.append(profile)
    return out
