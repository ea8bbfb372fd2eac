"""Small CNNs in the styles of other model families (MobileNetV2/V3, EfficientNet, DenseNet, SqueezeNet,
Inception, ShuffleNet, VGG) to check that kiln handles the patterns their exports contain."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


def cbr(cin, cout, k=3, s=1, groups=1, act=nn.ReLU):
    return nn.Sequential(nn.Conv2d(cin, cout, k, s, k // 2, groups=groups, bias=False), nn.BatchNorm2d(cout), act())


class InvertedResidual(nn.Module):   # MobileNetV2: ReLU6, depthwise, linear bottleneck, residual without act
    def __init__(self, c, expand=4):
        super().__init__()
        h = c * expand
        self.body = nn.Sequential(cbr(c, h, 1, act=nn.ReLU6), cbr(h, h, 3, groups=h, act=nn.ReLU6),
                                  nn.Conv2d(h, c, 1, bias=False), nn.BatchNorm2d(c))

    def forward(self, x):
        return x + self.body(x)


class SqueezeExcite(nn.Module):      # MobileNetV3 / EfficientNet: GAP -> conv -> act -> conv -> gate -> mul
    def __init__(self, c, gate):
        super().__init__()
        self.fc1, self.fc2, self.gate = nn.Conv2d(c, c // 4, 1), nn.Conv2d(c // 4, c, 1), gate

    def forward(self, x):
        s = F.adaptive_avg_pool2d(x, 1)
        return x * self.gate(self.fc2(F.relu(self.fc1(s))))


class MobileNetV3ish(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = cbr(3, 16, 3, 2, act=nn.Hardswish)
        self.dw = cbr(16, 16, 3, 1, groups=16, act=nn.Hardswish)
        self.se = SqueezeExcite(16, nn.Hardsigmoid())
        self.proj = cbr(16, 24, 1, act=nn.Identity)
        self.head = nn.Sequential(nn.Linear(24, 32), nn.Hardswish(), nn.Dropout(0.2), nn.Linear(32, 10))

    def forward(self, x):
        x = self.proj(self.se(self.dw(self.stem(x))))
        return self.head(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class EfficientNetish(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = cbr(3, 16, 3, 2, act=nn.SiLU)
        self.mb = nn.Sequential(cbr(16, 64, 1, act=nn.SiLU), cbr(64, 64, 5, groups=64, act=nn.SiLU),
                                SqueezeExcite(64, nn.Sigmoid()), cbr(64, 16, 1, act=nn.Identity))
        self.fc = nn.Linear(16, 10)

    def forward(self, x):
        x = self.stem(x)
        x = x + self.mb(x)
        return self.fc(x.mean((2, 3)))


class MobileNetV2ish(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem, self.blocks = cbr(3, 16, 3, 2, act=nn.ReLU6), nn.Sequential(InvertedResidual(16), InvertedResidual(16))
        self.fc = nn.Linear(16, 10)

    def forward(self, x):
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(self.blocks(self.stem(x)), 1), 1))


class DenseNetish(nn.Module):        # pre-activation BN-ReLU-Conv, concatenation, transition avg-pool
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, 1, 1)
        self.layers = nn.ModuleList([nn.Sequential(nn.BatchNorm2d(16 + 8 * i), nn.ReLU(), nn.Conv2d(16 + 8 * i, 8, 3, 1, 1))
                                     for i in range(3)])
        self.trans = nn.Sequential(nn.BatchNorm2d(40), nn.ReLU(), nn.Conv2d(40, 20, 1), nn.AvgPool2d(2))
        self.fc = nn.Linear(20, 10)

    def forward(self, x):
        x = self.stem(x)
        for layer in self.layers:
            x = torch.cat([x, layer(x)], 1)
        return self.fc(self.trans(x).mean((2, 3)))


class SqueezeNetish(nn.Module):      # Fire modules, ceil_mode max-pool, conv classifier, global pool
    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 32, 3, 2), nn.ReLU(), nn.MaxPool2d(3, 2, ceil_mode=True))
        self.squeeze = nn.Sequential(nn.Conv2d(32, 8, 1), nn.ReLU())
        self.e1, self.e3 = nn.Sequential(nn.Conv2d(8, 16, 1), nn.ReLU()), nn.Sequential(nn.Conv2d(8, 16, 3, padding=1), nn.ReLU())
        self.cls = nn.Sequential(nn.Dropout(0.5), nn.Conv2d(32, 10, 1), nn.ReLU(), nn.AdaptiveAvgPool2d(1))

    def forward(self, x):
        s = self.squeeze(self.stem(x))
        return torch.flatten(self.cls(torch.cat([self.e1(s), self.e3(s)], 1)), 1)


class Inceptionish(nn.Module):       # parallel branches, avg-pool with padding, asymmetric kernels
    def __init__(self):
        super().__init__()
        self.stem = cbr(3, 16, 3, 2)
        self.b1 = cbr(16, 8, 1)
        self.b2 = nn.Sequential(cbr(16, 8, 1), nn.Conv2d(8, 8, (1, 3), padding=(0, 1)), nn.Conv2d(8, 8, (3, 1), padding=(1, 0)))
        self.b3 = nn.Sequential(nn.AvgPool2d(3, 1, 1, count_include_pad=False), cbr(16, 8, 1))
        self.b4 = nn.Sequential(nn.MaxPool2d(3, 1, 1), cbr(16, 8, 1))
        self.fc = nn.Linear(32, 10)

    def forward(self, x):
        x = self.stem(x)
        x = torch.cat([self.b1(x), self.b2(x), self.b3(x), self.b4(x)], 1)
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class ShuffleNetish(nn.Module):      # channel split, channel shuffle (reshape-transpose-reshape)
    def __init__(self):
        super().__init__()
        self.stem = cbr(3, 32, 3, 2)
        self.branch = nn.Sequential(cbr(16, 16, 1), cbr(16, 16, 3, groups=16, act=nn.Identity), cbr(16, 16, 1))
        self.fc = nn.Linear(32, 10)

    def forward(self, x):
        x = self.stem(x)
        a, b = x.chunk(2, dim=1)
        x = torch.cat([a, self.branch(b)], 1)
        n, c, h, w = x.shape
        x = x.reshape(n, 2, c // 2, h, w).transpose(1, 2).reshape(n, c, h, w)
        return self.fc(x.mean((2, 3)))


class VGGish(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(True), nn.MaxPool2d(2),
                                      nn.Conv2d(16, 32, 3, padding=1), nn.LeakyReLU(0.1), nn.MaxPool2d(2))
        self.classifier = nn.Sequential(nn.Linear(32 * 8 * 8, 64), nn.ReLU(True), nn.Dropout(), nn.Linear(64, 10),
                                        nn.Softmax(dim=1))

    def forward(self, x):
        return self.classifier(torch.flatten(self.features(x), 1))


class UNetish(nn.Module):           # encoder/decoder: transposed conv, bilinear + nearest upsampling, skip concat
    def __init__(self):
        super().__init__()
        self.enc1, self.enc2 = cbr(3, 8), cbr(8, 16, s=2)
        self.up = nn.ConvTranspose2d(16, 8, 2, stride=2)
        self.dec = cbr(16, 8)
        self.out = nn.Conv2d(8, 2, 1)

    def forward(self, x):
        a = self.enc1(x)
        b = self.enc2(a)
        y = self.dec(torch.cat([self.up(b), a], 1))
        y = y + F.interpolate(F.avg_pool2d(y, 2), scale_factor=2, mode="nearest")
        y = F.interpolate(self.out(y), scale_factor=0.5, mode="bilinear", align_corners=False)
        return F.interpolate(y, size=(20, 24), mode="bilinear", align_corners=True)


class ConvNeXtish(nn.Module):        # depthwise 7x7, channels-last LayerNorm via permute, GELU MLP, layer scale
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 4, 4)
        self.dw = nn.Conv2d(16, 16, 7, padding=3, groups=16)
        self.norm = nn.LayerNorm(16, eps=1e-6)
        self.fc1, self.fc2 = nn.Linear(16, 64), nn.Linear(64, 16)
        self.gamma = nn.Parameter(torch.full((16,), 0.5))
        self.head = nn.Linear(16, 10)

    def forward(self, x):
        x = self.stem(x)
        y = self.norm(self.dw(x).permute(0, 2, 3, 1))
        y = (self.fc2(F.gelu(self.fc1(y))) * self.gamma).permute(0, 3, 1, 2)
        return self.head((x + y).mean((2, 3)))


ZOO = {"unet": UNetish, "convnext": ConvNeXtish, "mobilenetv2": MobileNetV2ish, "mobilenetv3": MobileNetV3ish, "efficientnet": EfficientNetish,
       "densenet": DenseNetish, "squeezenet": SqueezeNetish, "inception": Inceptionish,
       "shufflenet": ShuffleNetish, "vgg": VGGish}


def make_zoo(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = ZOO[name]().eval()
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.2, 0.2)
            m.running_var.uniform_(0.5, 1.5)
            m.weight.data.uniform_(0.5, 1.5)
            m.bias.data.uniform_(-0.2, 0.2)
    return model
