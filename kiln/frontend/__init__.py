"""ONNX front end."""
from kiln.frontend.onnx_import import import_onnx, load_model

__all__ = ["import_onnx", "load_model"]
