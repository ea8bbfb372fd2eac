"""A segmentation U-Net in torch, for tests and benchmarks/compare.py (`unet`): a stride-2 stem, three encoder
stages of two 3x3 convolutions with GroupNorm(8) + SiLU (a diffusion U-Net's block; torch exports GroupNorm as an
InstanceNormalization between Reshapes), max-pool downsampling, ConvTranspose 2x2/2 up blocks concatenated with
their skips, a 1x1 classifier at half resolution and a bilinear upsample of the logits to the input's size (as
DeepLab and SegFormer heads do). Random weights; exported with kiln's usual exporter (tests/models/nets.export)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def block(cin: int, cout: int) -> nn.Sequential:
    """Two 3x3 convolutions, each with GroupNorm(8) and SiLU."""
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.GroupNorm(8, cout), nn.SiLU(),
                         nn.Conv2d(cout, cout, 3, padding=1), nn.GroupNorm(8, cout), nn.SiLU())


class UNet(nn.Module):
    def __init__(self, width: int = 32, classes: int = 4):
        super().__init__()
        w = [width, 2 * width, 4 * width, 8 * width]
        self.stem = nn.Conv2d(3, w[0], 3, stride=2, padding=1)
        self.down = nn.ModuleList([block(w[0], w[0]), block(w[0], w[1]), block(w[1], w[2])])
        self.middle = block(w[2], w[3])
        self.up = nn.ModuleList([nn.ConvTranspose2d(w[i + 1], w[i], 2, stride=2) for i in (2, 1, 0)])
        self.decode = nn.ModuleList([block(2 * w[i], w[i]) for i in (2, 1, 0)])
        self.classify = nn.Conv2d(w[0], classes, 1)

    def forward(self, x):
        size = x.shape[2:]
        y, skips = self.stem(x), []
        for stage in self.down:
            y = stage(y)
            skips.append(y)
            y = F.max_pool2d(y, 2)
        y = self.middle(y)
        for up, decode, skip in zip(self.up, self.decode, reversed(skips)):
            y = decode(torch.cat([up(y), skip], 1))
        return F.interpolate(self.classify(y), size=size, mode="bilinear", align_corners=False)


def make_unet(width: int = 32, seed: int = 0) -> UNet:
    """The U-Net with random weights (GroupNorm's affine randomized too), in eval mode."""
    torch.manual_seed(seed)
    model = UNet(width)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.GroupNorm):
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.2, 0.2)
    return model.eval()
