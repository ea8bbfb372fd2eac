"""The kernel libraries kiln compiles: one table of their C sources (kiln/native/csrc) and the signature of every
function they export, and the translation unit each one compiles from."""
from __future__ import annotations

import ctypes
import functools
import re
from dataclasses import dataclass
from pathlib import Path

CSRC = Path(__file__).parent / "csrc"

POINTER, I64, F64 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double


@dataclass(frozen=True)
class Function:
    """One exported C function (kernel entry points return void)."""

    name: str
    argtypes: tuple[type, ...]
    restype: type | None = None


@dataclass(frozen=True)
class LibrarySpec:
    """A kernel library: its csrc file (None: the whole unit is generated, as for pointwise programs) and the
    functions it exports. `rendered_by` names the renderer whose text the unit needs ahead of the file."""

    name: str
    source: str | None
    functions: tuple[Function, ...]
    rendered_by: str = ""
    needs: str = ""   # an external C library it links (kiln.native.external); built only where that is installed


LIBRARIES: dict[str, LibrarySpec] = {spec.name: spec for spec in (
    LibrarySpec("gemm", "gemm.c", (   # the first argument: the layer's constants (kiln.tactics.gemm_c)
        *(Function(name, (POINTER,) * 4 + (I64, I64))   # ..., batch, rows
          for name in ("kiln_gemm", "kiln_gemm_bf16", "kiln_gemm_bf16_amx")),
        *(Function(name, (POINTER,) * 4 + (I64,))   # ..., batch
          for name in ("kiln_conv", "kiln_conv_bf16", "kiln_conv_bf16_amx")),
        Function("kiln_amx_ready", (), I64))),
    LibrarySpec("qgemm", "qgemm.c", (   # the first argument: the layer's constants (kiln.tactics.qgemm_c)
        Function("kiln_qgemm", (POINTER,) * 4 + (I64,)),
        Function("kiln_qconv", (POINTER,) * 4),
        Function("kiln_qgemm_amx", (POINTER,) * 4 + (I64,)),
        Function("kiln_qconv_amx", (POINTER,) * 4),
        *(Function(name, (POINTER,) * 3 + (I64, POINTER, POINTER))   # call, x, y, rows, colsum, w_scale
          for name in ("kiln_dqgemm", "kiln_dqgemm_amx")),
        *(Function(name, (POINTER,) * 6)   # call, x, y, residual (or NULL), colsum, w_scale
          for name in ("kiln_dqconv", "kiln_dqconv_amx")),
        Function("kiln_qgemm_act", (POINTER,) * 4 + (I64,) * 3),   # call, a, b, y, rows, x_zp, b_unsigned
        Function("kiln_qdepthwise", (POINTER,) * 3),   # call, x, y
        Function("kiln_amx_int8_ready", (), I64))),
    LibrarySpec("winograd", "winograd.c", (
        Function("wino_fused",   # ..., scratch, threads, io (gemm.h's IO_* bits), the output's pixel step
                 (POINTER, POINTER, I64, POINTER, POINTER, POINTER) + (I64,) * 14 + (POINTER, I64, I64, I64)),),
        rendered_by="the tile size M and the transforms (kiln.tactics.winograd_c.render)"),
    LibrarySpec("layernorm", "layernorm.c", (
        Function("kiln_layernorm", (POINTER,) * 5 + (I64,) * 2 + (F64,)),
        Function("kiln_layernorm_bf16", (POINTER,) * 5 + (I64,) * 2 + (F64, I64)),
        Function("kiln_layernorm_bf16_call", (POINTER,) * 4),   # params, x, skip, y: as a chain calls it
        # a, b (the residual, or NULL), gamma, beta, y, rows, n, eps, scales and zero points, types
        Function("kiln_layernorm_q8", (POINTER,) * 5 + (I64,) * 2 + (F64, POINTER, I64)),
        # x, gamma, beta, y, rows, n, groups, hw, eps, act, io
        Function("kiln_groupnorm", (POINTER,) * 4 + (I64,) * 4 + (F64, I64, I64)),
        # x, gamma, beta, y, batch, hw, channels, groups, eps, act, io
        Function("kiln_groupnorm_nhwc", (POINTER,) * 4 + (I64,) * 4 + (F64, I64, I64)))),
    LibrarySpec("conv_planes", "conv_planes.c", (   # the first argument: the layer's constants
        Function("kiln_conv_planes", (POINTER,) * 5 + (I64,)),)),   # ..., x, w, bias, y, batch
    LibrarySpec("depthwise", "depthwise.c", (   # the layer's constants, x, y, batch
        Function("kiln_depthwise", (POINTER,) * 3 + (I64,)),)),
    LibrarySpec("rotary", "rotary.c", (Function("kiln_rotary", (POINTER,) * 5),)),   # call, x, cos, sin, y
    LibrarySpec("softmax", "softmax.c", (
        Function("kiln_softmax", (POINTER,) * 2 + (I64,) * 4),   # x, y, outer, n, inner, io
        # x, y, rows, n, x scale, x zero point, y scale, y zero point, types (bit 0: x s8, bit 1: y s8)
        Function("kiln_softmax_q8", (POINTER,) * 2 + (I64,) * 2 + (ctypes.c_float, I64) * 2 + (I64,)))),
    LibrarySpec("attention", "attention.c", (   # the first argument: the layer's geometry (kiln.tactics.attention_c)
        Function("kiln_attention", (POINTER,) * 6),
        Function("kiln_attention_bf16", (POINTER,) * 6))),
    LibrarySpec("pool", "pool.c", (
        Function("kiln_maxpool", (POINTER,) * 2 + (I64,) * 14),
        Function("kiln_maxpool_u8", (POINTER,) * 2 + (I64,) * 14),
        Function("kiln_maxpool_s8", (POINTER,) * 2 + (I64,) * 14),
        Function("kiln_maxpool_bf16", (POINTER,) * 2 + (I64,) * 14),
        Function("kiln_avgpool", (POINTER,) * 2 + (I64,) * 3 + (POINTER, I64)),
        Function("kiln_global_pool", (POINTER,) * 2 + (I64,) * 6),
        Function("kiln_avgpool_q8", (POINTER,) * 2 + (I64,) * 3 + (POINTER,) * 2),
        Function("kiln_global_avgpool_q8", (POINTER,) * 2 + (I64,) * 3 + (POINTER,)))),
    LibrarySpec("quant", "quant.c", tuple(
        [Function(f"kiln_{op}_{t}", (POINTER, POINTER, I64, ctypes.c_float, I64))
         for op in ("quantize", "dequantize") for t in ("u8", "s8")]
        + [Function(f"kiln_quantize_nhwc_{t}", (POINTER, POINTER, I64, I64, I64, ctypes.c_float, I64))
           for t in ("u8", "s8")]
        + [Function(f"kiln_lookup_{t}", (POINTER, POINTER, I64, POINTER)) for t in ("u8", "f32")])),   # x, y, n, table
    LibrarySpec("resize", "resize.c", (
        Function("kiln_resize_nearest", (POINTER,) * 2 + (I64,) * 6 + (POINTER,) * 2 + (I64,)),   # ..., y_step
        # x, y, n, h, w, c, oh, ow, row taps, rows, row weights, col taps, cols, col weights, io
        Function("kiln_resize_taps", (POINTER,) * 2 + (I64,) * 7 + (POINTER,) * 2 + (I64,) + (POINTER,) * 2 + (I64,)),
        Function("kiln_resize_taps_q8", (POINTER,) * 2 + (I64,) * 7 + (POINTER,) * 2 + (I64,) + (POINTER,) * 3))),
    LibrarySpec("reformat", "reformat.c", (
        Function("kiln_to_nhwc", (POINTER,) * 2 + (I64,) * 4),   # x, y, n, c, hw, io (which sides are bf16)
        Function("kiln_to_nchw", (POINTER,) * 2 + (I64,) * 4),
        Function("kiln_copy_rows", (POINTER, I64, POINTER, POINTER, I64, I64, I64, I64)),
        Function("kiln_permute", (POINTER, POINTER, I64, POINTER, POINTER, I64)))),   # x, y, rank, dims, perm, size
    LibrarySpec("pointwise", None, (Function("kiln_pointwise", (POINTER,) * 3),),   # in, out, nest (or NULL)
                rendered_by="the whole loop nest, including pointwise.h (kiln.tactics.pointwise_c.generate)"),
    LibrarySpec("probe", "probe.c", (Function("kiln_probe", (ctypes.c_float,), ctypes.c_float),)),
    LibrarySpec("onednn", "onednn.c", (   # oneDNN primitives made once at load (kiln.tactics.onednn_prim)
        # call, a handle whose packed weights to share (or NULL), error, its size
        Function("kiln_dnnl_conv_create", (POINTER, POINTER, ctypes.c_char_p, I64), POINTER),
        Function("kiln_dnnl_matmul_create", (POINTER, POINTER, ctypes.c_char_p, I64), POINTER),
        Function("kiln_dnnl_shares_weights", (POINTER,), I64),
        # handle, rows (a product made for any number of rows), x, y, residual (or NULL) -> oneDNN's status
        Function("kiln_dnnl_run", (POINTER, I64, POINTER, POINTER, POINTER), I64),
        # calls, handles, (rows, x, y, residual, bytes copied, table, y bytes) per call, slots, the failing call
        # -> status
        Function("kiln_dnnl_run_chain", (I64, POINTER, POINTER, POINTER, POINTER), I64),
        Function("kiln_dnnl_destroy", (POINTER,))), needs="onednn"),
)}

