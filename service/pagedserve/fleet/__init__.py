"""Several pagedserve replicas behind vLLM's router: ``pagedserve route`` (:mod:`.router`) starts vllm-router with
settings for a sidecar fleet; ``pagedserve fleet`` (:mod:`.local`) runs N replicas and the router on loopback."""
