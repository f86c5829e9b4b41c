"""The proto changes compatibly: `buf breaking` (FILE rules, buf.yaml) against the proto at main's HEAD, and the
check itself catches a renumbered field."""
from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PROTO = "protos/pagedserve/v1/inference.proto"


def _buf() -> str:
    beside = pathlib.Path(sys.executable).parent / "buf"
    path = str(beside) if beside.exists() else shutil.which("buf")
    if path is None:
        pytest.fail("buf is not installed: `make setup` installs the dev extra (buf-bin)")
    return path


def _baseline(tmp_path: pathlib.Path) -> pathlib.Path:
    """A buf workspace holding the proto as main's HEAD has it (skip where the checkout has no main)."""
    for ref in ("main", "origin/main"):
        shown = subprocess.run(["git", "show", f"{ref}:{PROTO}"], cwd=ROOT, capture_output=True, text=True)
        if shown.returncode == 0:
            break
    else:
        pytest.skip("no main branch in this checkout to compare the proto with")
    target = tmp_path / "against"
    (target / PROTO).parent.mkdir(parents=True)
    (target / PROTO).write_text(shown.stdout)
    shutil.copy(ROOT / "buf.yaml", target / "buf.yaml")
    return target


def _breaking(against: pathlib.Path) -> subprocess.CompletedProcess:
    return subprocess.run([_buf(), "breaking", "--against", str(against)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


def test_proto_is_compatible_with_main(tmp_path):
    result = _breaking(_baseline(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr


def test_buf_breaking_catches_a_renumbered_field(tmp_path):
    against = tmp_path / "renumbered"
    (against / PROTO).parent.mkdir(parents=True)
    text = (ROOT / PROTO).read_text()
    assert "  string content = 2;" in text
    (against / PROTO).write_text(text.replace("  string content = 2;", "  string content = 99;", 1))
    shutil.copy(ROOT / "buf.yaml", against / "buf.yaml")
    result = _breaking(against)
    assert result.returncode != 0 and "content" in result.stdout + result.stderr
