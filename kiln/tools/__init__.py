"""Tools on top of engines: accuracy comparison against onnxruntime, precision and failure debugging (`debug
precision`, `debug reduce`), and exports to other tools (Triton model repositories, Google Model Explorer)."""
