"""Reformat copies between NCHW and NHWC: exact in both directions (the C transposes for float32 and bf16: whole
register blocks, edges of every size, more images than one; FP32 <-> bf16 conversions as torch rounds), no copy when
the tensor already has the target layout, other dtypes through torch."""
from __future__ import annotations

import ctypes

import pytest
import torch

from kiln import hardware, native
from kiln.tactics import codegen
from kiln.tactics.reformat import prepare_reformat, to_format
from tests.tactics.avx2 import avx2_build

LAST = torch.channels_last


@pytest.mark.parametrize("shape", [(1, 3, 17, 23), (2, 48, 9, 70), (1, 65, 5, 5), (3, 130, 4, 67), (1, 16, 1, 129),
                                   (2, 33, 17, 65), (1, 144, 80, 80), (1, 0, 4, 4)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_both_directions_are_exact(shape, dtype):
    x = torch.randn(shape).to(dtype)
    to_hwc = prepare_reformat("hwc")([x])[0]
    assert to_hwc.is_contiguous(memory_format=LAST) and torch.equal(to_hwc, x)
    back = prepare_reformat("linear")([to_hwc])[0]
    assert back.is_contiguous() and torch.equal(back, x)


def test_no_copy_when_already_in_the_target_layout_and_other_dtypes_use_torch():
    x = torch.randn(1, 8, 4, 4)
    assert to_format(x, "linear") is x
    y = x.contiguous(memory_format=LAST)
    assert to_format(y, "hwc") is y
    ints = torch.arange(2 * 5 * 3 * 3).reshape(2, 5, 3, 3)
    assert torch.equal(to_format(ints, "hwc"), ints) and to_format(ints, "hwc").is_contiguous(memory_format=LAST)


@pytest.mark.skipif(not codegen.available(), reason="no C compiler")
def test_the_c_transposes_run_where_they_apply(monkeypatch):
    lib, calls = native.library("reformat"), []

    class Spy:
        def __getattr__(self, name):
            calls.append(name)
            return getattr(lib, name)
    monkeypatch.setattr("kiln.native.library", lambda name, generated="": Spy())
    to_format(torch.randn(1, 16, 8, 8), "hwc")
    to_format(torch.randn(1, 256, 8, 8), "hwc")
    to_format(torch.randn(1, 256, 8, 8).contiguous(memory_format=LAST), "linear")
    to_format(torch.randn(1, 256, 8, 8).bfloat16(), "hwc")   # bf16 as 32-bit lanes
    to_format(torch.randn(1, 256, 8, 8).half(), "hwc")       # other dtypes: torch's copy
    assert calls == ["kiln_to_nhwc", "kiln_to_nhwc", "kiln_to_nchw", "kiln_to_nhwc"]


@pytest.mark.skipif(not (codegen.available() and hardware.has_any(("avx2",))), reason="no C compiler or no AVX2")
def test_the_avx2_build_transposes_and_copies_exactly(tmp_path):
    """reformat.c compiled for AVX2 alone (-march=x86-64-v3: 8 x 8 register blocks, 8-lane conversions, as on a
    Zen 3)."""
    lib = avx2_build("reformat", tmp_path)
    for n, c, h, w in [(2, 19, 5, 13), (1, 64, 8, 8), (1, 3, 11, 11)]:
        x = torch.randn(n, c, h, w)
        hwc, back = torch.empty(n, h, w, c), torch.empty(n, c, h, w)
        lib.kiln_to_nhwc(x.data_ptr(), hwc.data_ptr(), n, c, h * w, 0)
        lib.kiln_to_nchw(hwc.data_ptr(), back.data_ptr(), n, c, h * w, 0)
        assert torch.equal(hwc, x.permute(0, 2, 3, 1)) and torch.equal(back, x)
        hwc16 = torch.empty(n, h, w, c, dtype=torch.bfloat16)   # FP32 -> bf16, rounded; bf16 -> bf16, exact
        lib.kiln_to_nhwc(x.data_ptr(), hwc16.data_ptr(), n, c, h * w, 2)
        back16 = torch.empty(n, c, h, w, dtype=torch.bfloat16)
        lib.kiln_to_nchw(hwc16.data_ptr(), back16.data_ptr(), n, c, h * w, 3)
        assert torch.equal(hwc16, x.bfloat16().permute(0, 2, 3, 1)) and torch.equal(back16, x.bfloat16())
    # the row-chunk copies too: 8-lane conversions and their tails, fixed-size and run-time-size rows
    from kiln.tactics.copy_c import CopyPart

    for c in (16, 12, 21):
        a32, b16 = torch.randn(40, c), torch.randn(40, c).to(torch.bfloat16)
        for out_type in (torch.bfloat16, torch.float32):
            y = torch.empty(40, 2 * c, dtype=out_type)
            parts = (CopyPart * 2)(CopyPart(c, 0, c, 0, 4), CopyPart(c, 0, c, c, 2))
            srcs = (ctypes.c_void_p * 2)(a32.data_ptr(), b16.data_ptr())
            lib.kiln_copy_rows(parts, 2, srcs, y.data_ptr(), 2 * c, out_type.itemsize, 40, 2 * c)
            assert torch.equal(y, torch.cat([a32.to(out_type), b16.to(out_type)], 1))


@pytest.mark.skipif(not codegen.available(), reason="no C compiler")
@pytest.mark.parametrize("io,src,dst", [(1, torch.bfloat16, torch.float32), (2, torch.float32, torch.bfloat16)],
                         ids=["widen", "narrow"])
def test_the_transposes_convert_as_torch_rounds(io, src, dst):
    x = (torch.randn(2, 37, 6, 11) * 100).to(src)
    x[0, 0, 0, :3] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    lib = native.library("reformat")
    hwc = torch.empty(2, 6, 11, 37, dtype=dst)
    lib.kiln_to_nhwc(x.data_ptr(), hwc.data_ptr(), 2, 37, 66, io)
    want = x.to(dst).permute(0, 2, 3, 1)
    assert torch.equal(hwc.float().nan_to_num(7.0), want.float().nan_to_num(7.0))
    back, channel_major = torch.empty(2, 37, 6, 11, dtype=dst), x.permute(0, 2, 3, 1).contiguous()
    lib.kiln_to_nchw(channel_major.data_ptr(), back.data_ptr(), 2, 37, 66, io)
    assert torch.equal(back.float().nan_to_num(7.0), x.to(dst).float().nan_to_num(7.0))


@pytest.mark.parametrize("dtype,granted", [("uint8", "INT8"), ("int8", "INT8"), ("bfloat16", "FP32"),
                                           ("float32", "FP32")])
def test_a_reformat_is_granted_int8_where_it_moves_int8_bytes(dtype, granted):
    """A Reformat computes nothing and requests nothing: moving INT8 bytes it is granted INT8; moving bf16 it stays
    FP32 (the accuracy budget would take a BF16 Reformat for a layer it can keep in FP32). The lowering labels each
    Reformat so as it makes it (the INT8 detector test checks the plan's: granted INT8, nothing requested)."""
    from kiln.tactics.lower import reformat_precision

    assert reformat_precision(dtype) == granted
