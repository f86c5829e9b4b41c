"""The distribution as a user gets it: a wheel built from the sources (offline: --no-build-isolation with the dev
extra's setuptools and wheel) holds every package, the kernels' CUDA sources and the CPU kernels' C++ sources (csrc/,
headers included), and the package installed from it non-editably finds and NVRTC-compiles the decode kernel with no
access to this repository's service/ or cuda/."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from support import REPO_ROOT

ROOT = REPO_ROOT
BUILD_INPUTS = ("pyproject.toml", "README.md", "service", "client", "cuda")


def _need_build_tools() -> None:
    try:
        import setuptools
        import wheel  # noqa: F401
    except ImportError as exc:
        pytest.fail(f"{exc.name} is not installed: `make setup` installs the dev extra")
    if int(setuptools.__version__.split(".")[0]) < 77:
        pytest.fail(f"setuptools {setuptools.__version__} < 77 (the PEP 639 license string): `make setup`")


def _pip(*args: str, cwd: Path) -> str:
    """Run pip; returns its output (stdout + stderr)."""
    proc = subprocess.run([sys.executable, "-m", "pip", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def wheel_build(tmp_path_factory) -> tuple[Path, str]:
    """A wheel built from a copy of the build inputs (the build leaves build/ and *.egg-info in its source), and
    the build's verbose output."""
    _need_build_tools()
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    for name in BUILD_INPUTS:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name,
                            ignore=shutil.ignore_patterns("__pycache__", "*.egg-info", "*.pyc"))
        else:
            src.mkdir(exist_ok=True)
            shutil.copy2(ROOT / name, src / name)
    log = _pip("wheel", "--no-deps", "--no-build-isolation", "--no-index", "-v", "-w", str(tmp / "dist"), str(src),
               cwd=tmp)
    (wheel,) = (tmp / "dist").glob("pagedserve-*.whl")
    return wheel, log


@pytest.fixture(scope="module")
def wheel_path(wheel_build) -> Path:
    return wheel_build[0]


def test_build_ships_no_data_directory_outside_the_packages_list(wheel_build):
    # setuptools warns (a banner at every setup) about a directory of package data that is not a listed package
    assert "absent from the `packages` configuration" not in wheel_build[1], wheel_build[1][-3000:]


def test_wheel_holds_every_package_and_the_cuda_sources(wheel_path):
    names = set(zipfile.ZipFile(wheel_path).namelist())
    for base in ("service", "client"):
        for init in (ROOT / base).rglob("__init__.py"):
            rel = init.relative_to(ROOT / base).as_posix()
            assert rel in names, f"{rel} is not in the wheel: list its package in pyproject.toml [tool.setuptools]"
    sources = sorted(p.name for p in (ROOT / "cuda").iterdir() if p.suffix in (".cu", ".cuh"))
    assert sources and all(f"pagedserve/kernels/cuda/{s}" in names for s in sources)
    assert not any(n.startswith("cuda/") for n in names)  # never a top-level `cuda` (NVIDIA's namespace)
    csrc = ROOT / "service" / "pagedserve" / "kernels" / "csrc"
    missing = sorted(p.name for p in csrc.iterdir() if f"pagedserve/kernels/csrc/{p.name}" not in names)
    assert not missing, f"CPU kernel sources missing from the wheel (pyproject.toml package-data): {missing}"


PROBE = r"""
import json, sys
target = sys.argv[1]
blocked = {sys.argv[2] + "/service", sys.argv[2] + "/client", sys.argv[2], ""}
sys.path[:] = [target] + [p for p in sys.path if p.rstrip("/") not in blocked]
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f).lower()]  # a dev venv's editable hook
from pagedserve import kernels
from pagedserve.kernels import ModuleKey, compile_to_cubin
report = {"module": kernels.__file__, "source_dir": str(kernels.find_source_dir()),
          "loaded": "paged_decode_kernel" in kernels.load_source("decode_attention.cu"),
          "nvrtc": kernels.nvrtc_available()}
if report["nvrtc"]:
    key = ModuleKey("decode", "float16", 128, 16, "sm_80")
    result = compile_to_cubin(key)
    report["cubin_bytes"] = len(result.cubin)
    report["compiled"] = sorted(result.lowered_names)
    report["expected"] = sorted(key.name_expressions())
print(json.dumps(report))
"""


def test_installed_package_finds_and_compiles_the_decode_kernel(wheel_path, tmp_path):
    target = tmp_path / "site"
    _pip("install", "--no-deps", "--no-index", "-q", "--target", str(target), str(wheel_path), cwd=tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    proc = subprocess.run([sys.executable, "-I", "-c", PROBE, str(target), str(ROOT)], cwd=elsewhere,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout.splitlines()[-1])
    assert Path(report["module"]).is_relative_to(target), report
    assert Path(report["source_dir"]) == target / "pagedserve" / "kernels" / "cuda", report
    assert report["loaded"]
    if not report["nvrtc"]:
        pytest.skip("found the installed sources; NVRTC (nvidia-cuda-nvrtc) or the CUDA headers are not installed")
    assert report["cubin_bytes"] > 0 and report["compiled"] == report["expected"]


def test_test_modules_shadow_no_installed_package():
    """pytest puts tests/ on sys.path (pyproject ``pythonpath``), and the bench tests put bench/ there, so a
    top-level module there named like an installed distribution's module hides it: transformers 5.25 imports the
    ``kernels`` package, and ``tests/kernels/`` (then ``bench/kernels.py``) made every model load fail. No name
    in tests/ or bench/ may be one an installed package provides."""
    import importlib.metadata

    root = Path(__file__).resolve().parents[2]
    ours = set()
    for folder in (root / "tests", root / "bench"):
        ours |= {p.name for p in folder.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
        ours |= {p.stem for p in folder.glob("*.py") if p.stem != "conftest"}
    installed = set()
    for dist in importlib.metadata.distributions():
        top = dist.read_text("top_level.txt")
        if top:
            installed |= set(top.split())
        else:  # wheels without top_level.txt: the first part of each installed path
            installed |= {f.parts[0].removesuffix(".py") for f in dist.files or () if not f.parts[0].endswith(
                (".dist-info", ".data", ".pth")) and f.parts[0] != ".."}
    assert not ours & installed, f"tests/ names that shadow installed packages: {sorted(ours & installed)}"
