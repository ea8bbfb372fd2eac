"""InstanceNormalization and GroupNormalization in C (kiln/native/csrc/layernorm.c), with a fused ReLU or SiLU.

torch's GroupNorm exports as Reshape, InstanceNormalization, Reshape, Mul, Add (both exporters; wav2vec2, diffusion
U-Nets and VAEs); GroupNormFusion makes that one GroupNormalization on the 4-D map and NormActFusion adds the SiLU
after it. Two kernels, the same statistics (FP32 values, double sums):
- `kiln.groupnorm_rows`: row-major maps, a row per (n, group), one scale and bias per channel.
- `kiln.groupnorm_nhwc`: channel-major maps, as the convolutions around it write them. Each channel's sums are
  gathered over the image's pixels, shifted by its first value, then combined per group; a second pass scales
  and activates. Without it every GroupNorm of a U-Net sat between two Reformats (28 in the test U-Net).
"""
from __future__ import annotations

import torch

from kiln import native
from kiln.ops.norm_resize import per_channel
from kiln.tactics.base import HWC, LINEAR, STORED_FLOATS, Bf16Storage, Kernel, LayerView, bf16_io, storage_dtype
from kiln.tactics.gemm_c import activation_code

NORMS = ("InstanceNormalization", "GroupNormalization")


def group_geometry(layer: LayerView) -> tuple[int, int, int] | None:
    """(row size, groups, spatial size) of an InstanceNormalization or GroupNormalization over a static
    [N, C, spatial...] map (only the batch may vary) with constant scale and bias and a fused activation the
    kernels apply, or None."""
    if layer.op_type not in NORMS or layer.domain not in ("", "ai.onnx"):
        return None
    x = layer.input_shapes[0]
    if x is None or len(x) < 3 or len(layer.output_dtypes) != 1 or layer.input_dtypes[0] not in STORED_FLOATS:
        return None
    if layer.attrs.get("stash_type", 1) != 1 or any(set(d) - {0} for d in layer.input_dynamic[:1]):
        return None   # FP32 statistics, and only the batch may vary
    if any(i not in layer.const_inputs or layer.const_inputs[i].dtype != torch.float32 for i in (1, 2)):
        return None
    if layer.attrs.get("activation") and not activation_code(layer.attrs["activation"]):
        return None
    channels, hw = x[1], 1
    for d in x[2:]:
        hw *= d
    groups = layer.attrs.get("num_groups", channels) if layer.op_type == "GroupNormalization" else channels
    if groups < 1 or channels % groups or any(layer.const_inputs[i].numel() not in (channels, groups) for i in (1, 2)):
        return None
    return channels // groups * hw, groups, hw


class GroupNormTactic:
    """Row-major in and out: `kiln_groupnorm`, one row per (n, group)."""

    name = "kiln.groupnorm_rows"
    source = "kiln"
    needs_c_compiler = True
    stored_types = ("float32",)
    layout = LINEAR

    def supports(self, layer: LayerView) -> bool:
        return group_geometry(layer) is not None and native.available() and \
            layer.input_dtypes[0] in self.stored_types and layer.output_dtypes[0] in self.stored_types

    def input_formats(self, layer: LayerView) -> list[str]:
        return [self.layout] * len(layer.input_shapes)

    def output_format(self, layer: LayerView, input_formats: list[str]) -> str:
        return self.layout

    def parameters(self, layer: LayerView):
        """(per-channel scale, per-channel bias, epsilon, activation code, io bits, output dtype)."""
        channels, groups = layer.input_shapes[0][1], group_geometry(layer)[1]
        scale, bias = (per_channel(layer.const_inputs[i].float(), channels, groups).contiguous() for i in (1, 2))
        return (scale, bias, float(layer.attrs.get("epsilon", 1e-5)), activation_code(layer.attrs.get("activation")),
                bf16_io(layer), storage_dtype(layer.output_dtypes[0]))

    def prepare(self, layer: LayerView) -> Kernel:
        lib = native.library("layernorm")
        n, groups, hw = group_geometry(layer)
        scale, bias, eps, act, io, out_dtype = self.parameters(layer)

        def run(xs):
            x = xs[0].contiguous()
            y = torch.empty(x.shape, dtype=out_dtype)
            lib.kiln_groupnorm(x.data_ptr(), scale.data_ptr(), bias.data_ptr(), y.data_ptr(), x.numel() // n, n,
                               groups, hw, eps, act, io)
            return [y]
        run.constants = (scale, bias)
        return run


class GroupNormNhwcTactic(GroupNormTactic):
    """Channel-major (NHWC) 4-D maps in and out: `kiln_groupnorm_nhwc`, threads splitting each image's pixels."""

    name = "kiln.groupnorm_nhwc"
    layout = HWC

    def supports(self, layer: LayerView) -> bool:
        return super().supports(layer) and len(layer.input_shapes[0]) == 4

    def prepare(self, layer: LayerView) -> Kernel:
        lib = native.library("layernorm")
        _, groups, hw = group_geometry(layer)
        channels = layer.input_shapes[0][1]
        scale, bias, eps, act, io, out_dtype = self.parameters(layer)
        last = torch.channels_last

        def run(xs):
            x = xs[0].contiguous(memory_format=last)
            y = torch.empty(x.shape, dtype=out_dtype, memory_format=last)
            lib.kiln_groupnorm_nhwc(x.data_ptr(), scale.data_ptr(), bias.data_ptr(), y.data_ptr(), x.shape[0], hw,
                                    channels, groups, eps, act, io)
            return [y]
        run.constants = (scale, bias)
        return run


class GroupNormBf16Tactic(Bf16Storage, GroupNormTactic):
    """Granted BF16: reads and writes bf16 where the plan stores it so, statistics and scaling in FP32."""

    name = "kiln.groupnorm_rows_bf16"
    stored_types = STORED_FLOATS
    bf16_inputs = frozenset({0})


class GroupNormNhwcBf16Tactic(Bf16Storage, GroupNormNhwcTactic):
    """Granted BF16, channel-major: between BF16 convolutions no tensor is FP32."""

    name = "kiln.groupnorm_nhwc_bf16"
    stored_types = STORED_FLOATS
    bf16_inputs = frozenset({0})
