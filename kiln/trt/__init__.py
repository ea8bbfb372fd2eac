"""TensorRT at the edge: every TensorRT string kiln reads or writes (layer and runner type names, `Format/Datatype`
prose, log-line formats, layer-info and profile JSON) lives in this package; the plan records kiln's own facts."""
