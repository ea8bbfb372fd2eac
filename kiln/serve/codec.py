"""The HTTP body of an inference, both ways: JSON tensors (nested or flat `data`) and Triton's binary-data
extension (`Inference-Header-Content-Length`, `binary_data_size`, `binary_data_output`, `binary_data`)."""
from __future__ import annotations

import json
import math

import numpy as np

from kiln.errors import InputError
from kiln.serve.datatypes import decode_bytes_tensor, encode_bytes_tensor, numpy_dtype
from kiln.serve.protocol import InferInput, InferRequest, InferResponse, RequestedOutput

HEADER_LENGTH = "Inference-Header-Content-Length"


def decode_request(body: bytes, header_length: str | None, model_name: str, model_version: str) -> InferRequest:
    """An InferRequest from an HTTP body; InputError (HTTP 400) naming the field or input at fault."""
    json_size = _json_size(header_length, len(body))
    try:
        header = json.loads(body[:json_size])
    except (UnicodeDecodeError, ValueError) as exc:
        raise InputError(f"malformed JSON in the request body: {exc}") from None
    if not isinstance(header, dict) or not isinstance(header.get("inputs"), list):
        raise InputError("the request body must be a JSON object with an 'inputs' list")
    binary = memoryview(body)[json_size:]
    inputs, offset = [], 0
    for index, item in enumerate(header["inputs"]):
        tensor, used = _decode_input(item, index, binary[offset:])
        inputs.append(tensor)
        offset += used
    if offset != len(binary):
        raise InputError(f"{len(binary) - offset} byte(s) after the JSON header belong to no input's "
                         "binary_data_size")
    params = _parameters(header.get("parameters"), "the request")
    return InferRequest(model_name, model_version, tuple(inputs), _requested_outputs(header.get("outputs")),
                        str(header.get("id", "")), bool(params.get("binary_data_output", False)))


def _json_size(header_length: str | None, body_size: int) -> int:
    if header_length is None:
        return body_size
    try:
        size = int(header_length)
    except ValueError:
        raise InputError(f"{HEADER_LENGTH} header {header_length!r} is not an integer") from None
    if not 0 <= size <= body_size:
        raise InputError(f"{HEADER_LENGTH} {size} exceeds the body's {body_size} bytes (truncated body?)")
    return size


def _decode_input(item, index: int, binary: memoryview) -> tuple[InferInput, int]:
    """One input tensor and the number of binary bytes it used."""
    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
        raise InputError(f"inputs[{index}] must be an object with a 'name'")
    where = f"input '{item['name']}'"
    datatype, shape = item.get("datatype"), item.get("shape")
    dtype = numpy_dtype(datatype, where)
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                              for d in shape):
        raise InputError(f"{where}: 'shape' must be a list of non-negative integers, got {shape!r}")
    count = math.prod(shape)
    params = _parameters(item.get("parameters"), where)
    if "binary_data_size" in params:
        size = params["binary_data_size"]
        if not isinstance(size, int) or size < 0:
            raise InputError(f"{where}: binary_data_size must be a non-negative integer, got {size!r}")
        if size > len(binary):
            raise InputError(f"{where}: binary_data_size {size} but only {len(binary)} byte(s) remain in the "
                             "body (truncated body?)")
        return InferInput(item["name"], datatype, tuple(shape), array_from_bytes(bytes(binary[:size]), dtype, shape,
                                                                          where)), size
    if "data" not in item:
        raise InputError(f"{where}: neither 'data' nor parameters.binary_data_size is given")
    return InferInput(item["name"], datatype, tuple(shape), _from_json(item["data"], dtype, shape, where)), 0


