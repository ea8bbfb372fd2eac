"""The builder: ONNX in, a Plan out, as named stages (preprocess, import, passes, precision, lowering, planning)."""
