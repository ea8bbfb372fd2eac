"""Every kernel compiles warning-free: each csrc library, Winograd's template rendered for both tile sizes, and
generated pointwise programs using every op, built with kiln's flags plus -Wall -Wextra -Werror (no loading)."""
from __future__ import annotations

import dataclasses

import pytest

from kiln.native import LIBRARIES, CompileError, toolchain_for
from kiln.native.catalog import translation_unit
from kiln.native.compiler import SIMD_LIBM, compile_unit
from kiln.tactics.pointwise_c import BINARY, UNARY, VARIADIC, generate, loop_nest
from kiln.tactics.winograd import TILE_SIZES, rendered_source

STRICT = ("-Wall", "-Wextra", "-Werror")


def every_op_programs() -> list[tuple[str, str]]:
    """(label, unit): all unary ops chained on a flat loop; binary, variadic and parametrized ops on a broadcast
    nest (rows addressed per input) with a scalar input compiled in."""
    unary = [{"op": op, "attrs": {}, "args": ["x0" if i == 0 else f"t{i - 1}"]} for i, op in enumerate(UNARY)]
    others = [{"op": "Clip", "args": ["x0", {"const": -1.0}, {"const": 2.0}]}]
    for op in [*BINARY, *VARIADIC]:
        others.append({"op": op, "args": [f"t{len(others) - 1}", "x1"]})
    others += [{"op": "Pow", "args": [f"t{len(others) - 1}", {"const": 3.0}]},
               {"op": "Pow", "args": [f"t{len(others)}", "x2"]},
               {"op": "Mean", "args": [f"t{len(others) + 1}", "x0", "x2"]},
               {"op": "Cast", "attrs": {"to": 1}, "args": [f"t{len(others) + 2}"]}]
    flat = loop_nest((4096,), [(4096,)])
    broadcast = loop_nest((2, 8, 16, 16), [(2, 8, 16, 16), (8, 1, 1), (1,)])
    return [("every unary op, flat", generate(unary, 1, flat)),
            ("binary ops, broadcast, a scalar", generate(others, 3, broadcast, {2: 0.5}))]


def units() -> list[tuple[str, str]]:
    fixed = [(spec.name, translation_unit(spec)) for spec in LIBRARIES.values() if not spec.rendered_by]
    # (a library linking an external one, oneDNN's shim, compiles with its flags where that is installed)
    winograd = [(f"winograd F({m}x{m},3x3)", translation_unit(LIBRARIES["winograd"], rendered_source(m)))
                for m in TILE_SIZES]
    pointwise = [(f"pointwise: {label}", translation_unit(LIBRARIES["pointwise"], unit))
                 for label, unit in every_op_programs()]
    return fixed + winograd + pointwise


@pytest.mark.parametrize("label, unit", units(), ids=[label for label, _ in units()])
def test_kernel_compiles_with_wall_wextra_werror(label, unit, compiler, tmp_path):
    spec = LIBRARIES.get(label)
    if spec is not None and spec.needs:
        if toolchain_for(spec) is None:
            pytest.skip(f"{spec.needs} is not installed here: library '{label}' is not built")
        compiler = toolchain_for(spec)
    assert compile_unit(compiler, unit, tmp_path / "kernel.so", "kernel.c", STRICT) == ""


def test_pointwise_helpers_compile_without_the_vectorized_libm_too(compiler, tmp_path):
    plain = dataclasses.replace(compiler, flags=tuple(f for f in compiler.flags if f not in SIMD_LIBM), libs=("-lm",))
    label, unit = every_op_programs()[0]
    assert compile_unit(plain, unit, tmp_path / "kernel.so", "kernel.c", STRICT) == ""


def test_a_warning_fails_the_strict_build(compiler, tmp_path):
    """The flags above do catch warnings: an unused variable is an error under them."""
    with pytest.raises(CompileError, match=r"\[-Werror=unused-variable\]"):
        compile_unit(compiler, "void f(void) { int spare = 0; }\n", tmp_path / "kernel.so", "kernel.c", STRICT)
