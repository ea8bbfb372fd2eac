"""A YOLOv8-shaped detector in plain torch (no ultralytics), plus a YOLOv5-style anchor head on the same
backbone/neck, and an ONNX export helper.

    model = make("yolov8", seed=0)                    # eval mode, randomized BatchNorm statistics
    proto = export(model, torch.randn(1, 3, 64, 64), "y8.onnx", "legacy")

Structure follows ultralytics' yolov8.yaml at scale "n" (depth 0.33, width 0.25, so channels 16/32/64/128/256,
C2f repeats 1/2/2/1 in the backbone and 1 in the head):
    Conv = Conv2d(bias=False) + BatchNorm2d(eps=1e-3) + SiLU
    C2f  = Conv1x1 -> chunk(2) -> n Bottlenecks on the last chunk, each result kept -> Concat -> Conv1x1
    SPPF = Conv1x1 -> 3 chained MaxPool(5, 1, 2) -> Concat -> Conv1x1
    neck = nn.Upsample(scale_factor=2, nearest) + Concat (FPN top-down), strided Conv + Concat (PAN bottom-up)
    Detect (v8) = per level two branches (box: 2 Conv3x3 + Conv2d(64), cls: 2 Conv3x3 + Conv2d(nc)), Concat,
        view(b, no, -1) per level, Concat over levels, split(64, nc); DFL: view(b, 4, 16, a), transpose,
        softmax over the 16 bins, fixed 1x1 conv with weights 0..15, view(b, 4, a); dist2bbox against
        anchor points made in forward from the feature shapes (arange + meshgrid + stack, as ultralytics
        does), times strides; sigmoid class scores; final Concat -> (b, 4 + nc, anchors).
    Detect (v5) = per level Conv1x1 to na*(5+nc), view(b, na, no, ny, nx).permute(0, 1, 3, 4, 2), sigmoid,
        xy = (xy*2 + grid) * stride, wh = (wh*2)**2 * anchor_grid, Concat, view(b, -1, no); Concat levels.
At 64x64 input the three levels are 8x8, 4x4 and 2x2 (84 anchor points for v8, 252 boxes for v5).
"""
from __future__ import annotations

import math
import warnings
from pathlib import Path

import torch
from torch import nn



def make_divisible(x: float, divisor: int = 8) -> int:
    return int(math.ceil(x / divisor) * divisor)


