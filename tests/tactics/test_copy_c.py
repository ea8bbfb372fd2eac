"""kiln's Concat, Slice and Split copies in C (kiln.tactics.copy_c): equal to torch's cat / slicing / split in both
layouts, in every FP32/bf16 storage combination (bf16 rounding equal to torch's) and as INT8 bytes, for any channel
count (vector tails), with a batch read per call; declined for strided, reversed or batch-cutting slices."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kiln import hardware
from kiln.tactics import codegen
from kiln.tactics.base import LayerView
from kiln.tactics.copy_c import CopyRowsBf16Tactic, CopyRowsTactic, layer_ranges

pytestmark = pytest.mark.skipif(not codegen.available(), reason="no C compiler")
bf16_cpu = pytest.mark.skipif(not hardware.has_any(hardware.BF16_ISA),
                              reason="no native BF16 (BF16 tactics are offered only there)")
LAST = torch.channels_last
I64_MAX = 2**63 - 1


def view(op, shapes, dtypes, outputs, attrs=None, consts=None, dynamic=None):
    consts = {i: torch.tensor(v) for i, v in (consts or {}).items()}
    shapes = tuple(shapes) + tuple((len(consts[i]),) for i in sorted(consts))
    dtypes = tuple(dtypes) + ("int64",) * len(consts)
    return LayerView(op, "", attrs or {}, shapes, dtypes, consts, tuple(outputs), 17,
                     dynamic or tuple(() for _ in shapes))


def tensor(shape, dtype="float32", layout="hwc", seed=0):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 3
    x = x.contiguous(memory_format=LAST) if layout == "hwc" else x
    return x.to(getattr(torch, dtype))


def check(got, want, layout):
    assert got.dtype == want.dtype and got.shape == want.shape
    assert got.is_contiguous(memory_format=LAST) if layout == "hwc" else got.is_contiguous()
    assert torch.equal(got.float().nan_to_num(7.0), want.float().nan_to_num(7.0))


CONCATS = [  # shapes, axis, layout
    ([(1, 16, 20, 20)] * 3, 1, "hwc"),                      # YOLO's C2f
    ([(2, 3, 5, 7), (2, 17, 5, 7), (2, 1, 5, 7)], 1, "hwc"),   # vector tails; a one-channel input
    ([(1, 8, 6, 4), (1, 8, 3, 4)], 2, "hwc"),                # along H in NHWC: rows are images
    ([(1, 8, 6, 4), (1, 8, 6, 9)], -1, "hwc"),
    ([(1, 5, 6, 4), (1, 7, 6, 4)], 1, "linear"),
    ([(1, 144, 33), (1, 144, 5)], 2, "linear"),               # YOLO's detect head
    ([(3, 20), (3, 44)], 1, "linear"),
    ([(2, 3, 7001), (2, 5, 7001)], 1, "linear"),             # rows of 56,008 elements: cut into 4 segments
    ([(1, 144, 6400), (1, 144, 1600), (1, 144, 400)], 2, "linear"),   # the head at full size: a row a unit
]


@bf16_cpu
@pytest.mark.parametrize("shapes,axis,layout", CONCATS, ids=lambda c: str(c))
@pytest.mark.parametrize("in_dtypes,out_dtype", [(("float32", "bfloat16"), "bfloat16"),
                                                 (("bfloat16", "float32"), "float32"),
                                                 (("bfloat16", "bfloat16"), "bfloat16")])
def test_concat_equals_torch_cat_in_every_storage(shapes, axis, layout, in_dtypes, out_dtype):
    dtypes = [in_dtypes[i % 2] for i in range(len(shapes))]
    xs = [tensor(s, d, layout, seed=i) for i, (s, d) in enumerate(zip(shapes, dtypes))]
    xs[0][(0,) * xs[0].dim()] = float("nan")
    layer = view("Concat", shapes, dtypes, (out_dtype,), {"axis": axis})
    tactic = CopyRowsBf16Tactic()
    assert tactic.supports(layer)
    want = torch.cat([x.to(getattr(torch, out_dtype)) for x in xs], axis)
    check(tactic.prepare(layer)(xs)[0], want, layout)


@pytest.mark.parametrize("shapes,axis,layout", CONCATS, ids=lambda c: str(c))
def test_fp32_concat_equals_torch_cat(shapes, axis, layout):
    xs = [tensor(s, layout=layout, seed=i) for i, s in enumerate(shapes)]
    layer = view("Concat", shapes, ["float32"] * len(shapes), ("float32",), {"axis": axis})
    assert CopyRowsTactic().supports(layer)
    check(CopyRowsTactic().prepare(layer)(xs)[0], torch.cat(xs, axis), layout)


def int8_tensor(shape, dtype, layout, seed):
    x = torch.randint(-128, 128, shape, generator=torch.Generator().manual_seed(seed)).to(getattr(torch, dtype))
    return x.contiguous(memory_format=LAST) if layout == "hwc" else x


@pytest.mark.parametrize("dtype", ["uint8", "int8"])
@pytest.mark.parametrize("shapes,axis,layout", CONCATS + [([(1, 3, 5, 5), (1, 5, 5, 5)], 1, "hwc")],
                         ids=lambda c: str(c))
def test_int8_concat_copies_bytes_as_torch_cat(shapes, axis, layout, dtype):
    """A quantized detector's concatenations between INT8 convolutions: bytes copied, odd row lengths included."""
    xs = [int8_tensor(s, dtype, layout, seed=i) for i, s in enumerate(shapes)]
    layer = view("Concat", shapes, [dtype] * len(shapes), (dtype,), {"axis": axis})
    assert CopyRowsTactic().supports(layer)
    check(CopyRowsTactic().prepare(layer)(xs)[0], torch.cat(xs, axis), layout)


