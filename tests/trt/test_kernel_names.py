"""decode_kernel_name on real TensorRT tactic names, kiln tactic names and junk."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from kiln.trt.kernel_names import KernelName, decode_kernel_name

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def test_xmma_interleaved_int8_implicit_gemm():
    k = decode_kernel_name("sm80_xmma_fprop_implicit_gemm_interleaved_i8f32_i8i32_f32_nchw_vect_c_32kcrs_vect_c_32"
                           "_nchw_tilesize64x32x64_stage6_warpsize2x1x1_g1_tensor16x8x32_t1r3s3_alignc4_nchw")
    assert (k.arch, k.library, k.operation, k.algorithm) == ("sm80", "xmma", "fprop", "implicit_gemm")
    assert (k.input_type, k.output_type, k.mma_type, k.accumulator_type, k.compute_type) == \
        ("i8", "f32", "i8", "i32", "f32")
    assert k.layouts == ("nchw_vect_c_32", "kcrs_vect_c_32", "nchw", "nchw")
    assert (k.tile, k.stages, k.warps, k.mma_shape) == ("64x32x64", 6, "2x1x1", "16x8x32")
    assert (k.filter_size, k.groups, k.alignment) == ("r3s3", "g1", "alignc4")
    assert k.uses_tensor_cores and not k.sparse
    assert "interleaved" in k.flags and k.rest == ()


def test_xmma_simt_conv1x1():
    k = decode_kernel_name("sm70_xmma_fprop_conv1x1_i8f32_f32_f32_nchw_vect_c_4kcrs_vect_c_4_nchw_simt_small_batch"
                           "_bias_relu")
    assert (k.arch, k.library, k.operation, k.algorithm) == ("sm70", "xmma", "fprop", "conv1x1")
    assert (k.input_type, k.output_type, k.accumulator_type, k.compute_type) == ("i8", "f32", "f32", "f32")
    assert k.layouts == ("nchw_vect_c_4", "kcrs_vect_c_4", "nchw")
    assert k.flags == ("simt", "small_batch", "bias", "relu")
    assert not k.uses_tensor_cores and k.rest == ()


def test_cudnn_generation_name():
    k = decode_kernel_name("ampere_scudnn_128x64_relu_xregs_large_nn_v1")
    assert (k.arch, k.generation, k.library, k.operation) == ("sm80", "ampere", "cudnn", "fprop")
    assert (k.compute_type, k.tile, k.transpose) == ("f32", "128x64", "nn")
    assert {"relu", "xregs", "large", "v1"} <= set(k.flags) and k.rest == ()


def test_first_layer_and_pooling():
    k = decode_kernel_name("ampere_first_layer_filter3x3_imma_fwd")
    assert (k.arch, k.library, k.operation, k.algorithm) == ("sm80", "trt", "fprop", "first_layer_filter3x3")
    assert k.uses_tensor_cores and k.mma_type == "i8"
    p = decode_kernel_name("sm72_xmma_pooling_IMMA_NCxHW32_gap")
    assert (p.arch, p.library, p.operation, p.algorithm) == ("sm72", "xmma", "pooling", "gap")
    assert p.layouts == ("ncxhw32",) and p.uses_tensor_cores and p.rest == ()


def test_xmma_gemm_fp16():
    k = decode_kernel_name("sm80_xmma_gemm_f16f16_f16f32_f32_tn_n_tilesize128x128x32_stage4_warpsize2x2x1"
                           "_tensor16x8x16")
    assert (k.arch, k.library, k.operation) == ("sm80", "xmma", "gemm")
    assert (k.input_type, k.output_type, k.mma_type, k.accumulator_type, k.compute_type) == \
        ("f16", "f16", "f16", "f32", "f32")
    assert (k.transpose, k.tile, k.stages, k.warps, k.mma_shape) == ("tn_n", "128x128x32", 4, "2x2x1", "16x8x16")
    assert k.uses_tensor_cores and k.rest == ()


def test_sparse_avdt():
    k = decode_kernel_name("sm80_xmma_fprop_avdt_sparse_int8int8_tilesize64x128x32_tapsperload3_threadspercta128"
                           "_r3s3_u2v2_scalebias_relu")
    assert k.sparse and (k.input_type, k.output_type) == ("i8", "i8")
    assert (k.algorithm, k.tile, k.threads_per_cta, k.filter_size, k.stride) == \
        ("avdt", "64x128x32", 128, "r3s3", "u2v2")


def test_myelin_names():
    k = decode_kernel_name("__myl_MulSumAddSigm_0x31f05c5f23a03ce0bee6ae4bd642a14b")
    assert (k.library, k.operation, k.ops) == ("myelin/kgen", "fused", ("Mul", "Sum", "Add", "Sigm"))
    assert k.hash == "0x31f05c5f23a03ce0bee6ae4bd642a14b"
    m = decode_kernel_name("_gemm_mha_v2_0x957a2fe283f77dcf35c142c1390a3e6a")
    assert (m.library, m.operation) == ("myelin/kgen", "mha")


@pytest.mark.parametrize("name, library, operation", [
    ("onednn.conv2d_nhwc_prepacked", "onednn", "fprop"),
    ("onnxruntime.region", "onnxruntime", "region"),
    ("onnxruntime.layer", "onnxruntime", "layer"),
    ("torch.reference", "torch", "reference"),
    ("kiln.reformat_copy", "kiln", "reformat"),
])
def test_kiln_tactic_names(name, library, operation):
    k = decode_kernel_name(name)
    assert (k.library, k.operation) == (library, operation)
    assert k.raw == name


def test_onednn_layout_and_flag():
    k = decode_kernel_name("onednn.conv2d_nhwc_prepacked")
    assert k.layouts == ("nhwc",) and k.flags == ("prepacked",) and k.rest == ()


@pytest.mark.parametrize("junk", ["", "   ", "???", "_", "____", "sm", "sm80", "x" * 100_000, "\x00\xff",
                                  "sm80_xmma_" * 500, "0x", "tilesize", "中文_内核", "a.b.c", ".", "sm80_"])
def test_junk_never_raises(junk):
    k = decode_kernel_name(junk)
    assert isinstance(k, KernelName) and k.raw == junk


def test_non_string_never_raises():
    assert isinstance(decode_kernel_name(None), KernelName)
    assert isinstance(decode_kernel_name(12345), KernelName)


def _tactic_names(path: Path) -> list[str]:
    data = json.loads(path.read_text())
    layers = data["Layers"] if isinstance(data, dict) else data
    return sorted({layer["TacticName"] for layer in layers if isinstance(layer, dict) and layer.get("TacticName")})


def test_every_resnet18_tactic_decodes():
    names = _tactic_names(FIXTURES / "resnet18_trt10_detailed.layers.json")
    assert len(names) == 9
    for name in names:
        k = decode_kernel_name(name)
        assert k.arch and k.operation, name
        assert k.library == "xmma", name
        assert k.rest == (), (name, k.rest)
