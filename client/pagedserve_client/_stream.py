"""Iterators over a streaming gRPC call that cancel the call when closed, started or not."""
from __future__ import annotations

from typing import Any, Generic, TypeVar

import grpc.aio

T = TypeVar("T")


class ResponseStream(Generic[T]):
    """Sync iterator of a server-streaming call's messages.

    close() (or leaving a `with` block) cancels the call if it is still running; the server then sees the
    client cancel and aborts the request. Dropping the last reference cancels it too (grpc does so on GC).
    Iterating raises grpc.RpcError when the call fails.
    """

    def __init__(self, call: Any) -> None:
        self.call = call  # the grpc call object: code(), details(), initial_metadata() ...

    def __iter__(self) -> ResponseStream[T]:
        return self

    def __next__(self) -> T:
        return next(self.call)

    def close(self) -> None:
        """Cancel the call (no-op once it has finished)."""
        self.call.cancel()

    def __enter__(self) -> ResponseStream[T]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncResponseStream(Generic[T]):
    """Async iterator of a grpc.aio streaming call's messages; aclose() or `async with` cancels the call."""

    def __init__(self, call: Any) -> None:
        self.call = call  # the grpc.aio call object

    def __aiter__(self) -> AsyncResponseStream[T]:
        return self

    async def __anext__(self) -> T:
        message = await self.call.read()
        if message is grpc.aio.EOF:
            raise StopAsyncIteration
        return message

    async def aclose(self) -> None:
        """Cancel the call (no-op once it has finished)."""
        self.call.cancel()

    async def __aenter__(self) -> AsyncResponseStream[T]:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

