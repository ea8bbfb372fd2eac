"""The networks compare.py times, exported to ONNX, and their INT8 versions as the field makes them.

    model, feeds, path = build_model("resnet50-int8", workdir)   # torch model, feeds by input name, ONNX file

Names: resnet18, resnet50 (tests/models/nets.py at 1x3x224x224), bert-base and minilm (HF BertModel at those
shapes, batch 1, seq 128, 20 padded tokens), yolov8n (tests/models/detectors.py at 640x640), unet
(tests/models/segmenters.py at 256x256); random weights, randomized BatchNorm statistics and biases. Suffixes:
- `-int8`: onnxruntime's quantize_static (Q/DQ) for the ResNets and YOLOv8n, quantize_dynamic for the encoders;
- `-int8dyn` (ResNets): quantize_dynamic (s8 weights, ConvInteger);
- `-qdq` (encoders): quantize_static in Q/DQ format, as onnxruntime's BERT example does it;
- `-qat` (ResNets): TensorRT-style QAT (tests/models/qat.py): symmetric s8 Q/DQ on each convolution's input and
  weights, BatchNorm and residual sums in FP32, exported with the legacy exporter at opset 17.
A quantized file's stem ends in one of QUANTIZED; the FP32 network stays beside it without that ending.
"""
from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np

QUANTIZED = ("_qdq", "_qdyn", "_qat")   # file-name endings of the INT8 exports
RESNET_SUFFIXES = ("", "int8", "int8dyn", "qat")
ENCODER_SUFFIXES = ("", "int8", "qdq")
CALIBRATION_BATCHES = 8
VOCAB = 30522   # BERT's word pieces


def build_model(name: str, workdir: Path, exporter: str = "legacy", dynamic: bool = False):
    """(torch model, feeds by input name, ONNX path) for one benchmark model; see the module docstring.
    `exporter`: "legacy" (TorchScript, opset 17) or "dynamo" (torch.export, torch's default opset). `dynamic`: the
    export's batch axis (and an encoder's sequence axis) symbolic, as deployment exports are; the feeds stay batch
    1 (seq 128). ResNets (not -qat) and encoders only."""
    base = "bert-base" if name.startswith("bert-base") else name.partition("-")[0]
    suffix = name.removeprefix(base).removeprefix("-")
    if dynamic and not (base in ("resnet18", "resnet50", "bert-base", "minilm") and suffix != "qat"):
        raise SystemExit(f"'{name}' has no dynamic-axes export: --dynamic takes resnet18 and resnet50 (not -qat), "
                         "bert-base and minilm")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if base in ("resnet18", "resnet50") and suffix in RESNET_SUFFIXES:
            return _resnet(base, suffix, workdir / f"{name}.onnx", exporter, dynamic)
        if base in ("bert-base", "minilm") and suffix in ENCODER_SUFFIXES:
            return _encoder(base, suffix, workdir / f"{name}.onnx", exporter, dynamic)
        if base == "yolov8n" and suffix in ("", "int8"):
            from tests.models import detectors

            model = detectors.make("yolov8")
            x = np.random.default_rng(0).random((1, 3, 640, 640)).astype(np.float32)
            detectors.export(model, _tensor(x), workdir / f"{name}.onnx", exporter)
            path = quantize_qdq(workdir / f"{name}.onnx", x, "images") if suffix else workdir / f"{name}.onnx"
            return model, {"images": x}, path
        if name == "unet":
            from tests.models.nets import export
            from tests.models.segmenters import make_unet

            model = make_unet()
            x = np.random.default_rng(0).standard_normal((1, 3, 256, 256)).astype(np.float32)
            export(model, _tensor(x), workdir / f"{name}.onnx", exporter)
            return model, {"input": x}, workdir / f"{name}.onnx"
    raise SystemExit(f"unknown model '{name}' (resnet18, resnet50, bert-base, minilm, yolov8n, unet; -int8 after "
                     "resnet18, resnet50, bert-base, minilm or yolov8n; -int8dyn or -qat after resnet18 or resnet50; -qdq "
                     "after bert-base or minilm)")


def _tensor(x: np.ndarray):
    import torch

    return torch.from_numpy(x)


def _resnet(base: str, suffix: str, path: Path, exporter: str, dynamic: bool = False):
    import onnx

    from tests.models.nets import export, make

    model = make(base, seed=0)
    x = np.random.default_rng(0).standard_normal((1, 3, 224, 224)).astype(np.float32)
    export(model, _tensor(x), path, exporter, dynamic)
    feeds = {"input": x}
    if suffix == "int8":
        return model, feeds, quantize_qdq(path, x)
    if suffix == "int8dyn":
        return model, feeds, quantize_dynamically(onnx.load(path), path)
    if suffix == "qat":
        return model, feeds, quantization_aware(model, x, path)
    return model, feeds, path