def test_concat_of_mixed_layouts_is_channel_major():
    """An NCHW input beside NHWC ones is converted first; the output is channel-major, as output_format says."""
    shapes = [(1, 4, 5, 6), (1, 9, 5, 6)]
    xs = [tensor(shapes[0], layout="linear"), tensor(shapes[1], layout="hwc", seed=1)]
    layer = view("Concat", shapes, ("float32",) * 2, ("float32",), {"axis": 1})
    assert CopyRowsTactic().output_format(layer, ["linear", "hwc"]) == "hwc"
    check(CopyRowsTactic().prepare(layer)(xs)[0], torch.cat(xs, 1), "hwc")


def test_a_concat_of_one_channel_inputs_follows_the_plans_layout():
    """One-channel NCHW and NHWC tensors are the same memory; their concat is not. The kernel writes row-major and
    the plan's channel-major record is honoured by as_planned, as the runtime and the autotuner apply it."""
    from kiln.tactics.reference import as_planned

    shapes = [(1, 1, 5, 6), (1, 1, 5, 6)]
    xs = [tensor(s, layout="linear", seed=i) for i, s in enumerate(shapes)]
    layer = view("Concat", shapes, ("float32",) * 2, ("float32",), {"axis": 1})
    kernel = CopyRowsTactic().prepare(layer)
    assert CopyRowsTactic.outputs_as_planned
    check(kernel(xs)[0], torch.cat(xs, 1), "linear")
    check(as_planned(kernel, ["hwc"])(xs)[0], torch.cat(xs, 1), "hwc")


@pytest.mark.parametrize("layout", ["hwc", "linear"])
def test_a_concat_with_a_constant_input(layout):
    """ViT's class token: a weight concatenated before the patches, in whatever layout the patches come."""
    shapes = [(1, 2, 3, 4), (1, 5, 3, 4)]
    token = tensor(shapes[0], layout="linear", seed=9)
    layer = LayerView("Concat", "", {"axis": 1}, tuple(shapes), ("float32",) * 2, {0: token}, ("float32",), 17,
                      ((), ()))
    x = tensor(shapes[1], layout=layout)
    check(CopyRowsTactic().prepare(layer)([None, x])[0], torch.cat([token, x], 1), layout)


SLICES = [  # shape, starts, ends, axes, steps, the reference's index
    ((1, 32, 10, 10), [16], [32], [1], None, (slice(None), slice(16, 32))),     # C2f's second half
    ((1, 32, 10, 10), [0], [16], [1], [1], (slice(None), slice(0, 16))),
    ((1, 33, 4, 4), [-17], [I64_MAX], [-3], None, (slice(None), slice(16, 33))),
    ((2, 6, 9, 5), [2, 0], [7, I64_MAX], [2, 1], None, (slice(None), slice(None), slice(2, 7))),   # along H
    ((1, 64, 7), [3], [60], [2], None, (slice(None), slice(None), slice(3, 7))),   # end past the axis
]


@bf16_cpu
@pytest.mark.parametrize("shape,starts,ends,axes,steps,index", SLICES, ids=range(len(SLICES)))
@pytest.mark.parametrize("x_dtype,y_dtype", [("bfloat16", "bfloat16"), ("float32", "bfloat16"),
                                             ("bfloat16", "float32"), ("float32", "float32")])
