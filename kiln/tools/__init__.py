"""Tools on top of engines: accuracy comparison against onnxruntime (outputs and intermediates)."""
