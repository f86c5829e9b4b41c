"""Where the CUDA sources are, and reading one as a whole translation unit.

The ``.cu``/``.cuh`` files live in ``cuda/`` at the repository root (not a Python package: a ``cuda/__init__.py``
would shadow NVIDIA's ``cuda`` namespace package). The build ships them as package data of this package:
pyproject.toml maps ``cuda/`` to ``pagedserve/kernels/cuda/``, so a wheel or a non-editable install finds them
beside this file. A source tree (``PYTHONPATH=service``) or an editable install reads the repository's ``cuda/``.
"""
from __future__ import annotations

import re
from pathlib import Path

_INCLUDE_RE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$')
_MARKER = "common.cuh"  # every source folder holds it


def source_dir_candidates() -> tuple[Path, ...]:
    """Folders searched in order: the installed package data, then the repository's ``cuda/`` (this file is
    service/pagedserve/kernels/sources.py in a source tree)."""
    here = Path(__file__).resolve().parent
    return here / "cuda", here.parents[2] / "cuda"


def find_source_dir() -> Path:
    """The folder holding the CUDA sources. Raises FileNotFoundError naming the folders searched."""
    for candidate in source_dir_candidates():
        if (candidate / _MARKER).is_file():
            return candidate
    searched = ", ".join(str(c) for c in source_dir_candidates())
    raise FileNotFoundError(f"CUDA sources ({_MARKER}, ...) not found in {searched}: is the package installed "
                            "from a wheel built with its package data?")


def load_source(filename: str, source_dir: Path | str | None = None) -> str:
    """Read ``filename`` with its local includes inlined (each at most once), from :func:`find_source_dir` or from
    ``source_dir`` (a folder of edited copies, for tests)."""
    root = Path(source_dir) if source_dir is not None else find_source_dir()
    if not (root / filename).is_file():
        raise FileNotFoundError(f"CUDA source {filename} not found in {root}")
    seen: set[str] = set()

    def expand(name: str) -> str:
        lines = [f'#line 1 "{name}"']
        for number, line in enumerate((root / name).read_text().splitlines(), start=1):
            match = _INCLUDE_RE.match(line)
            if match and (root / match.group(1)).is_file():
                if match.group(1) not in seen:
                    seen.add(match.group(1))
                    lines.append(expand(match.group(1)))
                    lines.append(f'#line {number + 1} "{name}"')
                continue
            lines.append("" if line.strip() == "#pragma once" else line)
        return "\n".join(lines)

    return expand(filename) + "\n"
