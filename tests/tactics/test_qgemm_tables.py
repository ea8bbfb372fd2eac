"""Output tables on INT8 products (kiln.passes.qproduct_table): each requantized byte stored as table[byte] by kiln's
linear and convolution kernels (qgemm.c's mapped16, with and without AVX512-VBMI), by oneDNN's (a lookup after its
call) and by the reference op."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kiln import hardware, native
from kiln.ops import lookup
from kiln.tactics.base import LayerView
from kiln.tactics.onednn_int8 import OneDnnInt8ConvTactic, OneDnnInt8LinearTactic, int8_available
from kiln.tactics.qgemm_c import TABLE_BYTES, QConvDirectTactic, QConvGemmTactic, QLinearGemmTactic, output_table
from tests.tactics.test_qgemm_c import (TORCH, assert_spread, linear_case, needs_vnni, qconv_view, quant, rand_q,
                                        run)


@needs_vnni
@pytest.mark.parametrize("y,table_dtype", [(("uint8", 5, 0.05), "int8"), (("int8", -3, 0.4), "uint8")])
def test_an_output_table_maps_each_stored_byte(y, table_dtype):
    """A product with an output table (kiln.passes.qproduct_table) stores table[byte] for each requantized byte:
    the same bytes as the product alone, then the table, on kiln's kernel and on the reference op; oneDNN's
    quantized linear, which has no such post-op, looks them up after its call."""
    view, xs = linear_case("QMatMul", (2, 9, 48), 0, ("uint8", 3, 0.02), y)
    bytes_ = torch.randperm(256, generator=torch.Generator().manual_seed(3)).tolist()
    table = {"bytes": bytes_, "dtype": table_dtype}
    tabled = LayerView(**{**view.__dict__, "attrs": {**view.attrs, "out_table": table},
                          "output_dtypes": (table_dtype,)})
    plain = run(QLinearGemmTactic(), view, [xs, None, None])
    want = torch.tensor(bytes_, dtype=torch.uint8)[plain.view(torch.uint8).long()].view(TORCH[table_dtype])
    assert QLinearGemmTactic().supports(tabled)
    got = run(QLinearGemmTactic(), tabled, [xs, None, None])
    assert got.dtype == TORCH[table_dtype] and torch.equal(got, want)
    if int8_available():   # oneDNN has no such post-op: it looks the bytes up after the call
        onednn = run(OneDnnInt8LinearTactic(), view, [xs, None, None]).view(torch.uint8).long()
        assert torch.equal(run(OneDnnInt8LinearTactic(), tabled, [xs, None, None]),
                           torch.tensor(bytes_, dtype=torch.uint8)[onednn].view(TORCH[table_dtype]))
    reference = lookup("QMatMul", "kiln").impl
    consts = dict(tabled.const_inputs)
    ref_plain = reference(view.attrs, [xs, consts[1], consts[2]])[0]
    ref = reference(tabled.attrs, [xs, consts[1], consts[2]])[0]
    assert torch.equal(ref, torch.tensor(bytes_, dtype=torch.uint8)[ref_plain.view(torch.uint8).long()]
                       .view(TORCH[table_dtype]))


@needs_vnni
@pytest.mark.parametrize("kh,residual", [(3, False), (1, True)])
def test_a_convolution_with_an_output_table_stores_each_mapped_byte(kh, residual):
    """A convolution that took a pointwise chain (a SiLU, or a ReLU quantized at its own scale) as an output table:
    kiln's kernels, oneDNN's (a lookup after its call) and the reference op store table[byte] of each requantized
    byte (of the sum, with a residual); a dead u8 residual is not written over with s8 bytes."""
    g = torch.Generator().manual_seed(5)
    w = torch.randint(-127, 128, (40, 16, kh, kh), generator=g, dtype=torch.int8)
    x = rand_q((1, 16, 10, 10), "uint8", g)
    r = rand_q((1, 40, 10, 10), "uint8", g).contiguous(memory_format=torch.channels_last) if residual else None
    q = quant(40, y=("uint8", 5, 0.05), r=(7, 0.03) if residual else None)
    view = qconv_view(tuple(x.shape), w, q, (1,) * 4 if kh == 3 else (0,) * 4, residual=residual)
    entries = torch.randperm(256, generator=torch.Generator().manual_seed(3))
    tabled = LayerView(**{**view.__dict__, "output_dtypes": ("int8",), "attrs": {
        **view.attrs, "out_table": {"bytes": entries.tolist(), "dtype": "int8"}}})
    xs = [x, None, None] + ([r] if residual else [])

    def mapped(y):
        return entries.to(torch.uint8)[y.view(torch.uint8).long()].view(torch.int8)
    tactic = QConvDirectTactic() if kh == 3 else QConvGemmTactic()
    assert tactic.supports(tabled)
    plain, got = run(tactic, view, xs), run(tactic, tabled, xs)
    assert_spread(plain)
    assert got.dtype == torch.int8 and torch.equal(got, mapped(plain))
    if residual:
        dead = r.clone()
        out = tactic.prepare(tabled).into_input[1]([x, None, None, dead])[0]
        assert out.dtype == torch.int8 and torch.equal(out, got) and torch.equal(dead, r)
    if int8_available():
        onednn = OneDnnInt8ConvTactic()
        assert torch.equal(run(onednn, tabled, xs), mapped(run(onednn, view, xs)))
    reference, consts = lookup("QConv", "kiln").impl, dict(tabled.const_inputs)
    ref_xs = [x, consts[1], consts[2]] + ([r] if residual else [])
    assert torch.equal(reference(tabled.attrs, ref_xs)[0], mapped(reference(view.attrs, ref_xs)[0]))


@pytest.mark.parametrize("compiled", [True, False])
def test_an_output_table_after_onednns_call_maps_every_byte(compiled, monkeypatch):
    """oneDNN has no table post-op: its tactics look the bytes up after the call, with kiln's lookup kernel in place
    where there is a C compiler (the call's output is fresh), else by torch's indexing; both keep the channels-last
    strides."""
    from kiln.tactics.lookup_c import table_mapper

    if compiled and not native.available():
        pytest.skip("no C compiler: kiln's lookup kernel is not built here")
    monkeypatch.setattr(native, "available", lambda: compiled)
    entries = torch.randperm(256, generator=torch.Generator().manual_seed(1))
    y = torch.arange(256, dtype=torch.uint8).repeat(40).reshape(2, 16, 20, 16).contiguous(memory_format=torch.channels_last)
    want, address = entries.to(torch.uint8)[y.long()], y.data_ptr()
    got = table_mapper({"bytes": entries.tolist(), "dtype": "int8"})(y)
    assert got.dtype == torch.int8 and got.stride() == y.stride()
    assert torch.equal(got.view(torch.uint8), want)
    assert (got.data_ptr() == address) == compiled          # no second buffer for kiln's kernel
    rows = torch.arange(256, dtype=torch.uint8).repeat(2, 2)
    sliced, before = rows[:, :300], rows.clone()                  # not dense: looked up into a new tensor
    assert torch.equal(table_mapper({"bytes": entries.tolist(), "dtype": "uint8"})(sliced),
                       entries.to(torch.uint8)[before[:, :300].long()])
    assert torch.equal(rows, before)


@needs_vnni
@pytest.mark.parametrize("flags", [(), ("-mno-avx512vbmi",)])
def test_the_epilogues_table_lookup_with_and_without_vbmi(flags, tmp_path):
    """qgemm.c's mapped16 picks 16 bytes' entries with vpermi2b where the CPU has AVX512-VBMI, else gathers them
    (a Cascade Lake has VNNI but not VBMI): both give table[byte] for every byte."""
    import ctypes

    from kiln.native.compiler import compile_unit

    if not flags and "avx512vbmi" not in hardware.CPUINFO.read_text().split():
        pytest.skip("this CPU has no AVX512-VBMI: the vpermi2b path is not compiled here (the gather case covers it)")
    unit = ('#include "qgemm.c"\nvoid map16(const uint8_t* in, const uint8_t* table, uint8_t* out) {\n'
            '  _mm_storeu_si128((void*)out, mapped16(_mm_loadu_si128((const void*)in), table));\n}\n')
    compile_unit(native.toolchain(), unit, tmp_path / "map16.so", "map16.c", flags)
    lib = ctypes.CDLL(str(tmp_path / "map16.so"))
    lib.map16.argtypes = [ctypes.c_void_p] * 3
    table = np.zeros(TABLE_BYTES, np.uint8)
    table[:256] = np.random.default_rng(0).permutation(256)
    for start in range(0, 256, 16):
        codes, out = np.arange(start + 15, start - 1, -1).astype(np.uint8), np.zeros(16, np.uint8)
        lib.map16(codes.ctypes.data, table.ctypes.data, out.ctypes.data)
        np.testing.assert_array_equal(out, table[codes])
    # the tactic pads a layer's table as the gather reads it: 4 bytes at each code, the last at 255 ends at byte 258
    padded = output_table(SimpleNamespace(attrs={"out_table": {"bytes": table[:256].tolist(), "dtype": "uint8"}}))
    assert len(padded) == TABLE_BYTES >= 259 and not padded[256:].any()
    assert padded[:256].tolist() == table[:256].tolist()
