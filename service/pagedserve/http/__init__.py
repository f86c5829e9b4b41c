"""The OpenAI-compatible HTTP API: an ASGI app (FastAPI) over :mod:`pagedserve.serving`, served by uvicorn inside
the server's own asyncio loop, beside gRPC."""
