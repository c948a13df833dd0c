"""gRPC server reflection under both of its service names.

`grpc.reflection.v1.ServerReflection` is what current clients (grpcurl, grpc_cli,
Postman) ask for first; `grpc.reflection.v1alpha.ServerReflection` is the older
name some still use. grpcio-reflection 1.85 serves only v1alpha. The v1 protocol
is the same messages with the same fields and numbers in another proto package,
so one servicer answers both names: v1 calls decode and encode with the v1alpha
message classes (identical bytes). The v1 file descriptor (v1alpha's, renamed)
is added to the default pool, so a client can also describe the v1 service.
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc
import grpc.aio
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

V1ALPHA_SERVICE: str = reflection.SERVICE_NAME
V1_SERVICE = "grpc.reflection.v1.ServerReflection"
_V1ALPHA_PACKAGE = "grpc.reflection.v1alpha"
_V1_PACKAGE = "grpc.reflection.v1"
_V1_FILE = "grpc/reflection/v1/reflection.proto"  # where grpc's own repository has it


def enable_reflection(service_names: Sequence[str], server: grpc.aio.Server) -> None:
    """Serve reflection on `server` (v1 and v1alpha) listing `service_names` and itself."""
    _register_v1_descriptor()
    names = [*service_names, V1_SERVICE, V1ALPHA_SERVICE]
    servicer = reflection.aio.ReflectionServicer(names)
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    v1 = grpc.method_handlers_generic_handler(
        V1_SERVICE,
        {
            "ServerReflectionInfo": grpc.stream_stream_rpc_method_handler(
                servicer.ServerReflectionInfo,
                request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
                response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
            )
        },
    )
    server.add_generic_rpc_handlers((v1,))


def _register_v1_descriptor() -> None:
    pool = descriptor_pool.Default()
    try:
        pool.FindFileByName(_V1_FILE)
        return  # another server in this process registered it
    except KeyError:
        pass
    v1 = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(v1)
    v1.name, v1.package = _V1_FILE, _V1_PACKAGE
    v1.ClearField("options")  # v1alpha's deprecation mark and language package names
    prefix = f".{_V1ALPHA_PACKAGE}."
    for message in v1.message_type:
        for message_field in message.field:
            if message_field.type_name.startswith(prefix):
                message_field.type_name = (
                    f".{_V1_PACKAGE}." + message_field.type_name[len(prefix) :]
                )
    for service in v1.service:
        for method in service.method:
            method.input_type = method.input_type.replace(prefix, f".{_V1_PACKAGE}.")
            method.output_type = method.output_type.replace(prefix, f".{_V1_PACKAGE}.")
    pool.AddSerializedFile(v1.SerializeToString())
