"""Server-level tests (a running gRPC / HTTP server, in-process or a subprocess, or the client against one); every
module is marked e2e."""
