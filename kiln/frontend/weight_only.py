"""onnxruntime's MatMulNBits weights (weight-only INT2/INT4/INT8, blockwise scales and zero points, as its
matmul_nbits_quantizer, Optimum and the model builder write them) dequantized to FP32 at import. kiln runs
weight-only quantized products in FP32 with prepacked weights; it has no 4-bit kernel."""
from __future__ import annotations

import numpy as np


def unpack_bits(packed: np.ndarray, bits: int) -> np.ndarray:
    """Each byte's 8 / bits values, the lowest bits first, along a new last axis folded into the one before."""
    per_byte = 8 // bits
    shifts = np.arange(per_byte, dtype=np.uint8) * bits
    values = (packed[..., None] >> shifts) & np.uint8((1 << bits) - 1)
    return values.reshape(*packed.shape[:-1], packed.shape[-1] * per_byte)


def nbits_shape_error(packed: np.ndarray, scales: np.ndarray, zero_points: np.ndarray | None, k: int, n: int,
                      bits: int, block_size: int) -> str | None:
    """What is wrong with MatMulNBits' weight, scale and zero-point sizes for K=k, N=n; None when they fit."""
    if k <= 0 or n <= 0 or block_size <= 0:
        return f"K={k}, N={n}, block_size={block_size}: each must be positive"
    blocks = -(-k // block_size)
    want = {"packed weights": (packed.size, n * blocks * (block_size * bits // 8)), "scales": (scales.size, n * blocks)}
    if zero_points is not None:
        per_row = -(-blocks * bits // 8) if zero_points.dtype == np.uint8 else blocks
        want["zero points"] = (zero_points.size, n * per_row)
    return next((f"its {what} hold {got} values, not the {need} that K={k}, N={n}, bits={bits}, "
                 f"block_size={block_size} make" for what, (got, need) in want.items() if got != need), None)


def dequantize_nbits(packed: np.ndarray, scales: np.ndarray, zero_points: np.ndarray | None, k: int, n: int,
                     bits: int, block_size: int) -> np.ndarray:
    """MatMulNBits' weights as FP32 [n, k] (the type of `scales` when that is float16):
    (q - zero point) * scale per block of `block_size` along k. `packed` is uint8 [n, blocks, block_size * bits / 8];
    `zero_points` is uint8 packed per row like the weights, or of the scales' type, one per block, unpacked; absent
    means 2^(bits - 1)."""
    blocks = -(-k // block_size)
    q = unpack_bits(packed.reshape(n, blocks, -1), bits).reshape(n, -1)[:, :k].astype(np.float32)
    scale = scales.reshape(n, blocks).astype(np.float32)
    if zero_points is None:
        zp = np.full((n, blocks), float(1 << (bits - 1)), np.float32)
    elif zero_points.dtype == np.uint8:
        zp = unpack_bits(zero_points.reshape(n, -1), bits)[:, :blocks].astype(np.float32)
    else:
        zp = zero_points.reshape(n, blocks).astype(np.float32)
    per_element = np.repeat(np.arange(blocks), block_size)[:k]
    return ((q - zp[:, per_element]) * scale[:, per_element]).astype(scales.dtype)
