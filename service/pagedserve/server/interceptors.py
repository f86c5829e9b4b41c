"""One interceptor that maps engine exceptions to gRPC status codes, for unary and streaming handlers alike,
and binds the call's method to the structlog context."""
from __future__ import annotations

import grpc
import structlog

from .. import errors

log = structlog.get_logger(__name__)

STATUS_OF: list[tuple[type[BaseException], grpc.StatusCode]] = [
    (errors.InvalidInputError, grpc.StatusCode.INVALID_ARGUMENT),
    (errors.DuplicateRequestError, grpc.StatusCode.ALREADY_EXISTS),
    (errors.QueueFullError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (errors.EngineUnavailableError, grpc.StatusCode.UNAVAILABLE),
    (errors.ModelNotLoadedError, grpc.StatusCode.FAILED_PRECONDITION),
    (errors.UnimplementedFieldError, grpc.StatusCode.UNIMPLEMENTED),
]


def status_for(exc: BaseException) -> grpc.StatusCode:
    for cls, code in STATUS_OF:
        if isinstance(exc, cls):
            return code
    return grpc.StatusCode.INTERNAL


async def _abort_with(context: grpc.aio.ServicerContext, exc: Exception, method: str) -> None:
    code = status_for(exc)
    if code == grpc.StatusCode.INTERNAL:
        log.exception("internal_error", method=method)
        await context.abort(code, f"internal error: {type(exc).__name__}: {exc}")
    log.info("request_rejected", method=method, code=code.name, error=str(exc))
    await context.abort(code, str(exc))


class ErrorMappingInterceptor(grpc.aio.ServerInterceptor):
    """Wraps every handler: :mod:`pagedserve.errors` exceptions become their status codes, anything else INTERNAL
    (logged with its traceback). Errors raised by ``context.abort`` pass through untouched."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(self._wrap_unary(handler.unary_unary, method),
                                                       handler.request_deserializer, handler.response_serializer)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(self._wrap_stream(handler.unary_stream, method),
                                                        handler.request_deserializer, handler.response_serializer)
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(self._wrap_unary(handler.stream_unary, method),
                                                        handler.request_deserializer, handler.response_serializer)
        return grpc.stream_stream_rpc_method_handler(self._wrap_stream(handler.stream_stream, method),
                                                     handler.request_deserializer, handler.response_serializer)

    @staticmethod
    def _wrap_unary(fn, method):
        async def wrapper(request, context):
            try:
                return await fn(request, context)
            except grpc.aio.AbortError:
                raise
            except Exception as exc:
                await _abort_with(context, exc, method)
        return wrapper

    @staticmethod
    def _wrap_stream(fn, method):
        async def wrapper(request, context):
            try:
                async for item in fn(request, context):
                    yield item
            except grpc.aio.AbortError:
                raise
            except Exception as exc:
                await _abort_with(context, exc, method)
        return wrapper
