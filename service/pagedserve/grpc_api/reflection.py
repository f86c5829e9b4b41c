"""gRPC server reflection under both service names clients ask for: ``grpc.reflection.v1.ServerReflection``
(grpcurl, buf curl and grpcui try it first) and ``grpc.reflection.v1alpha.ServerReflection``.

The ``grpcio-reflection`` package ships only v1alpha. The v1 protocol is the same messages with the same field
numbers under another package name, so one servicer (the package's asyncio v1alpha one, over the default
descriptor pool) answers both: the v1 method is registered with the v1alpha message codecs, which read and write
the same bytes. For ``describe grpc.reflection.v1.ServerReflection`` to resolve, a copy of the v1alpha file
descriptor renamed to package ``grpc.reflection.v1`` is added to the default pool.
"""
from __future__ import annotations

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import _async as reflection_aio
from grpc_reflection.v1alpha import reflection_pb2 as v1alpha_pb2

V1ALPHA_SERVICE_NAME = "grpc.reflection.v1alpha.ServerReflection"
V1_SERVICE_NAME = "grpc.reflection.v1.ServerReflection"
_V1_FILE = "grpc/reflection/v1/reflection.proto"
METHOD = "ServerReflectionInfo"


def _register_v1_descriptor(pool: descriptor_pool.DescriptorPool) -> None:
    """Add ``grpc/reflection/v1/reflection.proto`` to ``pool`` (once), derived from the v1alpha file."""
    try:
        pool.FindFileByName(_V1_FILE)
        return
    except KeyError:
        pass
    proto = descriptor_pb2.FileDescriptorProto()
    v1alpha_pb2.DESCRIPTOR.CopyToProto(proto)
    old, new = f".{proto.package}.", ".grpc.reflection.v1."
    proto.name, proto.package = _V1_FILE, "grpc.reflection.v1"
    proto.options.Clear()
    for message in proto.message_type:
        for field in message.field:
            if field.type_name.startswith(old):
                field.type_name = new + field.type_name[len(old):]
    for service in proto.service:
        for method in service.method:
            method.input_type = new + method.input_type[len(old):]
            method.output_type = new + method.output_type[len(old):]
    pool.Add(proto)


def enable_reflection(service_names: tuple[str, ...], server: grpc.aio.Server) -> None:
    """Serve reflection v1 and v1alpha on ``server``, listing ``service_names`` and both reflection services."""
    _register_v1_descriptor(descriptor_pool.Default())
    servicer = reflection_aio.ReflectionServicer((*service_names, V1_SERVICE_NAME, V1ALPHA_SERVICE_NAME))
    handler = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo, request_deserializer=v1alpha_pb2.ServerReflectionRequest.FromString,
        response_serializer=v1alpha_pb2.ServerReflectionResponse.SerializeToString)
    server.add_generic_rpc_handlers([
        grpc.method_handlers_generic_handler(name, {METHOD: handler})
        for name in (V1_SERVICE_NAME, V1ALPHA_SERVICE_NAME)])
