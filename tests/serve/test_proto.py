"""The committed gRPC descriptor is the .proto compiled, and its messages are wire-compatible with Triton's
(tritonclient's grpc_service.proto): same package, service, method names, field names, numbers and types."""
from __future__ import annotations

import pytest

from kiln.serve.proto import messages


def test_descriptor_is_up_to_date_with_the_proto():
    pytest.importorskip("grpc_tools")
    from kiln.serve.proto.descriptor import FILE_DESCRIPTOR
    from kiln.serve.proto.generate import compile_descriptor

    assert compile_descriptor() == FILE_DESCRIPTOR, "run `make proto` after editing grpc_predict_v2.proto"


def fields(descriptor, prefix: str = "") -> dict[str, list[tuple]]:
    out = {prefix + descriptor.name: sorted((f.name, f.number, f.type, f.is_repeated,
                                             f.message_type.full_name if f.message_type else "")
                                            for f in descriptor.fields)}
    for nested in descriptor.nested_types:
        out.update(fields(nested, prefix + descriptor.name + "."))
    return out


def test_messages_match_tritons():
    triton = pytest.importorskip("tritonclient.grpc.service_pb2")
    ours_file = messages._POOL.FindFileByName("grpc_predict_v2.proto")
    for name, ours in ours_file.message_types_by_name.items():
        assert fields(ours) == fields(triton.DESCRIPTOR.message_types_by_name[name]), name
    service = triton.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    assert service.full_name == messages.SERVICE_NAME
    for method, (request, response) in messages.methods().items():
        theirs = service.methods_by_name[method]
        assert (theirs.input_type.full_name, theirs.output_type.full_name) == \
            (request.DESCRIPTOR.full_name, response.DESCRIPTOR.full_name)
