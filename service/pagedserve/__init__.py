"""pagedserve: a gRPC LLM inference sidecar with a paged KV cache (server package)."""
