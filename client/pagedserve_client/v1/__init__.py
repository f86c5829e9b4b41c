"""Generated gRPC stubs for pagedserve.v1 (scripts/gen_protos.py). Do not edit."""
