"""The engine loader's own safetensors reader: views into the file buffer, checked like untrusted input."""
import json
import struct

import numpy as np
import pytest
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save

from kiln.plan.weights_view import weight_views
from kiln.errors import EngineFormatError


def _section(header: dict, data: bytes) -> memoryview:
    raw = json.dumps(header).encode()
    return memoryview(bytearray(struct.pack("<Q", len(raw)) + raw + data))


def test_views_match_safetensors_own_loader_and_share_the_buffer():
    tensors = {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "i": np.array([7, -1], np.int64),
               "h": np.ones((2, 1, 2), np.float16), "b": np.array([True, False]), "s": np.array(3.5, np.float64)}
    buffer = memoryview(bytearray(st_save(tensors)))
    views = weight_views(buffer)
    reference = st_load(bytes(buffer))
    assert views.keys() == reference.keys()
    for name, value in reference.items():
        assert views[name].dtype == value.dtype and views[name].shape == value.shape
        np.testing.assert_array_equal(views[name], value)
    views["w"][0, 0] = 42.0   # writable, and a view: the buffer changes
    assert weight_views(buffer)["w"][0, 0] == 42.0


def test_misaligned_tensor_is_copied_to_an_aligned_array():
    header = {"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]},
              "f": {"dtype": "F32", "shape": [2], "data_offsets": [1, 9]}}
    data = b"\x05" + np.array([1.5, -2.0], np.float32).tobytes()
    views = weight_views(_section(header, data))
    assert views["f"].ctypes.data % 4 == 0
    np.testing.assert_array_equal(views["f"], [1.5, -2.0])


@pytest.mark.parametrize("entry, message", [
    ({"dtype": "BF16", "shape": [2], "data_offsets": [0, 4]}, "unsupported or missing dtype"),
    ({"shape": [2], "data_offsets": [0, 8]}, "unsupported or missing dtype"),
    ({"dtype": "F32", "shape": [2], "data_offsets": [0, 80]}, "byte range outside the weights"),
    ({"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}, "negative dimension"),
    ({"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}, "shape [3] needs 12 bytes, its byte range holds 8"),
])
def test_bad_entries_name_the_weight(entry, message):
    with pytest.raises(EngineFormatError, match="weight 'x'") as info:
        weight_views(_section({"x": entry}, bytes(8)))
    assert message in str(info.value)


def test_header_longer_than_the_section_is_refused():
    with pytest.raises(EngineFormatError, match="exceeds the weights section"):
        weight_views(memoryview(bytearray(struct.pack("<Q", 1 << 40) + b"{}")))
