"""Reference semantics of ONNX ops (torch). Importing this package registers every op."""
from kiln.ops import elementwise, fused, indexing, nn, norm_resize, quantize, shape  # noqa: F401  (registration side effects)
from kiln.ops.registry import OPS, OpDef, OpKind, lookup

__all__ = ["OPS", "OpDef", "OpKind", "lookup"]
