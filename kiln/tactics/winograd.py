"""Winograd convolution for 3x3, stride-1 layers (Lavin & Gray's F(m x m, 3 x 3)): kiln's own kernel, built from
GEMMs. Each output tile of m x m needs (m+2)^2 multiplies per channel pair instead of 9 m^2, so F(4x4, 3x3) does
4x fewer multiplies than direct convolution; the input and output transforms cost memory traffic instead. That
wins where activations are large and channels moderate (ResNet's 56x56 to 14x14 stages) and loses on 7x7 maps
with 512 channels, where the transformed weights no longer fit in cache: the autotuner decides per layer.

Layout: channel-major (NHWC) in and out, like the oneDNN tactic, so the two mix without Reformat layers.
Steps per inference: pad; gather (m+2)x(m+2) tiles; input transform Bᵀ d B (two small GEMMs, one per axis); one
batched GEMM per tile position against weights transformed once at load (G g Gᵀ); output transform Aᵀ M A;
bias, residual and activation in the same pass that scatters tiles back into the image.
"""
from __future__ import annotations

import threading
from functools import lru_cache

import torch

from kiln.ops.nn import apply_activation
from kiln.tactics.base import HWC, Kernel, LayerView

# Transform matrices (Lavin & Gray 2016), interpolation points 0, ±1, ±2 (and ∞) for F(4,3); 0, ±1 for F(2,3).
_MATRICES = {
    2: ([[1, 0, -1, 0], [0, 1, 1, 0], [0, -1, 1, 0], [0, 1, 0, -1]],
        [[1, 0, 0], [1 / 2, 1 / 2, 1 / 2], [1 / 2, -1 / 2, 1 / 2], [0, 0, 1]],
        [[1, 1, 1, 0], [0, 1, -1, -1]]),
    4: ([[4, 0, -5, 0, 1, 0], [0, -4, -4, 1, 1, 0], [0, 4, -4, -1, 1, 0],
         [0, -2, -1, 2, 1, 0], [0, 2, -1, -2, 1, 0], [0, 4, 0, -5, 0, 1]],
        [[1 / 4, 0, 0], [-1 / 6, -1 / 6, -1 / 6], [-1 / 6, 1 / 6, -1 / 6],
         [1 / 24, 1 / 12, 1 / 6], [1 / 24, -1 / 12, 1 / 6], [0, 0, 1]],
        [[1, 1, 1, 1, 1, 0], [0, 1, -1, 2, -2, 0], [0, 1, 1, 4, 4, 0], [0, 1, -1, 8, -8, 1]]),
}
WINOGRAD_PREFIX = "kiln.conv2d_winograd"
MIN_OUTPUT = 8      # smaller maps waste most of each tile on padding
MIN_CHANNELS = 8


@lru_cache(maxsize=None)
def transforms(m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(Bᵀ, G, Aᵀ) in float64 for F(m x m, 3 x 3)."""
    bt, g, at = _MATRICES[m]
    return tuple(torch.tensor(a, dtype=torch.float64) for a in (bt, g, at))


def transform_weights(w: torch.Tensor, m: int) -> torch.Tensor:
    """[Cout, Cin, 3, 3] -> [(m+2)^2, Cin, Cout]: U = G g Gᵀ per channel pair, computed in float64."""
    _, g, _ = transforms(m)
    u = torch.einsum("pa,oiab,qb->pqio", g, w.double(), g)
    return u.reshape((m + 2) ** 2, w.shape[1], w.shape[0]).float().contiguous()


_SCRATCH = threading.local()


def scratch(numel: int) -> torch.Tensor:
    """This thread's float32 workspace of at least `numel` elements, shared by every Winograd layer (layers run
    one after another per thread), so the transforms' buffers stay in cache instead of one set per layer."""
    buffer = getattr(_SCRATCH, "buffer", None)
    if buffer is None or buffer.numel() < numel:
        with torch.inference_mode(False):   # a normal tensor: writable in and out of inference mode
            buffer = _SCRATCH.buffer = torch.empty(numel)
    return buffer