def test_slice_equals_torch_indexing(shape, starts, ends, axes, steps, index, x_dtype, y_dtype):
    layout = "hwc" if len(shape) == 4 else "linear"
    consts = {1: starts, 2: ends, 3: axes, **({4: steps} if steps else {})}
    layer = view("Slice", [shape], [x_dtype], (y_dtype,), consts=consts)
    tactic = CopyRowsBf16Tactic()
    assert tactic.supports(layer)
    x = tensor(shape, x_dtype, layout)
    got = tactic.prepare(layer)([x] + [None] * len(consts))[0]
    check(got, x[index].to(getattr(torch, y_dtype)), layout)


@pytest.mark.parametrize("shape,starts,ends,axes,steps,index", SLICES, ids=range(len(SLICES)))
def test_int8_slice_copies_bytes_as_torch_indexing(shape, starts, ends, axes, steps, index):
    layout = "hwc" if len(shape) == 4 else "linear"
    consts = {1: starts, 2: ends, 3: axes, **({4: steps} if steps else {})}
    layer = view("Slice", [shape], ["uint8"], ("uint8",), consts=consts)
    x = int8_tensor(shape, "uint8", layout, 3)
    got = CopyRowsTactic().prepare(layer)([x] + [None] * len(consts))[0]
    check(got, x[index], layout)


@bf16_cpu
@pytest.mark.parametrize("attrs,consts,sizes", [
    ({"axis": 1, "num_outputs": 2}, {}, [16, 16]),
    ({"axis": 1, "num_outputs": 3}, {}, [11, 11, 10]),      # ONNX: the last part smaller
    ({"axis": -3}, {1: [8, 24]}, [8, 24]),
    ({"axis": 1, "split": [5, 27]}, {}, [5, 27]),           # opset < 13: sizes as an attribute
])
def test_split_outputs_each_in_their_storage(attrs, consts, sizes):
    shape = (2, 32, 6, 5)
    outputs = ("bfloat16", "float32", "bfloat16")[:len(sizes)]
    layer = view("Split", [shape], ["float32"], outputs, attrs, consts)
    tactic = CopyRowsBf16Tactic()
    assert tactic.supports(layer)
    x = tensor(shape)
    got = tactic.prepare(layer)([x] + [None] * len(consts))
    assert len(got) == len(sizes)
    for y, want, dtype in zip(got, torch.split(x, sizes, 1), outputs):
        check(y, want.to(getattr(torch, dtype)), "hwc")


def test_the_batch_is_read_per_call():
    shapes = [(1, 8, 3, 3), (1, 24, 3, 3)]
    layer = view("Concat", shapes, ("float32",) * 2, ("float32",), {"axis": 1}, dynamic=((0,), (0,)))
    kernel = CopyRowsTactic().prepare(layer)
    xs = [tensor((5, 8, 3, 3)), tensor((5, 24, 3, 3), seed=1)]
    check(kernel(xs)[0], torch.cat(xs, 1), "hwc")


def test_inputs_shaped_otherwise_than_planned_are_refused():
    """The chunks are worked out from the plan's shapes: a tensor of another shape would be read past its end."""
    shapes = [(1, 8, 3, 3), (1, 24, 3, 3)]
    kernel = CopyRowsTactic().prepare(view("Concat", shapes, ("float32",) * 2, ("float32",), {"axis": 1},
                                           dynamic=((0,), (0,))))
    with pytest.raises(ValueError, match=r"the plan's are \[\['N', 8, 3, 3\], \['N', 24, 3, 3\]\]"):
        kernel([tensor((1, 8, 3, 3)), tensor((1, 16, 3, 3))])
    with pytest.raises(ValueError, match="inputs shaped"):
        kernel([tensor((2, 8, 3, 3)), tensor((1, 24, 3, 3))])


