"""Best-effort decoding of GPU kernel / tactic names (TensorRT xmma, cuDNN, cuBLAS, CUTLASS, Myelin) and kiln's
"library.kernel" tactic names into a `KernelName`. Never raises: what is not understood goes to `rest`.

Type convention (xmma): up to three "_"-separated type groups follow the operation, e.g. "i8f32_i8i32_f32":
group 1 = (input type, output type) -> i8, f32; group 2 = (MMA operand type, accumulator type) -> i8, i32, or just
the accumulator when it holds one type ("f32"); group 3 = epilogue compute type -> f32. A fused pair like
"int8int8" is read as (input, output). cuDNN/cuBLAS prefixes ("scudnn", "h1688gemm") give the compute type
(s=f32, h=f16, i=i8, d=f64) and, with digits, the MMA shape (884 -> 8x8x4, 1688 -> 16x8x8, 16816 -> 16x8x16).
GEMM transposes ("tn_n", "nn") go to `transpose`; generation names (ampere_, volta_, ...) map to a base "smXX".
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field, replace

_GENERATIONS = {"kepler": "sm35", "maxwell": "sm50", "pascal": "sm60", "volta": "sm70", "turing": "sm75",
                "ampere": "sm80", "ada": "sm89", "hopper": "sm90", "blackwell": "sm100"}
_TYPE_ATOMS = {"i8": "i8", "int8": "i8", "s8": "i8", "u8": "u8", "i32": "i32", "int32": "i32", "i4": "i4",
               "f16": "f16", "fp16": "f16", "half": "f16", "f32": "f32", "fp32": "f32", "bf16": "bf16",
               "tf32": "tf32", "f64": "f64", "fp64": "f64", "e4m3": "e4m3", "e5m2": "e5m2", "fp8": "fp8"}
_TYPE_RX = re.compile("|".join(sorted(_TYPE_ATOMS, key=len, reverse=True)))
_PREFIX_TYPES = {"s": "f32", "h": "f16", "i": "i8", "d": "f64", "bf": "bf16", "c": "c32", "z": "c64"}
_MMA_DIGITS = {"884": "8x8x4", "1688": "16x8x8", "16816": "16x8x16", "8816": "8x8x16", "16832": "16x8x32",
               "1684": "16x8x4", "16832i": "16x8x32"}
_OPERATIONS = {"fprop": "fprop", "fwd": "fprop", "conv": "fprop", "conv2d": "fprop", "convolution": "fprop",
               "dgrad": "dgrad", "wgrad": "wgrad", "bwd": "dgrad", "deconv": "dgrad", "gemm": "gemm", "gemv": "gemv",
               "pooling": "pooling", "pool": "pooling", "softmax": "softmax", "reduce": "reduce", "mha": "mha",
               "fmha": "mha", "matmul": "gemm", "pointwise": "pointwise", "elementwise": "pointwise",
               "reformat": "reformat", "region": "region", "layer": "layer", "reference": "reference",
               "segment": "region", "constant": "constant", "noop": "noop", "copy": "copy"}
_FLAGS = {"relu", "bias", "scalebias", "simt", "interleaved", "xregs", "large", "medium", "small", "gelu",
          "sigmoid", "tanh", "swish", "silu", "clip", "leakyrelu", "residual", "splitk", "sliced", "prepacked",
          "nhwckrsc", "exp", "stridedb", "batched", "packed", "copy"}
_LIBRARY_WORDS = {"xmma": "xmma", "cutlass": "cutlass", "cudnn": "cudnn", "cublas": "cublas", "cublaslt": "cublas",
                  "trt": "trt", "cask": "trt", "myelin": "myelin/kgen", "kgen": "myelin/kgen"}
_ALGORITHMS = re.compile(r"implicit_precomp_gemm|implicit_gemm|first_layer_filter\d+x\d+|conv1x1|winograd|"
                         r"direct|fft_tiling|fft|precomputed|avdt|depthwise|dw|gap|indexed_wo_smem|indexed")
_LAYOUT_START = r"(?=_|$|kcrs|krsc|nchw|nhwc|ncdhw|ndhwc)"
_LAYOUT = re.compile(r"(ncdhw|ndhwc|nchw|nhwc|kcrs|krsc|ncxhw\d+|nc\d+hw\d*|chwn|hwcn|nc)(_vect_c_\d+)?" + _LAYOUT_START)
_SIMPLE = [("tile", re.compile(r"tile(?:size)?(\d+x\d+(?:x\d+)?)(?=_|$)")),
           ("stages", re.compile(r"stages?(\d+)(?=_|$)")),
           ("warps", re.compile(r"warpsize(\d+x\d+x\d+)(?=_|$)")),
           ("mma_shape", re.compile(r"tensor(\d+x\d+x\d+)(?=_|$)")),
           ("groups", re.compile(r"(g\d+)(?=_|$)")),
           ("alignment", re.compile(r"(align[a-z]?\d+)(?=_|$)")),
           ("stride", re.compile(r"(u\d+v\d+)(?=_|$)")),
           ("filter_size", re.compile(r"((?:t\d+)?r\d+s\d+)(?=_|$)")),
           ("threads_per_cta", re.compile(r"threadspercta(\d+)(?=_|$)")),
           ("hash", re.compile(r"(0x[0-9a-f]+)(?=_|$)"))]
_MAX_LEN = 2048


@dataclass(frozen=True)
class KernelName:
    """One kernel name, decoded. Fields the name does not show stay None / empty."""

    raw: str
    arch: str | None = None              # "sm80"
    generation: str | None = None        # "ampere" when the name says so instead of smXX
    library: str | None = None           # xmma, cudnn, cublas, cutlass, myelin/kgen, trt, onednn, onnxruntime, ...
    operation: str | None = None         # fprop, dgrad, wgrad, gemm, pooling, mha, fused, ...
    algorithm: str | None = None         # implicit_gemm, winograd, direct, conv1x1, first_layer_filter3x3, ...
    input_type: str | None = None
    output_type: str | None = None
    mma_type: str | None = None          # operand type of the MMA instruction
    accumulator_type: str | None = None
    compute_type: str | None = None      # epilogue / scaling type
    layouts: tuple[str, ...] = ()        # nchw, nchw_vect_c_32, kcrs_vect_c_32, ncxhw32, ...
    transpose: str | None = None         # GEMM operand transposes: "tn_n", "nn"
    tile: str | None = None
    stages: int | None = None
    warps: str | None = None
    mma_shape: str | None = None
    filter_size: str | None = None       # "r3s3" ("t3r3s3" for 3-D filters)
    groups: str | None = None
    alignment: str | None = None
    stride: str | None = None            # "u1v1"
    threads_per_cta: int | None = None
    sparse: bool = False
    uses_tensor_cores: bool = False
    flags: tuple[str, ...] = ()          # relu, bias, small_batch, simt, interleaved, ...
    ops: tuple[str, ...] = ()            # Myelin fused-op sequence: ("Add", "Cast", "Mean", ...)
    hash: str | None = None
    rest: tuple[str, ...] = field(default=())


def _types(token: str) -> list[str] | None:
    """"i8f32" -> ["i8", "f32"]; None when the token is not made only of type atoms."""
    atoms, pos = [], 0
    while pos < len(token):
        m = _TYPE_RX.match(token, pos)
        if not m:
            return None
        atoms.append(_TYPE_ATOMS[m.group(0)])
        pos = m.end()
    return atoms or None


def _set_types(k: dict, atoms: list[str]) -> None:
    group = k.setdefault("_type_groups", 0)
    if group == 0:
        k["input_type"], k["output_type"] = atoms[0], atoms[-1]
    elif group == 1:
        if len(atoms) >= 2:
            k["mma_type"], k["accumulator_type"] = atoms[0], atoms[-1]
        else:
            k["accumulator_type"] = atoms[0]
    else:
        k["compute_type"] = atoms[-1]
    k["_type_groups"] = group + 1


def _library_token(k: dict, token: str) -> bool:
    """cuDNN / cuBLAS words with a type prefix and optional MMA digits: scudnn, h1688cudnn, s884gemm, sgemm."""
    m = re.fullmatch(r"(bf|[shidcz])?(\d{3,5})?(cudnn|gemm|gemv)", token)
    if not m or (m.group(3) in ("gemm", "gemv") and not (m.group(1) or m.group(2))):
        return False
    k.setdefault("library", "cudnn" if m.group(3) == "cudnn" else "cublas")
    if m.group(3) != "cudnn":
        k.setdefault("operation", m.group(3))
    if m.group(1):
        k.setdefault("compute_type", _PREFIX_TYPES[m.group(1)])
    if m.group(2):
        k.setdefault("mma_shape", _MMA_DIGITS.get(m.group(2), m.group(2)))
        k["uses_tensor_cores"] = True
    return True


def _word(k: dict, token: str) -> bool:
    """Single words: library names, operations, tensor-core markers, flags, transposes."""
    if token in _LIBRARY_WORDS:
        k.setdefault("library", _LIBRARY_WORDS[token])
    elif token in _OPERATIONS and "operation" not in k:
        k["operation"] = _OPERATIONS[token]
    elif token in ("imma", "hmma", "dmma", "tensor", "tensorcore", "tensorop", "tc", "qmma"):
        k["uses_tensor_cores"] = True
        k.setdefault("mma_type", {"imma": "i8", "hmma": "f16", "dmma": "f64"}.get(token))
    elif token == "sparse":
        k["sparse"] = True
    elif token in _FLAGS or re.fullmatch(r"v\d+|tapsperload\d+|ldg\d+|tile\d+t|sliced\d+x\d+", token):
        k.setdefault("flags", []).append(token)
    elif re.fullmatch(r"[nt]{1,2}", token) and ("operation" in k or "library" in k):
        k["transpose"] = f"{k['transpose']}_{token}" if k.get("transpose") else token
    elif (atoms := _types(token)) is not None:
        _set_types(k, atoms)
    else:
        return _library_token(k, token)
    return True


def _simple(k: dict, s: str, pos: int) -> int | None:
    """Patterns with a value (tile, stages, ...) and multi-token words; returns the new position or None."""
    for key, rx in _SIMPLE:
        m = rx.match(s, pos)
        if m and key not in k:
            value = m.group(1)
            k[key] = int(value) if key in ("stages", "threads_per_cta") else value
            if key == "mma_shape":
                k["uses_tensor_cores"] = True
            if key == "filter_size" and value.startswith("t1r"):
                k[key] = value[2:]
            return m.end()
    m = _LAYOUT.match(s, pos)
    if m:
        k.setdefault("layouts", []).append(m.group(0))
        return m.end()
    m = _ALGORITHMS.match(s, pos)
    if m and re.match(r"_|$", s[m.end():]) is not None and "algorithm" not in k:
        k["algorithm"] = m.group(0)
        return m.end()
    for multi in ("small_batch", "by_fusion_tactic", "split_k", "no_bias"):
        if s.startswith(multi, pos) and re.match(r"_|$", s[pos + len(multi):]):
            k.setdefault("flags", []).append(multi)
            return pos + len(multi)
    m = re.compile(r"(\d+x\d+(?:x\d+)?)(?=_|$)").match(s, pos)
    if m and "tile" not in k:
        k["tile"] = m.group(1)
        return m.end()
    return None


def _scan(k: dict, s: str) -> None:
    """Walk the lower-cased name left to right, one pattern or "_"-token at a time."""
    pos = 0
    m = re.match(r"sm_?(\d{2,3})[a-z]?(?=_|$)", s)
    if m:
        k["arch"], pos = f"sm{m.group(1)}", m.end()
    else:
        m = re.match(r"(" + "|".join(_GENERATIONS) + r")(?=_|$)", s)
        if m:
            k["generation"], k["arch"], pos = m.group(1), _GENERATIONS[m.group(1)], m.end()
    while pos < len(s):
        if s[pos] == "_":
            pos += 1
            continue
        new = _simple(k, s, pos)
        if new is not None and new > pos:
            pos = new
            continue
        end = s.find("_", pos)
        end = len(s) if end < 0 else end
        token = s[pos:end]
        if not _word(k, token):
            k.setdefault("rest", []).append(token)
        pos = end


def _myelin(raw: str) -> KernelName | None:
    m = re.fullmatch(r"__myl_([A-Za-z]+?)_(0x[0-9a-fA-F]+)", raw)
    if m:
        ops = tuple(re.findall(r"[A-Z][a-z0-9]*", m.group(1)))
        return KernelName(raw, library="myelin/kgen", operation="fused", ops=ops, hash=m.group(2))
    m = re.fullmatch(r"_(gemm_mha|mha|fmha|gemm)_?(v\d+)?_(0x[0-9a-fA-F]+)", raw)
    if m:
        op = "mha" if "mha" in m.group(1) else "gemm"
        return KernelName(raw, library="myelin/kgen", operation=op, flags=tuple(x for x in [m.group(2)] if x),
                          hash=m.group(3))
    return None


def _dotted(raw: str) -> KernelName | None:
    """kiln tactic names: "<library>.<kernel words>", e.g. "onednn.conv2d_nhwc_prepacked"."""
    m = re.fullmatch(r"([a-z][a-z0-9]*)\.([A-Za-z0-9_]+)", raw)
    if not m:
        return None
    base = _decode_parts(m.group(2).lower(), raw)
    op = base.operation or m.group(2).split("_")[0].lower()
    return replace(base, library=m.group(1), operation=op,
                   rest=tuple(t for t in base.rest if t != op))


def _decode_parts(s: str, raw: str) -> KernelName:
    k: dict = {}
    _scan(k, s)
    k.pop("_type_groups", None)
    if k.get("library") == "cudnn" and "operation" not in k:
        k["operation"] = "fprop"          # cuDNN forward convolution kernels name no operation
    if "algorithm" in k and k["algorithm"].startswith("first_layer"):
        k.setdefault("library", "trt")
    if "library" not in k and (k.get("algorithm") or k.get("operation")):
        k["library"] = "trt"
    for key in ("layouts", "flags", "rest"):
        if key in k:
            k[key] = tuple(k[key])
    return KernelName(raw, **k)


def decode_kernel_name(name: object) -> KernelName:
    """Decode one kernel or tactic name; any input (even junk) gives a KernelName, never an exception."""
    try:
        raw = name if isinstance(name, str) else str(name)
        if len(raw) > _MAX_LEN:
            return KernelName(raw, rest=(raw[:64] + "...",))
        text = raw.strip()
        if not text:
            return KernelName(raw)
        return _myelin(text) or _dotted(text) or _decode_parts(text.lower(), raw)
    except Exception:  # noqa: BLE001 - best effort by contract: never raise on any string
        return KernelName(str(name) if isinstance(name, str) else repr(name), rest=("<undecodable>",))
