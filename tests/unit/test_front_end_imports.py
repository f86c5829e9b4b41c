"""The two front ends are siblings over :mod:`pagedserve.serving`: ``http/`` and ``grpc_api/`` import nothing of
each other, and only the process (``entrypoints/``) and the CLI above it reach both (checked from the source, as
:mod:`.test_architecture` does)."""
from __future__ import annotations

from .test_architecture import package_graph

FRONT_ENDS = {"http", "grpc_api"}


def test_the_front_ends_import_nothing_of_each_other():
    graph = package_graph()
    for front in FRONT_ENDS:
        assert not graph[front] & (FRONT_ENDS - {front}), f"{front} imports {sorted(graph[front] & FRONT_ENDS)}"


def test_only_the_process_reaches_both_front_ends():
    graph = package_graph()
    importers = {pkg for pkg, deps in graph.items() if FRONT_ENDS <= deps}
    assert importers <= {"entrypoints"}, f"{sorted(importers)} import both front ends"
    assert not {"entrypoints", "cli"} & graph["serving"], "serving/ imports the process"
