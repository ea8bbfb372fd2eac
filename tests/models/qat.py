"""TensorRT-style quantization-aware training, as pytorch-quantization and ModelOpt export it: each Conv2d and
Linear reads its input through symmetric s8 fake quantization (one calibrated scale) and its weights through s8
per output channel; BatchNorm, residual sums and activations stay FP32. The ONNX export then has Q/DQ pairs only
in front of those layers.

    model = fake_quantize(nets.make("resnet18"), sample)      # in place; calibrates input scales on `sample`
"""
from __future__ import annotations

import torch


class FakeQuantized(torch.nn.Module):
    """`layer` (a Conv2d or Linear) reading its input and weights through fake quantization, as QAT tools export
    it: s8 per tensor for the input (a calibrated, constant scale), s8 per output channel for the weights."""

    def __init__(self, layer: torch.nn.Module, input_amax: float):
        super().__init__()
        self.layer, self.x_scale = layer, max(input_amax, 1e-6) / 127
        w = layer.weight.detach()
        self.register_buffer("w_scale", w.abs().amax(dim=tuple(range(1, w.dim()))).clamp(min=1e-8) / 127)

    def forward(self, x):
        x = torch.fake_quantize_per_tensor_affine(x, self.x_scale, 0, -128, 127)
        zero = torch.zeros_like(self.w_scale, dtype=torch.int32)
        w = torch.fake_quantize_per_channel_affine(self.layer.weight, self.w_scale, zero, 0, -128, 127)
        if isinstance(self.layer, torch.nn.Conv2d):
            return self.layer._conv_forward(x, w, self.layer.bias)
        return torch.nn.functional.linear(x, w, self.layer.bias)


def fake_quantize(model: torch.nn.Module, sample: torch.Tensor) -> torch.nn.Module:
    """Every Conv2d and Linear of `model` fake-quantized, input scales calibrated on `sample`."""
    layers = [(parent, name, m) for parent in model.modules() for name, m in parent.named_children()
              if isinstance(m, (torch.nn.Conv2d, torch.nn.Linear))]
    amax = {}
    hooks = [m.register_forward_pre_hook(lambda m, xs: amax.__setitem__(m, xs[0].abs().max().item()))
             for _, _, m in layers]
    with torch.no_grad():
        model(sample)
    for h in hooks:
        h.remove()
    for parent, name, m in layers:
        setattr(parent, name, FakeQuantized(m, amax[m]))
    return model
