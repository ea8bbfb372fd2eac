"""ONNX -> ONNX steps before import: INT8 calibration written as Q/DQ nodes (implicit quantization)."""