def array_from_bytes(data: bytes, dtype: np.dtype, shape: list[int], where: str) -> np.ndarray:
    count = math.prod(shape)
    if dtype == object:
        return decode_bytes_tensor(data, count, where).reshape(shape)
    expected = count * dtype.itemsize
    if len(data) != expected:
        raise InputError(f"{where}: binary_data_size {len(data)} does not match shape {shape} of "
                         f"{dtype.name} ({expected} bytes)")
    # a writable copy: torch refuses to share read-only memory, and the body's buffer is released after decoding
    return np.frombuffer(data, dtype.newbyteorder("<")).astype(dtype, copy=True).reshape(shape)


def _from_json(data, dtype: np.dtype, shape: list[int], where: str) -> np.ndarray:
    if not isinstance(data, list):
        data = [data]
    try:
        if dtype == object:
            array = np.array([s.encode() if isinstance(s, str) else s for s in _flatten(data)], dtype=object)
        elif dtype == bool:
            flat = _flatten(data)
            if not all(isinstance(v, bool) for v in flat):
                raise ValueError("BOOL data must be true/false")
            array = np.array(flat, dtype=bool)
        else:
            flat = _flatten(data)
            if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in flat):
                raise ValueError("numbers expected")
            array = np.array(flat, dtype=dtype)
    except (ValueError, OverflowError, TypeError) as exc:
        raise InputError(f"{where}: 'data' cannot be read as {dtype.name} ({exc})") from None
    if array.size != math.prod(shape):
        raise InputError(f"{where}: 'data' has {array.size} element(s) but shape {shape} needs "
                         f"{math.prod(shape)}")
    return array.reshape(shape)


def _flatten(data: list) -> list:
    """Row-major values of nested lists (the protocol allows nested or flat `data`)."""
    out: list = []
    stack = [iter(data)]
    while stack:
        for value in stack[-1]:
            if isinstance(value, list):
                stack.append(iter(value))
                break
            out.append(value)
        else:
            stack.pop()
    return out


def _parameters(params, where: str) -> dict:
    if params is None:
        return {}
    if not isinstance(params, dict):
        raise InputError(f"{where}: 'parameters' must be a JSON object")
    return params


def _requested_outputs(outputs) -> tuple[RequestedOutput, ...]:
    if outputs is None:
        return ()
    if not isinstance(outputs, list) or not all(isinstance(o, dict) and isinstance(o.get("name"), str)
                                                for o in outputs):
        raise InputError("'outputs' must be a list of objects with a 'name'")
    requested = []
    for item in outputs:
        params = _parameters(item.get("parameters"), f"output '{item['name']}'")
        if params.get("classification"):
            raise InputError(f"output '{item['name']}': the classification extension is not supported; request "
                             "the tensor and take its top-k")
        binary = params.get("binary_data")
        requested.append(RequestedOutput(item["name"], None if binary is None else bool(binary)))
    return tuple(requested)


def encode_response(response: InferResponse, request: InferRequest) -> tuple[bytes, int | None]:
    """The HTTP body and, when any output is binary, the JSON header's length (for the header of that name)."""
    choice = {o.name: o.binary for o in request.outputs}
    outputs, blobs = [], []
    for out in response.outputs:
        array = out.array
        entry = {"name": out.name, "datatype": out.datatype, "shape": list(array.shape)}
        binary = choice.get(out.name)
        if binary if binary is not None else request.binary_output:
            blob = encode_bytes_tensor(array) if out.datatype == "BYTES" else \
                np.ascontiguousarray(array, array.dtype.newbyteorder("<")).tobytes()
            entry["parameters"] = {"binary_data_size": len(blob)}
            blobs.append(blob)
        else:
            values = array.reshape(-1).tolist()
            entry["data"] = [v.decode(errors="replace") for v in values] if out.datatype == "BYTES" else values
        outputs.append(entry)
    header = {"model_name": response.model_name, "model_version": response.model_version}
    if response.id:
        header["id"] = response.id
    header["outputs"] = outputs
    text = json.dumps(header, separators=(",", ":")).encode()
    return (text + b"".join(blobs), len(text)) if blobs else (text, None)
