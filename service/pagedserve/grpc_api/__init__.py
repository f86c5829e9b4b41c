"""The gRPC front end (grpc.aio): the InferenceService servicer (proto <-> plain types only), its interceptors
(errors to status codes, API keys, call tracking), reflection, and the server that holds them with health."""
