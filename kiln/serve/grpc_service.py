"""`inference.GRPCInferenceService` on grpcio's asyncio server: ServerLive, ServerReady, ModelReady,
ServerMetadata, ModelMetadata and ModelInfer (`raw_input_contents` or typed `contents`), sharing the HTTP
app's repository and batchers. Errors map to NOT_FOUND, INVALID_ARGUMENT and INTERNAL."""
from __future__ import annotations

import numpy as np

from kiln.errors import Error, InputError
from kiln.serve.codec import array_from_bytes
from kiln.serve.datatypes import numpy_dtype
from kiln.serve.protocol import InferInput, InferRequest, InferResponse, ModelNotFoundError, RequestedOutput
from kiln.serve.proto import messages
from kiln.serve.repository import ModelRepository

# typed `contents` field per datatype (FP16 has none: it travels as raw bytes)
CONTENTS_FIELD = {"BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents",
                  "INT32": "int_contents", "INT64": "int64_contents", "UINT8": "uint_contents",
                  "UINT16": "uint_contents", "UINT32": "uint_contents", "UINT64": "uint64_contents",
                  "FP32": "fp32_contents", "FP64": "fp64_contents", "BYTES": "bytes_contents"}


def add_service(server, repository: ModelRepository, server_version: str) -> None:
    """Register the service's handlers on a `grpc.aio.Server`."""
    import grpc

    servicer = InferenceServicer(repository, server_version)
    handlers = {name: grpc.unary_unary_rpc_method_handler(getattr(servicer, name),
                                                          request_deserializer=request_class.FromString,
                                                          response_serializer=response_class.SerializeToString)
                for name, (request_class, response_class) in messages.methods().items()}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(messages.SERVICE_NAME, handlers),))


class InferenceServicer:
    def __init__(self, repository: ModelRepository, server_version: str):
        self.repository, self.server_version = repository, server_version

    async def ServerLive(self, request, context):
        return messages.message("ServerLiveResponse")(live=True)

    async def ServerReady(self, request, context):
        return messages.message("ServerReadyResponse")(ready=self.repository.ready)

    async def ModelReady(self, request, context):
        try:
            ready = self.repository.get(request.name, request.version).ready
        except ModelNotFoundError:
            ready = False
        return messages.message("ModelReadyResponse")(ready=ready)

    async def ServerMetadata(self, request, context):
        from kiln.serve.http_app import EXTENSIONS, SERVER_NAME

        return messages.message("ServerMetadataResponse")(name=SERVER_NAME, version=self.server_version,
                                                          extensions=EXTENSIONS)

    async def ModelMetadata(self, request, context):
        model = await _or_abort(context, lambda: self.repository.get(request.name, request.version))
        return messages.message("ModelMetadataResponse")(**model.metadata())

    async def ModelInfer(self, request, context):
        model = await _or_abort(context, lambda: self.repository.get(request.model_name, request.model_version))
        try:
            infer_request = decode_infer_request(request, model.name, model.version)
            return encode_infer_response(await model.infer(infer_request))
        except Error as exc:
            await _abort(context, exc)


async def _or_abort(context, get):
    try:
        return get()
    except Error as exc:
        await _abort(context, exc)


async def _abort(context, exc: Error):
    import grpc

    code = grpc.StatusCode.NOT_FOUND if isinstance(exc, ModelNotFoundError) else \
        grpc.StatusCode.INVALID_ARGUMENT if isinstance(exc, InputError) else grpc.StatusCode.INTERNAL
    await context.abort(code, str(exc))


def decode_infer_request(request, model_name: str, model_version: str) -> InferRequest:
    raw = list(request.raw_input_contents)
    if raw and len(raw) != len(request.inputs):
        raise InputError(f"raw_input_contents holds {len(raw)} tensor(s) for {len(request.inputs)} input(s); "
                         "give every input's bytes there, or none")
    inputs = []
    for index, item in enumerate(request.inputs):
        where, shape = f"input '{item.name}'", [int(d) for d in item.shape]
        if any(d < 0 for d in shape):
            raise InputError(f"{where}: shape {shape} has a negative dimension")
        dtype = numpy_dtype(item.datatype, where)
        if raw:
            array = array_from_bytes(raw[index], dtype, shape, where)
        else:
            array = _from_contents(item, dtype, shape, where)
        inputs.append(InferInput(item.name, item.datatype, tuple(shape), array))
    outputs = []
    for item in request.outputs:
        if "classification" in item.parameters:
            raise InputError(f"output '{item.name}': the classification extension is not supported")
        outputs.append(RequestedOutput(item.name))
    return InferRequest(model_name, model_version, tuple(inputs), tuple(outputs), request.id)


def _from_contents(item, dtype: np.dtype, shape: list[int], where: str) -> np.ndarray:
    field = CONTENTS_FIELD.get(item.datatype)
    if field is None:
        raise InputError(f"{where}: {item.datatype} values must be sent in raw_input_contents")
    values = list(getattr(item.contents, field))
    count = int(np.prod(shape, dtype=np.int64))
    if len(values) != count:
        raise InputError(f"{where}: contents.{field} has {len(values)} value(s) but shape {shape} needs {count}")
    try:
        return np.array(values, dtype=dtype).reshape(shape)
    except OverflowError as exc:
        raise InputError(f"{where}: contents.{field} values do not fit {item.datatype} ({exc})") from None


def encode_infer_response(response: InferResponse):
    from kiln.serve.datatypes import encode_bytes_tensor

    message = messages.ModelInferResponse(model_name=response.model_name, model_version=response.model_version,
                                          id=response.id)
    for out in response.outputs:
        message.outputs.add(name=out.name, datatype=out.datatype, shape=list(out.array.shape))
        array = out.array
        message.raw_output_contents.append(encode_bytes_tensor(array) if out.datatype == "BYTES" else
                                           np.ascontiguousarray(array, array.dtype.newbyteorder("<")).tobytes())
    return message