_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


def translation_unit(spec: LibrarySpec, generated: str = "") -> str:
    """The C text compiled for `spec`: the renderer's `generated` text, then the csrc file (its own line numbers
    kept for diagnostics)."""
    if spec.rendered_by and not generated:
        raise ValueError(f"kernel library '{spec.name}' needs {spec.rendered_by}")
    if spec.source is None:
        return generated
    prefix = generated + ("\n" if generated and not generated.endswith("\n") else "")
    return f'{prefix}#line 1 "{spec.source}"\n{source_text(spec.source)}'


@functools.lru_cache(maxsize=None)
def source_text(name: str) -> str:
    """A csrc file's text (read once per process)."""
    return (CSRC / name).read_text()


def included_headers(unit: str) -> list[tuple[str, str]]:
    """(name, text) of every csrc header `unit` includes, directly or through another header, in a fixed order:
    the cache key covers them, so editing a header rebuilds every library that uses it."""
    found: dict[str, str] = {}
    pending = _INCLUDE.findall(unit)
    while pending:
        name = pending.pop(0)
        if name in found or not (CSRC / name).is_file():
            continue
        found[name] = source_text(name)
        pending += _INCLUDE.findall(found[name])
    return sorted(found.items())


def header_constant(header: str, name: str) -> int:
    """The integer a csrc header #defines as `name` (the one definition C and Python share, e.g. gemm.h's NR)."""
    match = re.search(rf"^#define {re.escape(name)} +(\d+)\b", source_text(header), re.MULTILINE)
    if match is None:
        raise LookupError(f"{CSRC / header} has no '#define {name} <integer>'")
    return int(match.group(1))


def bind(lib: ctypes.CDLL, spec: LibrarySpec) -> ctypes.CDLL:
    """Give each exported function of a loaded library its argument types from the table."""
    for fn in spec.functions:
        entry = getattr(lib, fn.name)
        entry.argtypes, entry.restype = list(fn.argtypes), fn.restype
    return lib
