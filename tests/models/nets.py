"""Plain-torch ResNet-18 / ResNet-50 shaped networks (no torchvision) and an ONNX export helper.

    model = make("resnet50", seed=0)                 # eval mode, BatchNorm statistics randomized
    seconds = export(model, torch.randn(1, 3, 64, 64), "r50.onnx", "legacy")

The architectures follow torchvision's ResNet v1.5 (stride on the 3x3 conv of a Bottleneck):
stem conv7x7/s2 + BN + ReLU + MaxPool3x3/s2, four stages, downsample conv1x1 + BN on the first block of a
stage when the shape changes, global average pool, flatten, Linear(C, 1000).
"""
from __future__ import annotations

import time
import warnings
from pathlib import Path

import torch
from torch import nn

# onnxruntime in this environment reads ONNX IR version <= 13; newer onnx/torch may write a newer one.
MAX_ORT_IR_VERSION = 10


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, planes * self.expansion, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


class ResNet(nn.Module):
    def __init__(self, block, layers: list[int], num_classes: int = 1000):
        super().__init__()
        self.inplanes = 64
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        self.layer1 = self._make_layer(block, 64, layers[0])
        self.layer2 = self._make_layer(block, 128, layers[1], stride=2)
        self.layer3 = self._make_layer(block, 256, layers[2], stride=2)
        self.layer4 = self._make_layer(block, 512, layers[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(512 * block.expansion, num_classes)

    def _make_layer(self, block, planes: int, blocks: int, stride: int = 1) -> nn.Sequential:
        downsample = None
        if stride != 1 or self.inplanes != planes * block.expansion:
            downsample = nn.Sequential(nn.Conv2d(self.inplanes, planes * block.expansion, 1, stride, bias=False),
                                       nn.BatchNorm2d(planes * block.expansion))
        mods = [block(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes * block.expansion
        mods += [block(self.inplanes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*mods)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        x = torch.flatten(self.avgpool(x), 1)
        return self.fc(x)


ARCHS = {"resnet18": (BasicBlock, [2, 2, 2, 2]), "resnet50": (Bottleneck, [3, 4, 6, 3])}


def make(name: str, seed: int = 0) -> ResNet:
    """Build `name` ("resnet18" | "resnet50") in eval mode with seeded weights and randomized BatchNorm state.

    Fresh BatchNorm layers are the identity (mean 0, var 1, weight 1, bias 0), which would let a broken
    BN fold pass; every BN gets random statistics and affine parameters instead. The scales stay near 1
    so activations neither vanish nor explode through 50 layers.
    """
    torch.manual_seed(seed)
    block, layers = ARCHS[name]
    model = ResNet(block, layers)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                c = m.num_features
                m.running_mean.uniform_(-0.2, 0.2)
                m.running_var.uniform_(0.5, 1.5)
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.2, 0.2)
                assert m.running_mean.shape == (c,)
    return model.eval()


def export(model: nn.Module, x: torch.Tensor, path, exporter: str = "legacy", dynamic: bool = False) -> float:
    """Export `model` on example input `x` to `path` (input "input", output "output"); returns seconds taken.

    exporter="dynamo": torch.onnx.export(dynamo=True) at this torch's default opset (20 for torch 2.13); the
        exporter's optimizer folds each eval-mode BatchNorm into its conv, so the file has no BatchNormalization;
        the pool is ReduceMean and the flatten a Reshape (ResNet-18 at 96x96: about 6 s, mostly first-call setup).
    exporter="legacy": the TorchScript exporter, opset 17, do_constant_folding=False, so every BatchNormalization
        stays for kiln to fold; the pool is GlobalAveragePool and the flatten a single Flatten node (no
        Identity/Constant/Shape chains appear for these nets at opset 17). About 0.5-3 s.
    dynamic=True: the batch axis of "input" and "output" is symbolic ("batch"): dynamic_axes for legacy, a
        torch.export.Dim for dynamo; traced at batch 2 where `x` has 1 (torch.export specializes a size-1 dim).
    The file's IR version is capped at MAX_ORT_IR_VERSION so onnxruntime can read it.
    """
    path = Path(path)
    t0 = time.perf_counter()
    if dynamic and x.shape[0] == 1:
        x = torch.cat([x, x])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if exporter == "dynamo":
            shapes = dict(dynamic_shapes=({0: torch.export.Dim("batch", min=1, max=64)},)) if dynamic else {}
            torch.onnx.export(model, (x,), str(path), dynamo=True, input_names=["input"], output_names=["output"],
                              external_data=False, verbose=False, **shapes)
        elif exporter == "legacy":
            axes = dict(dynamic_axes={"input": {0: "batch"}, "output": {0: "batch"}}) if dynamic else {}
            torch.onnx.export(model, (x,), str(path), dynamo=False, opset_version=17, do_constant_folding=False,
                              input_names=["input"], output_names=["output"], **axes)
        else:
            raise ValueError(f"unknown exporter {exporter!r}")
    seconds = time.perf_counter() - t0
    load_for_ort(path)
    return seconds


def load_for_ort(path):
    """The exported model, its IR version capped (in the file too) so onnxruntime can read it."""
    import onnx

    proto = onnx.load(str(path))
    if proto.ir_version > MAX_ORT_IR_VERSION:
        proto.ir_version = MAX_ORT_IR_VERSION
        onnx.save(proto, str(path))
    return proto