class Conv(nn.Module):
    def __init__(self, c1: int, c2: int, k: int = 1, s: int = 1, g: int = 1):
        super().__init__()
        self.conv = nn.Conv2d(c1, c2, k, s, k // 2, groups=g, bias=False)
        self.bn = nn.BatchNorm2d(c2, eps=1e-3, momentum=0.03)
        self.act = nn.SiLU()

    def forward(self, x):
        return self.act(self.bn(self.conv(x)))


class Bottleneck(nn.Module):
    def __init__(self, c1: int, c2: int, shortcut: bool = True, e: float = 0.5):
        super().__init__()
        c_ = int(c2 * e)
        self.cv1, self.cv2 = Conv(c1, c_, 3), Conv(c_, c2, 3)
        self.add = shortcut and c1 == c2

    def forward(self, x):
        y = self.cv2(self.cv1(x))
        return x + y if self.add else y


class C2f(nn.Module):
    def __init__(self, c1: int, c2: int, n: int = 1, shortcut: bool = False, e: float = 0.5):
        super().__init__()
        self.c = int(c2 * e)
        self.cv1 = Conv(c1, 2 * self.c, 1)
        self.cv2 = Conv((2 + n) * self.c, c2, 1)
        self.m = nn.ModuleList(Bottleneck(self.c, self.c, shortcut, e=1.0) for _ in range(n))

    def forward(self, x):
        y = list(self.cv1(x).chunk(2, 1))
        y.extend(m(y[-1]) for m in self.m)
        return self.cv2(torch.cat(y, 1))


class SPPF(nn.Module):
    def __init__(self, c1: int, c2: int, k: int = 5):
        super().__init__()
        c_ = c1 // 2
        self.cv1, self.cv2 = Conv(c1, c_, 1), Conv(c_ * 4, c2, 1)
        self.m = nn.MaxPool2d(k, 1, k // 2)

    def forward(self, x):
        y = [self.cv1(x)]
        y.extend(self.m(y[-1]) for _ in range(3))
        return self.cv2(torch.cat(y, 1))


class DFL(nn.Module):
    def __init__(self, c1: int = 16):
        super().__init__()
        self.conv = nn.Conv2d(c1, 1, 1, bias=False).requires_grad_(False)
        self.conv.weight.data[:] = torch.arange(c1, dtype=torch.float).view(1, c1, 1, 1)
        self.c1 = c1

    def forward(self, x):
        b, _, a = x.shape
        return self.conv(x.view(b, 4, self.c1, a).transpose(2, 1).softmax(1)).view(b, 4, a)


def make_anchors(feats, strides, offset: float = 0.5):
    points, stride_tensor = [], []
    dtype = feats[0].dtype
    for i, stride in enumerate(strides):
        _, _, h, w = feats[i].shape
        sx = torch.arange(w, dtype=dtype) + offset
        sy = torch.arange(h, dtype=dtype) + offset
        sy, sx = torch.meshgrid(sy, sx, indexing="ij")
        points.append(torch.stack((sx, sy), -1).view(-1, 2))
        stride_tensor.append(torch.full((h * w, 1), stride, dtype=dtype))
    return torch.cat(points), torch.cat(stride_tensor)


def dist2bbox(distance, anchor_points, dim: int = 1):
    lt, rb = distance.chunk(2, dim)
    x1y1, x2y2 = anchor_points - lt, anchor_points + rb
    return torch.cat(((x1y1 + x2y2) / 2, x2y2 - x1y1), dim)


class DetectV8(nn.Module):
    def __init__(self, nc: int, ch: tuple[int, ...], strides=(8, 16, 32), reg_max: int = 16):
        super().__init__()
        self.nc, self.reg_max, self.strides = nc, reg_max, strides
        self.no = nc + 4 * reg_max
        c2, c3 = max(16, ch[0] // 4, reg_max * 4), max(ch[0], min(nc, 100))
        self.cv2 = nn.ModuleList(nn.Sequential(Conv(x, c2, 3), Conv(c2, c2, 3), nn.Conv2d(c2, 4 * reg_max, 1)) for x in ch)
        self.cv3 = nn.ModuleList(nn.Sequential(Conv(x, c3, 3), Conv(c3, c3, 3), nn.Conv2d(c3, nc, 1)) for x in ch)
        self.dfl = DFL(reg_max)

    def forward(self, xs):
        xs = [torch.cat((self.cv2[i](x), self.cv3[i](x)), 1) for i, x in enumerate(xs)]
        b = xs[0].shape[0]
        x_cat = torch.cat([x.view(b, self.no, -1) for x in xs], 2)
        anchors, strides = (t.transpose(0, 1) for t in make_anchors(xs, self.strides, 0.5))
        box, cls = x_cat.split((self.reg_max * 4, self.nc), 1)
        dbox = dist2bbox(self.dfl(box), anchors.unsqueeze(0), dim=1) * strides
        return torch.cat((dbox, cls.sigmoid()), 1)


V5_ANCHORS = ((10, 13, 16, 30, 33, 23), (30, 61, 62, 45, 59, 119), (116, 90, 156, 198, 373, 326))


class DetectV5(nn.Module):
    def __init__(self, nc: int, ch: tuple[int, ...], strides=(8, 16, 32), anchors=V5_ANCHORS):
        super().__init__()
        self.nc, self.no, self.na, self.strides = nc, nc + 5, len(anchors[0]) // 2, strides
        self.register_buffer("anchors", torch.tensor(anchors, dtype=torch.float).view(len(anchors), -1, 2))
        self.m = nn.ModuleList(nn.Conv2d(x, self.no * self.na, 1) for x in ch)

    def forward(self, xs):
        z = []
        for i, x in enumerate(xs):
            x = self.m[i](x)
            bs, _, ny, nx = x.shape
            x = x.view(bs, self.na, self.no, ny, nx).permute(0, 1, 3, 4, 2).contiguous()
            yv, xv = torch.meshgrid(torch.arange(ny, dtype=x.dtype), torch.arange(nx, dtype=x.dtype), indexing="ij")
            grid = torch.stack((xv, yv), 2).expand(1, self.na, ny, nx, 2) - 0.5
            anchor_grid = self.anchors[i].view(1, self.na, 1, 1, 2).expand(1, self.na, ny, nx, 2)
            xy, wh, conf = x.sigmoid().split((2, 2, self.nc + 1), 4)
            xy = (xy * 2 + grid) * self.strides[i]
            wh = (wh * 2) ** 2 * anchor_grid
            z.append(torch.cat((xy, wh, conf), 4).view(bs, self.na * nx * ny, self.no))
        return torch.cat(z, 1)


class YOLO(nn.Module):
    """yolov8.yaml backbone + PAN-FPN neck with a v8 (anchor-free, DFL) or v5 (anchor-based) head."""

    def __init__(self, nc: int = 80, width: float = 0.25, depth: float = 0.33, head: str = "v8",
                 max_channels: int = 1024):
        super().__init__()

        def c(ch):
            return make_divisible(min(ch, max_channels) * width, 8)

        def n(k):
            return max(round(k * depth), 1)

        self.b0, self.b1 = Conv(3, c(64), 3, 2), Conv(c(64), c(128), 3, 2)
        self.b2 = C2f(c(128), c(128), n(3), True)
        self.b3, self.b4 = Conv(c(128), c(256), 3, 2), C2f(c(256), c(256), n(6), True)
        self.b5, self.b6 = Conv(c(256), c(512), 3, 2), C2f(c(512), c(512), n(6), True)
        self.b7, self.b8 = Conv(c(512), c(1024), 3, 2), C2f(c(1024), c(1024), n(3), True)
        self.b9 = SPPF(c(1024), c(1024), 5)
        self.up = nn.Upsample(None, 2, "nearest")
        self.h12 = C2f(c(1024) + c(512), c(512), n(3))
        self.h15 = C2f(c(512) + c(256), c(256), n(3))
        self.h16, self.h18 = Conv(c(256), c(256), 3, 2), C2f(c(256) + c(512), c(512), n(3))
        self.h19, self.h21 = Conv(c(512), c(512), 3, 2), C2f(c(512) + c(1024), c(1024), n(3))
        ch = (c(256), c(512), c(1024))
        self.detect = DetectV8(nc, ch) if head == "v8" else DetectV5(nc, ch)

    def forward(self, x):
        p3 = self.b4(self.b3(self.b2(self.b1(self.b0(x)))))
        p4 = self.b6(self.b5(p3))
        p5 = self.b9(self.b8(self.b7(p4)))
        h12 = self.h12(torch.cat((self.up(p5), p4), 1))
        h15 = self.h15(torch.cat((self.up(h12), p3), 1))
        h18 = self.h18(torch.cat((self.h16(h15), h12), 1))
        h21 = self.h21(torch.cat((self.h19(h18), p5), 1))
        return self.detect([h15, h18, h21])


MODELS = {"yolov8": dict(head="v8"), "yolov5": dict(head="v5")}


def make(name: str = "yolov8", seed: int = 0, **kwargs) -> YOLO:
    """`name` in MODELS; kwargs (nc, width, depth) override. Eval mode; every BatchNorm gets random statistics
    and affine parameters (fresh BN is the identity, which would hide a broken BN fold)."""
    torch.manual_seed(seed)
    model = YOLO(**{**MODELS[name], **kwargs})
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.2, 0.2)
                m.running_var.uniform_(0.5, 1.5)
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.2, 0.2)
    return model.eval()


def export(model: nn.Module, x: torch.Tensor, path, exporter: str = "legacy", opset: int | None = None):
    """Export on example image `x` (input "images", output "output0", as ultralytics names them); returns the
    loaded ModelProto (IR version capped for onnxruntime). legacy: opset 17, do_constant_folding=False, so
    the anchor construction (Shape/Gather/Range/Expand...) stays in the graph; dynamo: torch's default opset."""
    from tests.models.nets import load_for_ort

    path = Path(path)
    kwargs = dict(input_names=["images"], output_names=["output0"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if exporter == "dynamo":
            if opset is not None:
                kwargs["opset_version"] = opset
            torch.onnx.export(model, (x,), str(path), dynamo=True, external_data=False, verbose=False, **kwargs)
        elif exporter == "legacy":
            torch.onnx.export(model, (x,), str(path), dynamo=False, opset_version=opset or 17,
                              do_constant_folding=False, **kwargs)
        else:
            raise ValueError(f"unknown exporter {exporter!r}")
    return load_for_ort(path)