def test_rounding_to_bf16_is_torchs():
    """Round to nearest even at the halfway points, overflow to infinity, subnormals and signed zeros: bit for bit
    torch's conversion; a NaN stays NaN (its payload is kiln's bf16.h's, quiet, where torch's is all ones)."""
    bits = torch.tensor([0x3F808000, 0x3F818000, 0x3F80C000, 0x7F7FFFFF, 0xFF800000, 0x7FC00001, 0x00000001,
                         0x80008000] * 5, dtype=torch.int64).to(torch.int32)
    x = bits.view(torch.float32).reshape(1, 40, 1, 1).contiguous(memory_format=LAST)
    layer = view("Slice", [(1, 40, 1, 1)], ["float32"], ("bfloat16",), consts={1: [0], 2: [40], 3: [1]})
    got = CopyRowsBf16Tactic().prepare(layer)([x, None, None, None])[0]
    want = x.to(torch.bfloat16)
    assert torch.equal(got.isnan(), want.isnan()) and int(want.isnan().sum()) == 5
    numbers = ~want.isnan()
    assert torch.equal(got.view(torch.int16)[numbers], want.view(torch.int16)[numbers])


@pytest.mark.parametrize("layer", [
    view("Slice", [(1, 32, 4, 4)], ["float32"], ("float32",), consts={1: [0], 2: [32], 3: [1], 4: [2]}),
    view("Slice", [(1, 32, 4, 4)], ["float32"], ("float32",), consts={1: [-1], 2: [-I64_MAX], 3: [1], 4: [-1]}),
    view("Slice", [(1, 8, 4, 4)], ["float32"], ("float32",), consts={1: [-1], 2: [-I64_MAX], 3: [2], 4: [-1]}),
    view("Slice", [(4, 8, 4, 4)], ["float32"], ("float32",), consts={1: [1], 2: [3], 3: [0]}),   # the batch
    view("Slice", [(1, 8, 4, 4)], ["float32"], ("float32",), consts={1: [1, 1], 2: [3, 3], 3: [1, 2]}),
    view("Concat", [(2, 4), (3, 4)], ("float32",) * 2, ("float32",), {"axis": 0}),
    view("Concat", [(2, 4), (2, 4)], ("int64",) * 2, ("int64",), {"axis": 1}),
    view("Concat", [(2, 4), (2, 4)], ("bfloat16",) * 2, ("bfloat16",), {"axis": 1}),   # FP32 tactic: no bf16
    view("Concat", [(2, 4), (2, 4)], ("uint8", "float32"), ("float32",), {"axis": 1}),   # bytes are not converted
    view("Slice", [(1, 8, 4, 4)], ["int8"], ("float32",), consts={1: [1], 2: [3], 3: [1]}),
    view("Concat", [(2, 4), (2, 4)], ("uint8", "int8"), ("int8",), {"axis": 1}),   # u8 bytes are no s8 bytes
    view("Split", [(1, 8, 4)], ["float32"], ("float32",) * 2, {"axis": 0, "num_outputs": 2}),
], ids=range(12))
def test_declines_what_it_cannot_copy(layer):
    assert not CopyRowsTactic().supports(layer)


def test_a_slice_with_steps_computed_at_run_time_is_declined():
    layer = LayerView("Slice", "", {}, ((1, 8, 4, 4), (1,), (1,), (1,)), ("float32", "int64", "int64", "int64"),
                      {1: torch.tensor([0]), 2: torch.tensor([4])}, ("float32",), 17, ((), (), (), ()))
    assert layer_ranges(layer) is None


@pytest.fixture(scope="module")
def yolo_onnx(tmp_path_factory):
    from tests.models.detectors import export, make

    path = tmp_path_factory.mktemp("copy") / "yolov8.onnx"
    export(make("yolov8"), torch.randn(1, 3, 64, 64), path, "legacy")
    return str(path)


def copy_layers(engine):
    return [l for l in engine.layer_info()["Layers"] if l["LayerType"] in ("Concatenation", "Slice", "Split")]


def test_yolov8_on_kilns_kernels_copies_every_split_and_concat_in_c(yolo_onnx, tmp_path):
    """On kiln's kernels alone every Slice and Concat of the YOLOv8 detector (C2f concats, SPPF, the neck, the detect
    head) is kiln's copy, and the output is onnxruntime's, also after a save and load. The C2f chunks' 16 Slices
    are no copies at all: ConvSliceSplit computes each half as its own convolution."""
    import numpy as np

    import kiln
    from tests.conftest import assert_close_to_ort, run_ort

    engine = kiln.build(yolo_onnx, tactic_sources="kiln", avg_timing=1, min_timing=1)
    layers = copy_layers(engine)
    assert len(layers) == 22 and {l["TacticName"] for l in layers} == {"kiln.copy_rows"}
    assert sum(p["matches"] for p in engine.plan.build_info["passes"] if p["name"] == "ConvSliceSplit") == 16
    x = np.random.default_rng(3).standard_normal((1, 3, 64, 64)).astype(np.float32)
    name = engine.input_names[0]
    got = engine.run({name: x})[engine.output_names[0]]
    assert_close_to_ort(got, run_ort(yolo_onnx, {name: x})[0])
    engine.save(tmp_path / "y.kiln")
    np.testing.assert_array_equal(kiln.load(tmp_path / "y.kiln").run({name: x})[engine.output_names[0]], got)