@lru_cache(maxsize=None)
def _compiled(m: int):
    """The C transforms for F(m x m, 3 x 3) (kiln.tactics.winograd_c), or None without a C compiler."""
    import ctypes

    from kiln.tactics import codegen, winograd_c

    if not codegen.available():
        return None
    bt, _, at = _MATRICES[m]
    lib = codegen.load_library(winograd_c.source(m, bt, at), "winograd")
    lib.wino_input.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 8
    lib.wino_output.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 7
    lib.wino_input.restype = lib.wino_output.restype = None
    return lib


def _fusable_relu(spec) -> bool:
    return bool(spec) and spec["op"] == "Relu"


class WinogradConvTactic:
    """One tactic per tile size: F(2x2, 3x3) and F(4x4, 3x3)."""

    source = "kiln"

    def __init__(self, m: int):
        self.m = m
        self.name = f"{WINOGRAD_PREFIX}_f{m}x{m}_3x3_nhwc"

    def supports(self, layer: LayerView) -> bool:
        if layer.op_type != "Conv" or layer.domain not in ("", "ai.onnx") or 1 not in layer.const_inputs:
            return False
        a, w, x = layer.attrs, layer.const_inputs[1], layer.input_shapes[0]
        if x is None or len(x) != 4 or layer.input_dtypes[0] != "float32" or tuple(w.shape[2:]) != (3, 3):
            return False
        if a.get("group", 1) != 1 or list(a.get("strides") or [1, 1]) != [1, 1] or \
                list(a.get("dilations") or [1, 1]) != [1, 1]:
            return False
        pads = a.get("pads") or [0, 0, 0, 0]
        out_h, out_w = x[2] + pads[0] + pads[2] - 2, x[3] + pads[1] + pads[3] - 2
        return (min(out_h, out_w) >= MIN_OUTPUT and min(w.shape[0], w.shape[1]) >= MIN_CHANNELS
                and not any(layer.input_dynamic[0] if layer.input_dynamic else ()))

    def input_formats(self, layer: LayerView) -> list[str]:
        return [HWC] * len(layer.input_shapes)

    def output_format(self, layer: LayerView, input_formats: list[str]) -> str:
        return HWC

    def prepare(self, layer: LayerView) -> Kernel:
        m, a = self.m, layer.attrs
        alpha = m + 2
        bt, _, at = (t.float() for t in transforms(m))
        u = transform_weights(layer.const_inputs[1], m)
        bias = layer.const_inputs.get(2)
        n, c, h, w = layer.input_shapes[0]
        cout = u.shape[2]
        pt, pl, pb, pr = (a.get("pads") or [0, 0, 0, 0])
        out_h, out_w = h + pt + pb - 2, w + pl + pr - 2
        tiles_h, tiles_w = -(-out_h // m), -(-out_w // m)
        tiles = n * tiles_h * tiles_w
        spec = a.get("activation")
        relu = _fusable_relu(spec)
        has_residual = len(layer.input_shapes) > 3 and layer.input_shapes[3] is not None
        crop = (tiles_h * m, tiles_w * m) != (out_h, out_w)

        if _compiled(m) is not None:
            return self._prepare_compiled(layer, u, tiles_h, tiles_w, out_h, out_w)
        bt_rows, at_rows = bt.expand(alpha, alpha, alpha), at.expand(m, m, alpha)
        sizes = [n * (tiles_h * m + 2) * (tiles_w * m + 2) * c, alpha * alpha * tiles * c, alpha * alpha * tiles * c,
                 alpha * alpha * tiles * cout, m * alpha * tiles * cout, m * m * tiles * cout]
        offsets = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
        hp, wp = tiles_h * m + 2, tiles_w * m + 2

        def workspace():
            flat = scratch(offsets[-1])
            padded, d, v, prod, t, y = (flat[offsets[i]:offsets[i + 1]] for i in range(len(sizes)))
            padded = padded.view(n, hp, wp, c)
            for border in (padded[:, :pt], padded[:, pt + h:], padded[:, :, :pl], padded[:, :, pl + w:]):
                border.zero_()
            return (padded, padded[:, pt:pt + h, pl:pl + w], d.view(alpha, alpha, tiles * c),
                    v.view(alpha, alpha, tiles * c), prod.view(alpha * alpha, tiles, cout),
                    t.view(m, alpha, tiles * cout), y.view(m, m, tiles * cout))

        def run(xs):
            padded, interior, d, v, prod, t, y = workspace()
            interior.copy_(xs[0].permute(0, 2, 3, 1))               # NHWC into the zero-bordered buffer
            s = padded.stride()
            d.view(alpha, alpha, n, tiles_h, tiles_w, c).copy_(
                padded.as_strided((alpha, alpha, n, tiles_h, tiles_w, c), (s[1], s[2], s[0], m * s[1], m * s[2], 1)))
            torch.mm(bt, d.view(alpha, -1), out=v.view(alpha, -1))     # Bᵀ along rows ...
            torch.bmm(bt_rows, v, out=d)                               # ... and along columns
            torch.bmm(d.view(alpha * alpha, tiles, c), u, out=prod)    # one GEMM per tile position
            torch.mm(at, prod.view(alpha, -1), out=t.view(m, -1))      # Aᵀ along rows ...
            torch.bmm(at_rows, t, out=y)                               # ... and along columns
            tiled = y.view(m, m, n, tiles_h, tiles_w, cout).permute(2, 3, 0, 4, 1, 5)
            out = torch.empty((n, tiles_h, m, tiles_w, m, cout))
            if bias is not None:
                torch.add(tiled, bias, out=out)
            else:
                out.copy_(tiled)
            out = out.view(n, tiles_h * m, tiles_w * m, cout)
            if crop:
                out = out[:, :out_h, :out_w].contiguous()
            if has_residual:
                out.add_(xs[3].permute(0, 2, 3, 1))
            if relu:
                out.relu_()
            result = out.permute(0, 3, 1, 2)                          # NCHW view of channel-major memory
            return [result if relu or not spec else apply_activation(spec, result)]
        return run

    def _prepare_compiled(self, layer: LayerView, u: torch.Tensor, tiles_h: int, tiles_w: int,
                          out_h: int, out_w: int) -> Kernel:
        """One C pass in (tiles gathered and transformed straight from the NHWC input), the GEMMs, one C pass out
        (bias, residual and ReLU applied as tiles are written)."""
        m, a = self.m, layer.attrs
        lib = _compiled(m)
        n, c, h, w = layer.input_shapes[0]
        cout, alpha2 = u.shape[2], (m + 2) ** 2
        pt, pl = (a.get("pads") or [0, 0, 0, 0])[:2]
        tiles = n * tiles_h * tiles_w
        bias = layer.const_inputs.get(2)
        bias = None if bias is None else bias.float().contiguous()
        spec = a.get("activation")
        relu = _fusable_relu(spec)
        has_residual = len(layer.input_shapes) > 3 and layer.input_shapes[3] is not None
        last = torch.channels_last

        def run(xs):
            flat = scratch(alpha2 * tiles * (c + cout))
            v = flat[:alpha2 * tiles * c].view(alpha2, tiles, c)
            prod = flat[alpha2 * tiles * c:alpha2 * tiles * (c + cout)].view(alpha2, tiles, cout)
            x = xs[0] if xs[0].is_contiguous(memory_format=last) else xs[0].contiguous(memory_format=last)
            lib.wino_input(x.data_ptr(), v.data_ptr(), n, h, w, c, pt, pl, tiles_h, tiles_w)
            torch.bmm(v, u, out=prod)
            out = torch.empty((n, cout, out_h, out_w), memory_format=last)
            res = None
            if has_residual:
                res = xs[3] if xs[3].is_contiguous(memory_format=last) else xs[3].contiguous(memory_format=last)
            lib.wino_output(prod.data_ptr(), out.data_ptr(), None if bias is None else bias.data_ptr(),
                            None if res is None else res.data_ptr(), int(relu), n, out_h, out_w, cout,
                            tiles_h, tiles_w)
            return [out if relu or not spec else apply_activation(spec, out)]
        run.constants = (u, bias)
        return run
