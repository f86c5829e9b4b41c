"""Tests of pagedserve.models: layers (tensor-parallel shards against the unsplit layer)."""
