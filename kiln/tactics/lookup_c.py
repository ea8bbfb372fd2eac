"""A pointwise chain on one INT8 tensor as a 256-entry table (kiln/native/csrc/quant.c, `kiln_lookup_*`).

A quantized network's activations between Q/DQ pairs are bytes: a fused PointWise layer whose only input read per
call is an INT8 tensor (its other inputs scalar constants) can produce only 256 distinct outputs. They are computed
once at load, by torch's reference implementation of the program on every byte value, and each call is a lookup:
one vpermi2b per 64 bytes with AVX512-VBMI. quantize_static BERT's GELU (DQ, Div, Erf, Q, DQ, Add, Q, DQ, Mul, Q,
DQ, Mul, Q over 1x128x3072) took 320 µs in the generated loop on 2 threads of a Zen 4; the same as a lookup is a
copy's cost. ONNX Runtime's QLinearLookup (QLinearSigmoid, QLinearLeakyRelu) does the same for single ops.
"""
from __future__ import annotations

import numpy as np
import torch

from kiln import native
from kiln.ops.dtypes import INT8_TORCH
from kiln.ops.fused import mapped_bytes, program_on_bytes, table_bytes
from kiln.tactics.base import ANY, LINEAR, Kernel, LayerView
from kiln.tactics.quant_c import dense_layout

LOOKUP_TACTIC = "kiln.lookup_table"
TABLE_OUTPUTS = {**INT8_TORCH, "float32": torch.float32}


def lookup_input(layer: LayerView) -> int | None:
    """The input a PointWise layer reads per call, where it is its only one, an INT8 tensor the output has the shape
    of, and every other input is a one-value constant; else None."""
    if layer.op_type != "PointWise" or layer.domain != "kiln" or len(layer.output_dtypes) != 1 or \
            layer.output_dtypes[0] not in TABLE_OUTPUTS or None in layer.input_shapes:
        return None
    read = [i for i in range(len(layer.input_shapes)) if i not in layer.const_inputs]
    if len(read) != 1 or layer.input_dtypes[read[0]] not in INT8_TORCH:
        return None
    if any(int(np.prod(t.shape)) != 1 for t in layer.const_inputs.values()):
        return None
    shape = tuple(layer.input_shapes[read[0]])
    return read[0] if tuple(np.broadcast_shapes(*layer.input_shapes)) == shape else None


def lookup_table(layer: LayerView, index: int) -> torch.Tensor:
    """The program's output for each byte the input can hold, in byte order (raw bytes for an INT8 output)."""
    consts = [None if i == index else torch.as_tensor(layer.const_inputs[i]) for i in range(len(layer.input_shapes))]
    y = program_on_bytes(layer.attrs["program"], consts, index, layer.input_dtypes[index] == "int8")
    want = TABLE_OUTPUTS[layer.output_dtypes[0]]
    if y.numel() != 256 or y.dtype != want:
        raise RuntimeError(f"the PointWise program gives {y.numel()} {y.dtype} values for 256 bytes, not {want}")
    return y.view(torch.uint8).clone() if want != torch.float32 else y.contiguous()


def table_mapper(table: dict | None):
    """A function mapping the bytes of a kernel's fresh INT8 output through an output table ({"bytes", "dtype"}:
    kiln.passes.qproduct_table), in place where it is dense (kiln's lookup kernel; else into a new tensor, made
    contiguous first, or by torch's indexing where there is no C compiler); the identity where there is no table. For
    kernels without such a post-op (oneDNN's). The entries are made once, here, not per call."""
    if table is None:
        return lambda y: y
    entries, dtype = table_bytes(table), INT8_TORCH[table["dtype"]]
    if not native.available():
        return lambda y: mapped_bytes(y, entries, dtype)
    lookup = native.library("quant").kiln_lookup_u8

    def mapped(y: torch.Tensor) -> torch.Tensor:
        if not dense_layout(y):
            return looked_up(lookup, y, entries, dtype)
        lookup(y.data_ptr(), y.data_ptr(), y.numel(), entries.data_ptr())   # each byte read before it is written
        return y.view(dtype)
    return mapped


def looked_up(lookup, x: torch.Tensor, table: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """table[x] by kiln's C `lookup` (kiln_lookup_u8/f32) into a new tensor of `out_dtype`, `x`'s strides kept."""
    x = x if dense_layout(x) else x.contiguous()
    y = torch.empty_like(x, dtype=out_dtype)
    lookup(x.data_ptr(), y.data_ptr(), x.numel(), table.data_ptr())
    return y


class LookupTableTactic:
    name = LOOKUP_TACTIC
    source = "kiln"
    needs_c_compiler = True

    def supports(self, layer: LayerView) -> bool:
        return lookup_input(layer) is not None and native.available()

    def input_formats(self, layer: LayerView) -> list[str]:
        index = lookup_input(layer)
        return [ANY if i == index else LINEAR for i in range(len(layer.input_shapes))]

    def output_format(self, layer: LayerView, input_formats: list[str]) -> str:
        return input_formats[0]   # the one input read per call (constants are not listed): its layout is kept

    def prepare(self, layer: LayerView) -> Kernel:
        index = lookup_input(layer)
        table = lookup_table(layer, index)
        out_dtype = TABLE_OUTPUTS[layer.output_dtypes[0]]
        lib = native.library("quant")
        lookup = lib.kiln_lookup_f32 if out_dtype == torch.float32 else lib.kiln_lookup_u8

        def run(xs, table=table):
            return [looked_up(lookup, xs[index], table, out_dtype)]   # the same strides: the layout is kept
        run.table = table
        return run