@bf16_cpu
def test_yolov8_bf16_plan_copies_bf16_between_bf16_convolutions(yolo_onnx):
    """`--bf16` on kiln's kernels: the C2f blocks' splits and concats are granted BF16 on kiln's copy, output within
    cosine 0.999. Autotune off, so each takes the first tactic offering BF16; with it, the autotuner keeps a few
    near the detect head's FP32 outputs in FP32 where that times faster here (29-35 of 38 BF16 across runs, before
    ConvSliceSplit took the C2f chunks' 16 Slices)."""
    import numpy as np

    import kiln
    from tests.conftest import run_ort

    engine = kiln.build(yolo_onnx, bf16=True, tactic_sources="kiln", autotune=False)
    layers = copy_layers(engine)
    assert len(layers) == 22 and {l["TacticName"] for l in layers} == {"kiln.copy_rows_bf16"}
    assert all(l["GrantedPrecision"] == "BF16" for l in layers)
    assert any("BF16" in t["Format/Datatype"] for l in layers for t in l["Inputs"])
    x = np.random.default_rng(3).standard_normal((1, 3, 64, 64)).astype(np.float32)
    name = engine.input_names[0]
    got, want = engine.run({name: x})[engine.output_names[0]], run_ort(yolo_onnx, {name: x})[0]
    cosine = float((got * want).sum() / (np.linalg.norm(got) * np.linalg.norm(want)))
    assert cosine >= 0.999


@pytest.mark.parametrize("layout", ["hwc", "linear"])
def test_a_qconcat_maps_each_tabled_input_as_it_copies(layout):
    """kiln.passes.qconcat_table: requantizations before an INT8 Concat become tables on its inputs; the copy maps
    each tabled input's bytes (s8 bytes index by raw byte), equal to the reference op and to its ONNX form run by
    onnxruntime (the form a region is handed)."""
    import onnxruntime as ort

    from kiln.ops import lookup
    from kiln.tactics.onnx_emit import emit

    shapes = [(1, 16, 5, 5), (1, 3, 5, 5), (1, 33, 5, 5)]
    entries = [torch.randperm(256, generator=torch.Generator().manual_seed(s)).tolist() for s in (1, 2)]
    tables = [{"bytes": entries[0], "dtype": "int8"}, None, {"bytes": entries[1], "dtype": "int8"}]
    xs = [int8_tensor(s, d, layout, seed=i) for i, (s, d) in enumerate(zip(shapes, ("uint8", "int8", "int8")))]
    layer = LayerView("QConcat", "kiln", {"axis": 1, "in_tables": tables}, tuple(shapes), ("uint8", "int8", "int8"),
                      {}, ("int8",), 17, ((), (), ()))
    assert CopyRowsTactic().supports(layer)
    got = CopyRowsTactic().prepare(layer)(xs)[0]
    mapped = [x if t is None else torch.tensor(t["bytes"], dtype=torch.uint8)[x.view(torch.uint8).long()]
              .view(torch.int8) for x, t in zip(xs, tables)]
    check(got, torch.cat(mapped, 1), layout)
    assert torch.equal(lookup("QConcat", "kiln").impl(layer.attrs, xs)[0], got)
    model, _ = emit(layer, 17)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    ran = session.run(None, {f"x{i}": x.contiguous().numpy() for i, x in enumerate(xs)})[0]
    assert np.array_equal(ran, got.contiguous().numpy())


def test_a_damaged_table_is_refused_at_load():
    """A saved QConcat whose table lost entries would have kiln's copy read past its end: refused when prepared."""
    layer = LayerView("QConcat", "kiln", {"axis": 1, "in_tables": [{"bytes": list(range(255)), "dtype": "uint8"},
                                                                   None]},
                      ((1, 4, 3, 3), (1, 4, 3, 3)), ("uint8", "uint8"), {}, ("uint8",), 17, ((), ()))
    with pytest.raises(ValueError, match="a byte table needs 256 entries and an INT8 type; this one has 255 entries"):
        CopyRowsTactic().prepare(layer)
