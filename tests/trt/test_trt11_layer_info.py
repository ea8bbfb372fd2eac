"""TensorRT 11's engine-inspector JSON (I/O Tensors, Format and Datatype apart, ProfilingVerbosity, Engine Metadata):
read into the same records as the TensorRT 10 file of the same engine, written by kiln with schema=11, and bad
files refused naming the file, the tensor and the field."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import kiln
from kiln.errors import ArtifactError, Error
from kiln.trt.layer_info import layer_info, oneline
from kiln.trt.readers import read_layer_info_json, read_oneline
from kiln.trt.vocab import datatype_precision, split_format_enum
from tests.conftest import make_model

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
CONVERTER = FIXTURES / "make_trt11_layer_info.py"
PAIRS = [("resnet18_trt10_detailed", "resnet18_trt11_detailed", []),
         ("resnet18_trt10_names_only", "resnet18_trt11_names_only", ["--io-from", "resnet18_trt10_detailed"]),
         ("conv_dynamic_int8_fp32out_trt8", "conv_dynamic_int8_fp32out_trt11", [])]


def read(name: str):
    return read_layer_info_json((FIXTURES / f"{name}.layers.json").read_text(), name)


@pytest.mark.parametrize("src,dst,extra", PAIRS)
def test_committed_trt11_fixtures_are_the_converter_output(tmp_path, src, dst, extra):
    extra = [str(FIXTURES / f"{x}.layers.json") if not x.startswith("--") else x for x in extra]
    out = tmp_path / "out.json"
    subprocess.run([sys.executable, str(CONVERTER), str(FIXTURES / f"{src}.layers.json"), str(out), *extra],
                   check=True)
    assert out.read_text() == (FIXTURES / f"{dst}.layers.json").read_text()


@pytest.mark.parametrize("src,dst,extra", PAIRS)
def test_trt10_and_trt11_forms_read_as_the_same_engine(src, dst, extra):
    a, b = read(src), read(dst)
    assert b.layers == a.layers and b.bindings == a.bindings and b.verbosity == a.verbosity
    assert b.precisions == a.precisions and b.layer_types == a.layer_types and not b.notes


def test_trt11_resnet18_layers_precisions_and_io():
    info = read("resnet18_trt11_detailed")
    assert len(info.layers) == 25 and info.precisions == {"INT8": 23, "FP32": 2}
    out = info.layers[1].outputs[0]     # "Thirty-two wide ... Int8 format (kCHW32)" + Datatype "Int8"
    assert out.precision == "INT8" and out.format == "Thirty-two wide channel vectorized row major Int8 format"
    data, logits = info.io_tensors
    assert (data.name, data.io_mode, data.data_type, data.precision, data.dims) == \
        ("data", "Input", "Float", "FP32", (1, 3, 224, 224))
    assert data.profiles[0].min_dims == data.profiles[0].max_dims == (1, 3, 224, 224)
    assert data.profiles[0].format == "Row major linear FP32"
    assert (logits.name, logits.io_mode, logits.dims) == ("resnetv15_dense0_fwd", "Output", (1, 1000))


def test_nvidia_migration_guide_example_reads():
    """The "After (TensorRT 11.x)" I/O Tensors of NVIDIA's migration page, with a names-only layer list."""
    doc = {"ProfilingVerbosity": "kLAYER_NAMES_ONLY", "Layers": ["conv"], "Engine Metadata": {"Multi-Device": "No"},
           "I/O Tensors": [{"Name": "input_0", "IOMode": "Input", "DataType": "Float", "Dimensions": [1, 3, 224, 224],
                            "Location": "Device", "IsShapeInferenceIO": False,
                            "ProfileInfo": [{"MinShape": [1, 3, 224, 224], "OptShape": [1, 3, 224, 224],
                                             "MaxShape": [1, 3, 224, 224],
                                             "Format": "Row major linear FP32 format (kLINEAR)"}]},
                           {"Name": "output_0", "IOMode": "Output", "DataType": "Float", "Dimensions": [1, 1000],
                            "Location": "Device", "IsShapeInferenceIO": False}]}
    info = read_layer_info_json(json.dumps(doc), "g.json")
    assert info.bindings == ("input_0", "output_0") and info.verbosity == "layer_names_only"
    assert info.io_tensors[0].profiles[0].format == "Row major linear FP32 format"
    assert info.metadata == {"Multi-Device": "No"} and not info.notes


@pytest.mark.parametrize("name,precision", [("Float", "FP32"), ("kFLOAT", "FP32"), ("FP32", "FP32"), ("Half", "FP16"),
                                            ("kHALF", "FP16"), ("FP16", "FP16"), ("BFloat16", "BF16"),
                                            ("kINT8", "INT8"), ("Int8", "INT8"), ("kBOOL", "BOOL"),
                                            ("N/A due to dynamic shapes", None)])
def test_datatype_spellings(name, precision):
    assert datatype_precision(name) == precision


def test_format_enum_is_split_off_the_prose():
    assert split_format_enum("Row major linear FP32 format (kLINEAR)") == ("Row major linear FP32 format", "kLINEAR")
    assert split_format_enum("N/A due to dynamic shapes") == ("N/A due to dynamic shapes", None)


