"""The kernel sources stay readable and the CPU build hashes what it compiles.

- every C++/CUDA source in the repository is at most 400 lines (issue 31): every file under
  service/pagedserve/kernels/csrc/ and cuda/, the host emulator's headers (tests/simt), and any
  .hpp/.h/.cu/.cuh/.cpp/... anywhere else except virtualenvs, .git and build outputs;
- tests/simt's cache key (:func:`simt.build_key`) covers every emulator header, so an edited header rebuilds the
  kernel libraries, and every local ``#include`` of the emulator resolves to a hashed header;
- kernels/cpu_build.py's cache key (:func:`build_key`) covers every C++ source the build compiles: each file's text
  and name, headers included, so an edited header rebuilds the library instead of loading a stale one; every local
  ``#include`` resolves to a hashed file, and the translation unit that is compiled includes every ``.cpp``.
No compiler is run here (tests/test_cpu_linear.py and its neighbours build and exercise the library).
"""
from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import simt

from pagedserve.kernels import cpu_build

ROOT = Path(__file__).resolve().parents[3]
SOURCE_DIRS = (ROOT / "service" / "pagedserve" / "kernels" / "csrc", ROOT / "cuda")
SIMT_DIR = ROOT / "tests" / "simt"
MAX_LINES = 400
LOCAL_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)
NATIVE_SUFFIXES = {".hpp", ".h", ".hh", ".hxx", ".cu", ".cuh", ".cpp", ".cc", ".cxx", ".c", ".inl"}
# Folders that are not the project's source: VCS data, virtualenvs (also any folder with a pyvenv.cfg), build and
# test outputs (.gitignore's list).
SKIP_DIRS = {".git", "build", "dist", "out", "__pycache__", "node_modules", ".pytest_cache", ".hypothesis", ".whl",
             ".mypy_cache", ".ruff_cache", ".tox", ".eggs"}


def native_sources(root: Path) -> list[Path]:
    """Every C++/CUDA file (by suffix) under ``root``, skipping SKIP_DIRS, ``.venv*``, ``*.egg-info`` and
    virtualenvs."""
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not d.startswith(".venv") and not d.endswith(".egg-info")
                   and not (Path(folder) / d / "pyvenv.cfg").is_file()]
        found += [Path(folder) / f for f in files if Path(f).suffix in NATIVE_SUFFIXES]
    return sorted(found)


def over_limit(paths: list[Path], root: Path) -> dict[str, int]:
    """The files of ``paths`` longer than MAX_LINES: {path relative to root: line count}."""
    counts = {str(p.relative_to(root)): len(p.read_text().splitlines()) for p in paths}
    return {name: n for name, n in counts.items() if n > MAX_LINES}


def test_every_native_source_in_the_repo_is_at_most_400_lines():
    paths = native_sources(ROOT)
    for folder in (*SOURCE_DIRS, SIMT_DIR):   # the walk reaches every folder that holds C++/CUDA today
        assert any(p.parent == folder for p in paths), f"no source found under {folder}"
    assert set(SOURCE_DIRS[0].iterdir()) | set(SOURCE_DIRS[1].iterdir()) <= set(paths), "a kernel file is missed"
    paths += [SIMT_DIR / name for name in simt.emulator_headers()]   # include/nv/target has no suffix
    long = over_limit(sorted(set(paths)), ROOT)
    assert not long, f"over {MAX_LINES} lines (split by concern, shared helpers in a header): {long}"


def test_the_size_check_walks_sources_and_skips_venvs_git_and_build_outputs(tmp_path):
    long_text = "int x;\n" * (MAX_LINES + 1)
    for rel in ("src/a.cu", "tests/emu/b.hpp", "deep/er/c.h", "d.cpp", ".venv/e.cpp", ".venv-llamacpp/f.h",
                ".git/g.cpp", "build/h.cpp", "pkg.egg-info/i.h", "env/lib/j.cpp", "src/k.py", "src/l.txt"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(long_text)
    (tmp_path / "env" / "pyvenv.cfg").write_text("home = /usr\n")
    (tmp_path / "d.cpp").write_text("int x;\n" * MAX_LINES)   # exactly at the limit: allowed
    found = native_sources(tmp_path)
    names = [p.relative_to(tmp_path).as_posix() for p in found]
    assert names == ["d.cpp", "deep/er/c.h", "src/a.cu", "tests/emu/b.hpp"]
    assert over_limit(found, tmp_path) == {"deep/er/c.h": 401, "src/a.cu": 401, "tests/emu/b.hpp": 401}


def test_the_emulator_key_covers_every_header_it_can_include():
    headers = simt.emulator_headers()
    on_disk = {p.relative_to(SIMT_DIR).as_posix() for p in SIMT_DIR.rglob("*")
               if p.is_file() and "__pycache__" not in p.parts and p.name not in {"__init__.py", "probes.cu"}}
    assert set(headers) == on_disk, "a file of tests/simt the cache key does not hash"
    assert {"simt_host.hpp", "include/crt/host_defines.h", "include/nv/target"} <= set(headers)
    reached, todo = set(), [simt.translation_unit("", ())]
    while todo:
        for name in LOCAL_INCLUDE.findall(todo.pop()):
            assert name in headers, f'"{name}" is included but not hashed into the cache key'
            if name not in reached:
                reached.add(name)
                todo.append(headers[name])
    parts = {n for n in headers if n.endswith(".hpp")}
    assert len(parts) >= 5 and reached == parts, "an emulator header simt_host.hpp does not reach (dead code?)"


@pytest.mark.parametrize("name", sorted(simt.emulator_headers()))
def test_the_emulator_key_changes_when_one_header_changes(name):
    headers, unit, includes = simt.emulator_headers(), simt.translation_unit("", ()), ["/inc"]
    key = simt.build_key(unit, "/usr/bin/g++", includes, headers)
    assert re.fullmatch(r"[0-9a-f]{24}", key)
    assert key == simt.build_key(unit, "/usr/bin/g++", includes, dict(reversed(headers.items())))
    edited = {**headers, name: headers[name] + "// edited\n"}
    assert simt.build_key(unit, "/usr/bin/g++", includes, edited) != key
    renamed = {("x" + n if n == name else n): t for n, t in headers.items()}
    assert simt.build_key(unit, "/usr/bin/g++", includes, renamed) != key


def test_the_emulator_key_covers_unit_compiler_flags_and_include_dirs():
    headers, unit = simt.emulator_headers(), simt.translation_unit("", ())
    key = simt.build_key(unit, "/usr/bin/g++", ["/inc"], headers)
    assert simt.build_key(unit + "\n", "/usr/bin/g++", ["/inc"], headers) != key
    assert simt.build_key(unit, "/usr/bin/g++-13", ["/inc"], headers) != key
    assert simt.build_key(unit, "/usr/bin/g++", ["/inc2"], headers) != key
    assert simt.build_key(unit, "/usr/bin/g++", ["/inc"], headers, (*simt.CXX_FLAGS, "-DX")) != key


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
