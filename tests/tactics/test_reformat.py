"""Reformat copies between NCHW and NHWC: exact in both directions (the C transposes where they apply, torch's
copy elsewhere), no copy when the tensor already has the target layout, other dtypes through torch."""
from __future__ import annotations

import pytest
import torch

from kiln import native
from kiln.tactics import codegen
from kiln.tactics.reformat import FEW_CHANNELS, prepare_reformat, to_format

LAST = torch.channels_last


@pytest.mark.parametrize("shape", [(1, 3, 17, 23), (2, 48, 9, 70), (1, FEW_CHANNELS + 1, 5, 5), (3, 130, 4, 67),
                                   (1, 16, 1, 129)], ids=str)
def test_both_directions_are_exact(shape):
    x = torch.randn(shape)
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
    to_format(torch.randn(1, FEW_CHANNELS + 1, 8, 8), "hwc")   # many channels: torch's copy
    to_format(torch.randn(1, 256, 8, 8).contiguous(memory_format=LAST), "linear")
    assert calls == ["kiln_to_nhwc", "kiln_to_nchw"]
