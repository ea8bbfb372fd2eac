"""Winograd convolution for 3x3, stride-1 layers (Lavin & Gray's F(m x m, 3 x 3)): kiln's own kernel, built from
GEMMs. Each output tile of m x m needs (m+2)^2 multiplies per channel pair instead of 9 m^2, so F(4x4, 3x3) does
4x fewer multiplies than direct convolution; the input and output transforms cost memory traffic instead. That
wins where activations are large and channels moderate (ResNet's 56x56 to 14x14 stages) and loses on 7x7 maps
with 512 channels, where the transformed weights no longer fit in cache: the autotuner decides per layer.

Layout: channel-major (NHWC) in and out, like the oneDNN tactic, so the two mix without Reformat layers.
Steps per block of tiles: the input transform Bᵀ d B on (m+2)x(m+2) tiles read straight from the input; one
GEMM per tile position against weights transformed once at load (G g Gᵀ); the output transform Aᵀ M A, with
bias, residual and ReLU added as tiles are written. All three are C (kiln/native/csrc/winograd.c), a block at a
time so its intermediates stay in cache; where no C compiler is, they run as torch GEMMs over the whole layer
with separate pad, gather and epilogue passes.
"""
from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass
from functools import lru_cache

import torch

from kiln import native
from kiln.ops.nn import apply_activation
from kiln.tactics import gemm_c, winograd_c
from kiln.tactics.base import (HWC, STORED_FLOATS, Bf16Storage, Kernel, LayerView, batch_dynamic_only, has_residual,
                              storage_dtype)
from kiln.tactics.gemm_bf16 import io_flags

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
TILE_SIZES = tuple(_MATRICES)   # m of each F(m x m, 3 x 3) tactic
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


def rendered_source(m: int) -> str:
    """What kiln/native/csrc/winograd.c is compiled after for F(m x m, 3 x 3) (kiln.tactics.winograd_c)."""
    bt, _, at = _MATRICES[m]
    return winograd_c.render(m, bt, at)


def _compiled(m: int):
    """The C transforms for F(m x m, 3 x 3), or None without a C compiler."""
    return native.library(winograd_c.LIBRARY, rendered_source(m))


class WinogradConvTactic:
    """One tactic per tile size: F(2x2, 3x3) and F(4x4, 3x3)."""

    source = "kiln"
    stored_types = ("float32",)   # the types its input and residual may be stored in
    io_flags = staticmethod(gemm_c.no_io_flags)

    def __init__(self, m: int):
        self.m = m
        self.name = f"{WINOGRAD_PREFIX}_f{m}x{m}_3x3_nhwc"

    def supports(self, layer: LayerView) -> bool:
        if layer.op_type != "Conv" or layer.domain not in ("", "ai.onnx") or 1 not in layer.const_inputs:
            return False
        a, w, x = layer.attrs, layer.const_inputs[1], layer.input_shapes[0]
        if x is None or len(x) != 4 or tuple(w.shape[2:]) != (3, 3):
            return False
        if any(layer.input_dtypes[i] not in self.stored_types for i in (0, 3)
               if i < len(layer.input_dtypes) and layer.input_shapes[i] is not None):
            return False
        if a.get("group", 1) != 1 or list(a.get("strides") or [1, 1]) != [1, 1] or \
                list(a.get("dilations") or [1, 1]) != [1, 1]:
            return False
        pads = a.get("pads") or [0, 0, 0, 0]
        out_h, out_w = x[2] + pads[0] + pads[2] - 2, x[3] + pads[1] + pads[3] - 2
        # a dynamic batch only on the C path, which sizes its blocks per call
        return (min(out_h, out_w) >= MIN_OUTPUT and min(w.shape[0], w.shape[1]) >= MIN_CHANNELS
                and (not any(layer.input_dynamic) or (batch_dynamic_only(layer) and native.available())))

    def input_formats(self, layer: LayerView) -> list[str]:
        return [HWC] * len(layer.input_shapes)

    def output_format(self, layer: LayerView, input_formats: list[str]) -> str:
        return HWC

    def prepare(self, layer: LayerView) -> Kernel:
        g = _Geometry.of(layer, self.m)
        u = transform_weights(layer.const_inputs[1], self.m)
        lib = _compiled(self.m)
        return _torch_kernel(g, u) if lib is None else _compiled_kernel(g, u, lib, self.io_flags(layer),
                                                                       storage_dtype(layer.output_dtypes[0]))


