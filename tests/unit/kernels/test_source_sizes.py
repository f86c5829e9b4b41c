"""The kernel sources stay readable and the CPU build hashes what it compiles.

- every file under service/pagedserve/kernels/csrc/ and cuda/ is at most 400 lines (issue 31);
- kernels/cpu_build.py's cache key (:func:`build_key`) covers every C++ source the build compiles: each file's text
  and name, headers included, so an edited header rebuilds the library instead of loading a stale one; every local
  ``#include`` resolves to a hashed file, and the translation unit that is compiled includes every ``.cpp``.
No compiler is run here (tests/test_cpu_linear.py and its neighbours build and exercise the library).
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from pagedserve.kernels import cpu_build

ROOT = Path(__file__).resolve().parents[3]
SOURCE_DIRS = (ROOT / "service" / "pagedserve" / "kernels" / "csrc", ROOT / "cuda")
MAX_LINES = 400
LOCAL_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


def _source_paths() -> list[Path]:
    return sorted(p for d in SOURCE_DIRS for p in d.iterdir() if p.is_file())


def test_every_kernel_source_is_at_most_400_lines():
    paths = _source_paths()
    assert {p.parent for p in paths} == set(SOURCE_DIRS), "a source folder is empty or missing"
    long = {str(p.relative_to(ROOT)): n for p in paths if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"over {MAX_LINES} lines (split by concern, shared helpers in a header): {long}"


def test_build_hashes_every_file_of_the_csrc_folder():
    sources = cpu_build.source_files()
    on_disk = {p.name for p in SOURCE_DIRS[0].iterdir() if p.is_file()}
    assert set(sources) == on_disk, "a csrc file the build would not hash (add its suffix to SOURCE_SUFFIXES)"
    assert {"ops.h", "cpu_types.hpp", "torch_bindings.cpp"} <= set(sources)
    for name, text in sources.items():
        for included in LOCAL_INCLUDE.findall(text):
            assert included in sources, f'{name} includes "{included}", which the build key does not cover'


def test_the_compiled_unit_includes_each_cpp_once_and_no_header():
    sources = cpu_build.source_files()
    included = LOCAL_INCLUDE.findall(cpu_build.unity_source(sources))
    assert included == sorted(n for n in sources if n.endswith(".cpp"))
    assert len(included) >= 6   # linears (2), attention, cache, elementwise, bindings


@pytest.mark.parametrize("name", ["cpu_types.hpp", "ops.h", "linear.hpp", "attention.cpp"])
def test_build_key_changes_when_one_source_changes(name):
    sources = cpu_build.source_files()
    key = cpu_build.build_key(sources, "/usr/bin/c++")
    assert key == cpu_build.build_key(dict(reversed(sources.items())), "/usr/bin/c++")   # order of the mapping
    edited = {**sources, name: sources[name].replace("\n", "\n// edited\n", 1)}
    assert edited[name] != sources[name]
    assert cpu_build.build_key(edited, "/usr/bin/c++") != key


def test_build_key_covers_names_compiler_and_flags():
    sources = cpu_build.source_files()
    key = cpu_build.build_key(sources, "/usr/bin/c++")
    renamed = {("renamed_" + n if n == "cache.cpp" else n): t for n, t in sources.items()}
    assert cpu_build.build_key(renamed, "/usr/bin/c++") != key
    extra = {**sources, "extra.hpp": "#pragma once\n"}
    assert cpu_build.build_key(extra, "/usr/bin/c++") != key
    assert cpu_build.build_key(sources, "/usr/bin/g++-13") != key
    assert cpu_build.build_key(sources, "/usr/bin/c++", (*cpu_build.CXX_FLAGS, "-DX")) != key
    assert re.fullmatch(r"[0-9a-f]{16}", key)