def _encoder(base: str, suffix: str, path: Path, exporter: str, dynamic: bool = False):
    from tests.models import encoders

    shape = dict(layers=12, hidden=768, heads=12, intermediate=3072) if base == "bert-base" else \
        dict(layers=6, hidden=384, heads=12, intermediate=1536)
    model = encoders.make_bert(**shape, vocab=VOCAB, max_positions=512)
    feeds = encoders.inputs(model, batch=1, seq=128)
    feeds["attention_mask"][0, 108:] = 0
    example = encoders.inputs(model, batch=2, seq=16) if dynamic else feeds   # torch.export specializes size 1
    exported = encoders.export(model, example, path, exporter, dynamic=dynamic)
    if suffix == "int8":
        return model, feeds, quantize_dynamically(exported, path)
    if suffix == "qdq":
        return model, feeds, quantize_static_encoder(exported, path, feeds)
    return model, feeds, path


def quantize_dynamically(model, path: Path) -> Path:
    """onnxruntime's quantize_dynamic, its INT8 recipe for transformers: s8 weights per tensor, each MatMul's (and
    Conv's) input quantized to u8 from its own range on every call. The FP32 model stays at `path`."""
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    from tests.models import encoders

    folded, quantized = path.with_name(path.stem + "_folded.onnx"), path.with_name(path.stem + "_qdyn.onnx")
    onnx.save(encoders.fold_weight_transposes(model), folded)
    quantize_dynamic(str(folded), str(quantized), weight_type=QuantType.QInt8)
    return quantized


def _calibration(batches: list[dict[str, np.ndarray]]):
    from onnxruntime.quantization import CalibrationDataReader

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.batches = iter(batches)

        def get_next(self):
            return next(self.batches, None)

    return Reader()


def quantize_qdq(path: Path, x: np.ndarray, input_name: str = "input") -> Path:
    """onnxruntime's quantize_static in QDQ format: per-channel INT8 weights, unsigned INT8 activations,
    calibrated on 8 random inputs like `x` (uniform in [0, 1) where `x` is, as images are, else normal). The FP32
    model stays at `path` for the kiln-FP32 comparison."""
    from onnxruntime.quantization import QuantFormat, QuantType, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    rng = np.random.default_rng(1)
    draw = rng.random if x.min() >= 0 else rng.standard_normal
    batches = [{input_name: draw(x.shape).astype(np.float32)} for _ in range(CALIBRATION_BATCHES)]
    pre, qdq = path.with_name(path.stem + "_pre.onnx"), path.with_name(path.stem + "_qdq.onnx")
    quant_pre_process(str(path), str(pre))
    quantize_static(str(pre), str(qdq), _calibration(batches), quant_format=QuantFormat.QDQ, per_channel=True,
                    activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8)
    return qdq


def quantize_static_encoder(model, path: Path, feeds: dict[str, np.ndarray], vocab: int = VOCAB) -> Path:
    """onnxruntime's quantize_static of an encoder in QDQ format, as its BERT example does: weight transposes
    folded (quant_pre_process's constant folding does the same), u8 activations, s8 weights per tensor, calibrated
    on 8 batches of random token ids with the feeds' mask and token types."""
    import onnx
    from onnxruntime.quantization import QuantFormat, QuantType, quantize_static

    from tests.models import encoders

    folded, qdq = path.with_name(path.stem + "_folded.onnx"), path.with_name(path.stem + "_qdq.onnx")
    onnx.save(encoders.fold_weight_transposes(model), folded)
    rng = np.random.default_rng(1)
    ids = feeds["input_ids"]
    batches = [{**feeds, "input_ids": rng.integers(1, vocab, ids.shape).astype(ids.dtype)}
               for _ in range(CALIBRATION_BATCHES)]
    quantize_static(str(folded), str(qdq), _calibration(batches), quant_format=QuantFormat.QDQ, per_channel=False,
                    activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8)
    return qdq


def quantization_aware(model, x: np.ndarray, path: Path) -> Path:
    """`model` fake-quantized TensorRT's way (input scales calibrated on 8 random inputs) and exported beside
    the FP32 file at `path`. The torch model is changed in place; compare.py does not time it on INT8 files."""
    import torch

    from tests.models.nets import load_for_ort
    from tests.models.qat import fake_quantize

    rng = np.random.default_rng(1)
    sample = torch.from_numpy(rng.standard_normal((CALIBRATION_BATCHES, *x.shape[1:])).astype(np.float32))
    qat = path.with_name(path.stem + "_qat.onnx")
    fake_quantize(model, sample)
    torch.onnx.export(model, (torch.from_numpy(x),), str(qat), dynamo=False, opset_version=17,
                      input_names=["input"], output_names=["output"])
    load_for_ort(qat)
    return qat