class WinogradBf16Tactic(Bf16Storage, WinogradConvTactic):
    """F(4x4, 3x3) with FP32 arithmetic throughout and bf16 storage: it reads its input and residual and writes its
    output as the plan stores them (widened as tiles are read, the result rounded to nearest even as it is written),
    so a 3x3 layer between BF16 layers keeps their tensors bf16. Its only rounding is the output's, less than any
    BF16 kernel's (bf16 products in the transformed domain lost 10x more accuracy: 2e-2 relative error). C only:
    where no compiler is, a loaded engine runs it on torch's reference kernel (kiln.runtime.prepare)."""

    needs_c_compiler = True
    stored_types = STORED_FLOATS
    bf16_inputs = frozenset({0, 3})
    io_flags = staticmethod(io_flags)

    def __init__(self, m: int = 4):
        super().__init__(m)
        self.name += "_bf16"

    def supports(self, layer: LayerView) -> bool:
        return native.available() and super().supports(layer)


@dataclass(frozen=True)
class _Geometry:
    """One layer's shapes, tiling and fused epilogue, shared by both implementations."""

    m: int
    n: int
    c: int
    h: int
    w: int
    cout: int
    pads: tuple[int, int, int, int]   # top, left, bottom, right
    out_h: int
    out_w: int
    tiles_h: int
    tiles_w: int
    bias: torch.Tensor | None
    spec: dict | None                 # the fused activation
    has_residual: bool

    @staticmethod
    def of(layer: LayerView, m: int) -> "_Geometry":
        n, c, h, w = layer.input_shapes[0]
        pt, pl, pb, pr = layer.attrs.get("pads") or [0, 0, 0, 0]
        out_h, out_w = h + pt + pb - 2, w + pl + pr - 2
        bias = layer.const_inputs.get(2)
        return _Geometry(m, n, c, h, w, layer.const_inputs[1].shape[0], (pt, pl, pb, pr), out_h, out_w,
                         -(-out_h // m), -(-out_w // m), None if bias is None else bias.float().contiguous(),
                         layer.attrs.get("activation"),
                         has_residual(layer))

    @property
    def tiles(self) -> int:
        return self.n * self.tiles_h * self.tiles_w

    @property
    def act(self) -> int:
        """The C path applies ReLU and Swish while tiles are written (gemm_c.activation_code)."""
        return gemm_c.activation_code(self.spec)

    @property
    def relu(self) -> bool:
        return bool(self.spec) and self.spec["op"] == "Relu"

    def activate(self, out: torch.Tensor) -> torch.Tensor:
        """The torch path's activation after its in-place ReLU: any other one is applied here."""
        return out if self.relu or not self.spec else apply_activation(self.spec, out)


def _compiled_kernel(g: _Geometry, u: torch.Tensor, lib, io: int, out_dtype: torch.dtype) -> Kernel:
    """Per block of tiles, in C: the input transform read straight from the NHWC input, the GEMMs, the output
    transform with bias, residual and ReLU or Swish applied as tiles are written (kiln/native/csrc/winograd.c).
    `io`: which of input, output and residual are stored in bf16 (gemm_bf16's IO_* bits), `out_dtype` the output's."""
    bias_ptr = None if g.bias is None else g.bias.data_ptr()
    packed = gemm_c.pack_weights(u)
    panel_stride = packed[0].numel()
    threads = torch.get_num_threads()
    blockings = {g.n: fused_blocking(g, threads)}   # per batch size seen: a dynamic batch changes the tile count
    act = g.act

    def launch(x, out, res, pixel_step=g.cout):
        n = x.shape[0]
        blocking = blockings.get(n) or blockings.setdefault(n, fused_blocking(dataclasses.replace(g, n=n), threads))
        block, groups, per_thread = blocking
        lib.wino_fused(x.data_ptr(), packed.data_ptr(), panel_stride, out.data_ptr(), bias_ptr,
                       None if res is None else res.data_ptr(), act, n, g.h, g.w, g.c, g.cout,
                       g.pads[0], g.pads[1], g.out_h, g.out_w, g.tiles_h, g.tiles_w, block, groups,
                       scratch(per_thread * threads).data_ptr(), threads, io, pixel_step)
    run = gemm_c.nhwc_kernel(launch, (g.n, g.cout, g.out_h, g.out_w), g.spec, g.has_residual, out_dtype)
    run.constants = (packed, g.bias)   # the C code reads them through raw pointers
    if not g.has_residual and (act or not g.spec):   # into a Concat's channel slice (kiln.runtime.elision)
        run.write_into = gemm_c.write_into_rows(run, lambda x, out, step: launch(x, out, None, step),
                                                (g.cout, g.out_h, g.out_w), out_dtype)
    return run


BLOCK_BYTES = 256 * 1024      # a block's transformed input: stays in L2 next to its products
STREAM_ONCE_BYTES = 4 << 20   # transformed weights above this are streamed once: one block, columns split


def fused_blocking(g: _Geometry, threads: int) -> tuple[int, int, int]:
    """(tiles per block, column-panel groups, scratch floats per thread). Blocks are whole register tiles (6
    rows); with few blocks the output columns are split into groups too, so every thread has work. Each block
    reads all of its group's weights, so where they are large (ResNet-50's 14x14 and 7x7 layers: 9.4 and 16.8
    MB) every tile goes in one block."""
    alpha2, panels = (g.m + 2) ** 2, -(-g.cout // gemm_c.PANEL)
    block = max(gemm_c.ROW_TILE, BLOCK_BYTES // (alpha2 * g.c * 4) // gemm_c.ROW_TILE * gemm_c.ROW_TILE)
    if alpha2 * g.c * g.cout * 4 > STREAM_ONCE_BYTES:
        block = g.tiles
    block = min(block, g.tiles)
    groups = 1 if -(-g.tiles // block) >= 4 * threads else min(panels, threads)
    group_panels = -(-panels // groups)
    return block, groups, alpha2 * block * (g.c + group_panels * gemm_c.PANEL)


def _torch_kernel(g: _Geometry, u: torch.Tensor) -> Kernel:
    """The transforms as torch GEMMs (where no C compiler is): pad, gather tiles, Bᵀ d B, the GEMMs, Aᵀ M A, then
    bias, crop, residual and ReLU as separate passes."""
    m, alpha, n, c, h, w, cout, tiles = g.m, g.m + 2, g.n, g.c, g.h, g.w, g.cout, g.tiles
    tiles_h, tiles_w = g.tiles_h, g.tiles_w
    pt, pl = g.pads[:2]
    bt, _, at = (t.float() for t in transforms(m))
    bt_rows, at_rows = bt.expand(alpha, alpha, alpha), at.expand(m, m, alpha)
    crop = (tiles_h * m, tiles_w * m) != (g.out_h, g.out_w)
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
        if g.bias is not None:
            torch.add(tiled, g.bias, out=out)
        else:
            out.copy_(tiled)
        out = out.view(n, tiles_h * m, tiles_w * m, cout)
        if crop:
            out = out[:, :g.out_h, :g.out_w].contiguous()
        if g.has_residual:
            out.add_(xs[3].permute(0, 2, 3, 1))
        if g.relu:
            out.relu_()
        return [g.activate(out.permute(0, 3, 1, 2))]             # NCHW view of channel-major memory
    return run
