"""Unit tests of the benchmark scripts' pure parts (bench/*.py): no server, no model."""
