"""Pointwise chains on one INT8 tensor as 256-entry tables (kiln.tactics.lookup_c): the kernel against an
independent mapping, in every INT8 type and layout, on one and two threads; a quantized GELU against
onnxruntime's unfused ops; the layers it must decline."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import kiln
from kiln.tactics import codegen
from kiln.tactics.base import LayerView
from kiln.tactics.lookup_c import LOOKUP_TACTIC, LookupTableTactic
from tests.conftest import assert_one_step_at_most, torch_threads, unfused_onnxruntime
from tests.tactics.test_codegen_qdq import gelu_chain_model

pytestmark = pytest.mark.skipif(not codegen.available(), reason="no C compiler that builds OpenMP shared libraries")

TACTIC = LookupTableTactic()
TYPES = {"uint8": torch.uint8, "int8": torch.int8, "float32": torch.float32}


def view(program, shape, input_dtypes, output_dtype, consts):
    shapes = tuple(tuple(consts[i].shape) if i in consts else shape for i in range(len(input_dtypes)))
    return LayerView("PointWise", "kiln", {"program": program}, shapes, tuple(input_dtypes), consts, (output_dtype,),
                     17, ((),) * len(shapes))


def reversal(shape, in_dtype="uint8", out_dtype="uint8"):
    """DQ(scale 1) -> Neg -> Add(c) -> Q(scale 1): y = c - x, a different output for each of the 256 inputs."""
    lo = -128 if in_dtype == "int8" else 0
    c = float(lo + (-128 if out_dtype == "int8" else 0) + 255)
    program = [{"op": "DequantizeLinear", "attrs": {}, "args": ["x0", "x1", "x2"]},
               {"op": "Neg", "attrs": {}, "args": ["t0"]},
               {"op": "Add", "attrs": {}, "args": ["t1", {"const": c}]},
               {"op": "QuantizeLinear", "attrs": {}, "args": ["t2", "x1", "x3"]}]
    consts = {1: torch.tensor(1.0), 2: torch.tensor(0, dtype=TYPES[in_dtype]),
              3: torch.tensor(0, dtype=TYPES[out_dtype])}
    return view(program, shape, (in_dtype, "float32", in_dtype, out_dtype), out_dtype, consts), c


@pytest.mark.parametrize("in_dtype,out_dtype", [("uint8", "uint8"), ("int8", "int8"), ("uint8", "int8"),
                                                ("int8", "uint8")])
@pytest.mark.parametrize("shape,threads", [((3, 1000), 1), ((1, 5, 7, 11), 1), ((4, 300_001), 2)])
def test_the_kernel_maps_every_byte_through_its_table(in_dtype, out_dtype, shape, threads):
    """Odd sizes (a 64-byte loop and its tail), the parallel path on two threads, every byte value present: each
    output is c - x, so a wrong table half, index bit or block shows."""
    layer, c = reversal(shape, in_dtype, out_dtype)
    assert TACTIC.supports(layer)
    x = torch.randint(-128 if in_dtype == "int8" else 0, 128 if in_dtype == "int8" else 256, shape,
                      dtype=TYPES[in_dtype], generator=torch.Generator().manual_seed(0))
    x.view(-1)[:256] = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(TYPES[in_dtype])   # every byte
    with torch_threads(threads):
        y = TACTIC.prepare(layer)([x, None, None, None])[0]
    assert y.dtype == TYPES[out_dtype] and len(torch.unique(x)) == 256
    torch.testing.assert_close(y.to(torch.int32), int(c) - x.to(torch.int32), rtol=0, atol=0)


def test_a_channel_major_input_keeps_its_layout():
    layer, c = reversal((2, 16, 9, 9))
    x = torch.randint(0, 256, (2, 16, 9, 9), dtype=torch.uint8).contiguous(memory_format=torch.channels_last)
    y = TACTIC.prepare(layer)([x, None, None, None])[0]
    assert y.is_contiguous(memory_format=torch.channels_last) and not y.is_contiguous()
    assert torch.equal(y.to(torch.int32), int(c) - x.to(torch.int32))


def test_a_float_output_is_looked_up_as_floats():
    """DQ(s8) -> Sigmoid: an FP32 table, each output the sigmoid of its dequantized byte."""
    program = [{"op": "DequantizeLinear", "attrs": {}, "args": ["x0", "x1", "x2"]},
               {"op": "Sigmoid", "attrs": {}, "args": ["t0"]}]
    layer = view(program, (5, 333), ("int8", "float32", "int8"), "float32",
                 {1: torch.tensor(0.05), 2: torch.tensor(-7, dtype=torch.int8)})
    x = torch.randint(-128, 128, (5, 333), dtype=torch.int8)
    y = TACTIC.prepare(layer)([x, None, None])[0]
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, torch.sigmoid((x.float() + 7) * 0.05), rtol=1e-6, atol=1e-7)


def test_a_quantized_gelu_chain_is_one_lookup_within_a_step_of_onnxruntime():
    """BERT's quantized GELU (s8 in, Q/DQ between its ops, s8 out) builds to one PointWise layer on kiln's table
    lookup, within a step of onnxruntime's unfused ops on rare values; each of the 256 inputs appears."""
    model = gelu_chain_model()
    engine = kiln.build(model, autotune=False)
    assert [(l.op_type, l.tactic_name) for l in engine.plan.layers] == [("PointWise", LOOKUP_TACTIC)]
    x = {"x": np.random.default_rng(0).integers(-128, 128, (2, 64, 96)).astype(np.int8)}
    got = engine.run(x)["y"]
    assert_one_step_at_most(got, unfused_onnxruntime(model, x))


def test_layers_it_cannot_tabulate_are_declined():
    s, z = torch.tensor(0.1), torch.tensor(3, dtype=torch.int8)
    dq = {"op": "DequantizeLinear", "attrs": {}, "args": ["x0", "x1", "x2"]}
    relu = {"op": "Relu", "attrs": {}, "args": ["t0"]}
    q = {"op": "QuantizeLinear", "attrs": {}, "args": ["t1", "x1", "x2"]}
    assert TACTIC.supports(view([dq, relu, q], (4, 8), ("int8", "float32", "int8"), "int8", {1: s, 2: z}))
    add = {"op": "Add", "attrs": {}, "args": ["t0", "x3"]}
    cases = {
        "a second input read per call": view([dq, add], (4, 8), ("int8", "float32", "int8", "float32"), "float32",
                                             {1: s, 2: z}),
        "a per-channel scale": view([dq, relu, q], (4, 8), ("int8", "float32", "int8"), "int8",
                                    {1: torch.tensor([0.1] * 8), 2: z}),
        "a float input": view([relu], (4, 8), ("float32",), "float32", {}),
        "a bf16 output": view([dq, relu], (4, 8), ("int8", "float32", "int8"), "bfloat16", {1: s, 2: z}),
        "a constant that broadcasts the output": view([dq, add], (4, 8), ("int8", "float32", "int8", "float32"),
                                                      "float32", {1: s, 2: z, 3: torch.ones(1, 1, 1)}),
        "an op other than PointWise": LayerView("Relu", "", {}, ((4, 8),), ("int8",), {}, ("int8",), 17, ((),)),
    }
    for name, layer in cases.items():
        assert not TACTIC.supports(layer), name