def _bad(doc_edit) -> str:
    doc = json.loads((FIXTURES / "resnet18_trt11_detailed.layers.json").read_text())
    doc_edit(doc)
    with pytest.raises(ArtifactError) as exc:
        read_layer_info_json(json.dumps(doc), "bad11.json")
    return str(exc.value)


def test_bad_trt11_files_name_the_file_tensor_and_field():
    msg = _bad(lambda d: d["I/O Tensors"][1].pop("Name"))
    assert msg.startswith("bad11.json: \"I/O Tensors\" entry #1 has no \"Name\"")
    msg = _bad(lambda d: d["I/O Tensors"][0].update(DataType="FP99"))
    assert msg.startswith("bad11.json: I/O tensor 'data': unknown \"DataType\" 'FP99' (TensorRT's data types: Float, ")
    msg = _bad(lambda d: d["Layers"][1]["Outputs"][0].update(Datatype="Quad"))
    assert "layer 'resnetv15_conv0_fwd + resnetv15_batchnorm0_fwd + resnetv15_relu0_fwd + resnetv15_pool0_fwd', " \
           "tensor 'resnetv15_pool0_fwd': unknown \"Datatype\" 'Quad'" in msg
    assert "unknown \"ProfilingVerbosity\" 'LOUD'" in _bad(lambda d: d.update(ProfilingVerbosity="LOUD"))
    assert "\"MinShape\" is '1x3'" in _bad(lambda d: d["I/O Tensors"][0]["ProfileInfo"][0].update(MinShape="1x3"))
    assert "unknown \"IOMode\" 'Sideways'" in _bad(lambda d: d["I/O Tensors"][0].update(IOMode="Sideways"))


@pytest.fixture(scope="module")
def dynamic_engine():
    """Conv + Relu with a dynamic batch (one optimization profile, 1..4, opt 2)."""
    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((4, 3, 3, 3)).astype(np.float32), "w")
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["y"], name="relu")]
    model = make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 8, 8])],
                       [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4, 8, 8])], [w])
    return kiln.build(model, profiles=[{"x": ((1, 3, 8, 8), (2, 3, 8, 8), (4, 3, 8, 8))}], autotune=False)


def test_kiln_writes_the_trt11_schema(dynamic_engine):
    doc = dynamic_engine.layer_info("detailed", schema=11)
    assert list(doc)[:4] == ["ProfilingVerbosity", "Layers", "I/O Tensors", "Engine Metadata"]
    assert doc["ProfilingVerbosity"] == "DETAILED" and "Bindings" not in doc
    x, y = doc["I/O Tensors"]
    assert x == {"Name": "x", "IOMode": "Input", "DataType": "Float", "Dimensions": [-1, 3, 8, 8], "Location": "Device",
                 "IsShapeInferenceIO": False,
                 "ProfileInfo": [{"MinShape": [1, 3, 8, 8], "OptShape": [2, 3, 8, 8], "MaxShape": [4, 3, 8, 8],
                                  "Format": "Row major linear FP32 (kLINEAR)"}]}
    assert (y["Name"], y["IOMode"]) == ("y", "Output")
    assert y["ProfileInfo"] == [{"Format": "Row major linear FP32 (kLINEAR)"}]
    for layer in doc["Layers"]:
        for t in layer["Inputs"] + layer["Outputs"]:
            assert "Format/Datatype" not in t and t["Datatype"] == "Float"
            assert re.fullmatch(r"(Row major linear FP32 \(kLINEAR\)|Channel major FP32 format \(kHWC\))", t["Format"])


@pytest.mark.parametrize("verbosity", ["none", "layer_names_only", "detailed"])
def test_kiln_trt10_and_trt11_exports_read_the_same(dynamic_engine, verbosity):
    a = read_layer_info_json(layer_info(dynamic_engine.plan, verbosity), "10")
    b = read_layer_info_json(layer_info(dynamic_engine.plan, verbosity, schema=11), "11")
    assert (b.layers, b.bindings, b.notes) == (a.layers, a.bindings, a.notes)
    # an empty 10.x layer list cannot say "none"; 11's ProfilingVerbosity does
    assert b.verbosity == verbosity and a.verbosity == ("layer_names_only" if verbosity == "none" else verbosity)
    assert [t.precision for t in b.io_tensors] == ["FP32", "FP32"]


def test_kiln_trt11_oneline_dump_reads_back(dynamic_engine):
    text = oneline(dynamic_engine.layer_info("detailed", schema=11))
    assert ", Format: Row major linear FP32 (kLINEAR), Datatype: Float }" in text
    a = read_oneline(oneline(dynamic_engine.layer_info("detailed")))
    b = read_oneline(text)
    assert b.layers == a.layers and b.bindings == a.bindings == ("x", "y")


def test_unknown_schema_is_refused(dynamic_engine):
    with pytest.raises(Error, match="unknown layer-info schema '12'; use one of 10, 11"):
        dynamic_engine.layer_info("detailed", schema=12)
