"""The gRPC message classes of `grpc_predict_v2.proto`, built from its compiled descriptor in a private
descriptor pool: tritonclient and kserve register their own `inference.*` messages in protobuf's default pool,
and a second registration there would fail in any process that imports one of them too."""
from __future__ import annotations

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from kiln.serve.proto.descriptor import FILE_DESCRIPTOR

SERVICE_NAME = "inference.GRPCInferenceService"

_FILE = descriptor_pb2.FileDescriptorProto.FromString(FILE_DESCRIPTOR)
_POOL = descriptor_pool.DescriptorPool()
_POOL.Add(_FILE)
_CLASSES = message_factory.GetMessages([_FILE], pool=_POOL)


def message(name: str):
    """The message class `inference.<name>` (e.g. "ModelInferRequest")."""
    return _CLASSES[f"inference.{name}"]


def methods() -> dict[str, tuple[type, type]]:
    """The service's RPCs: method name -> (request class, response class)."""
    service = _POOL.FindServiceByName(SERVICE_NAME)
    return {m.name: (_CLASSES[m.input_type.full_name], _CLASSES[m.output_type.full_name]) for m in service.methods}


ModelInferRequest = message("ModelInferRequest")
ModelInferResponse = message("ModelInferResponse")
InferTensorContents = message("InferTensorContents")
