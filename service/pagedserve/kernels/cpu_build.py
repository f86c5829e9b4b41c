"""Building and loading pagedserve's CPU kernels (``csrc/``) as torch custom ops.

The C++ sources ship as package data: ``csrc/*.cpp`` (one file per concern: linears, decode attention, KV write,
elementwise layers, the torch op registrations) and the headers they share (``*.hpp``, ``*.h``; ``csrc/ops.h`` lists
them). On first use they are compiled with the system C++ compiler against the installed torch's headers and
libraries into one shared library, cached under ``<envs.kernel_cache_dir()>/cpu_kernels/``
(``~/.cache/pagedserve/cpu_kernels/`` unless ``$PAGEDSERVE_KERNEL_CACHE_DIR`` is set), then loaded with
``torch.ops.load_library``. The cache key (:func:`build_key`) hashes the name and text of every source file, headers
included, the flags, the compiler's path and the torch and Python versions, so editing any of them rebuilds; the
library is written to a temporary name and renamed, so concurrent builds are safe.

The ``.cpp`` files are compiled as one translation unit (a generated file that includes each in name order), since
every file parses torch's headers: measured back to back on this project's shared 2-core machine when the single
``cpu_kernels.cpp`` was split, a cold build took 11.3-12.8 s that way, 20-44 s as one object per file compiled two at
a time, and 10.5-11.0 s for the old single file. Each ``.cpp`` includes what it uses (each compiled on its own when
that was measured); since the unit is shared, the names in the files' anonymous namespaces must stay distinct.

The ops (``torch.ops.pagedserve_cpu.linear_f32 / linear_q4 / linear_q8 / linear_q4_a8 / linear_q8_a8 /
paged_attention / paged_decode_attention / reshape_and_cache / rms_norm / rotary_embedding / silu_and_mul / llama_decode_layers``,
formats at their definitions) get fake (meta) implementations so ``torch.compile`` traces through them as opaque
calls.

The kernels need an x86-64 CPU with AVX2 and FMA; :func:`cpu_kernel_ops` returns None, with the reason in
:func:`unavailable_reason`, when the CPU lacks them, no compiler is found (``$CXX``, ``c++``, ``g++``) or the build
fails; callers then keep torch's own kernels.
"""
from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Mapping
from importlib import resources
from pathlib import Path

import structlog
import torch

from .. import envs

log = structlog.get_logger(__name__)

SOURCE_SUFFIXES = (".cpp", ".hpp", ".h")
LIBRARY = "pagedserve_cpu_kernels"
UNITY_SOURCE = "cpu_kernels_unity.cxx"   # generated in the build folder, never shipped
CXX_FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-std=c++20", "-fopenmp", "-shared", "-fPIC", "-w")

_lock = threading.Lock()
_state: dict[str, object] = {}


def source_files() -> dict[str, str]:
    """Every C++ source the build compiles, ``{file name: text}`` in name order: the ``.cpp``, ``.hpp`` and ``.h``
    files of the package's ``csrc/`` folder.

    Raises:
        FileNotFoundError: the folder holds no ``.cpp`` (a package installed without its package data).
    """
    root = resources.files("pagedserve.kernels").joinpath("csrc")
    files = {p.name: p.read_text() for p in root.iterdir() if p.name.endswith(SOURCE_SUFFIXES)}
    if not any(name.endswith(".cpp") for name in files):
        raise FileNotFoundError(f"no C++ sources (*.cpp) in {root}: is the package installed with its package data?")
    return dict(sorted(files.items()))


def unity_source(sources: Mapping[str, str]) -> str:
    """The one translation unit that is compiled: an ``#include`` of each ``.cpp`` in ``sources``, in name order."""
    return "".join(f'#include "{name}"\n' for name in sorted(sources) if name.endswith(".cpp"))


def build_key(sources: Mapping[str, str], compiler: str, flags: tuple[str, ...] = CXX_FLAGS) -> str:
    """16 hex digits of a SHA-256 over every source's name and text (``{file name: text}``, any order), the compiler
    path, the flags and the torch and Python versions: the cached library's name, so a change to any source, header
    included, or to the toolchain builds a new one."""
    digest = hashlib.sha256()
    for part in (*(f"{name}\0{sources[name]}" for name in sorted(sources)), compiler, *flags, torch.__version__,
                 sys.version):
        digest.update(part.encode())
        digest.update(b"\0\0")
    return digest.hexdigest()[:16]


def _compiler() -> str | None:
    for name in (envs.cxx_compiler(), "c++", "g++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _command(cxx: str, src: Path, out: Path) -> list[str]:
    root = Path(torch.__file__).parent
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return [cxx, *CXX_FLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={abi}", f"-I{root / 'include'}",
            f"-I{root / 'include' / 'torch' / 'csrc' / 'api' / 'include'}", str(src),
            f"-L{root / 'lib'}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{root / 'lib'}", "-o", str(out)]


def _compile(cxx: str, sources: Mapping[str, str], target: Path) -> None:
    """Write ``sources`` and their unity file to a temporary folder beside ``target``, compile, rename into place."""
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        for name, text in sources.items():
            (Path(tmp) / name).write_text(text)
        unity = Path(tmp) / UNITY_SOURCE
        unity.write_text(unity_source(sources))
        out = Path(tmp) / target.name
        proc = subprocess.run(_command(cxx, unity, out), capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"building the CPU kernels ({', '.join(sources)}) failed:\n{proc.stderr[-4000:]}")
        os.replace(out, target)


def build(cache_dir: Path | None = None) -> Path:
    """Compile the library (or find it in ``cache_dir``, default ``<envs.kernel_cache_dir()>/cpu_kernels``) and return
    its path, ``<cache_dir>/pagedserve_cpu_kernels_<build_key>.so``.

    Raises:
        RuntimeError: no C++ compiler, or the compiler's error output when the build fails.
        FileNotFoundError: the C++ sources are missing (see :func:`source_files`).
    """
    cache_dir = envs.kernel_cache_dir() / "cpu_kernels" if cache_dir is None else cache_dir
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found ($CXX, c++ or g++)")
    sources = source_files()
    target = cache_dir / f"{LIBRARY}_{build_key(sources, cxx)}.so"
    if target.exists():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    log.info("cpu_kernels_building", sources=len(sources), compiler=cxx, target=str(target))  # ~12 s, once per key
    _compile(cxx, sources, target)
    return target


def _register_fakes() -> None:
    def fake(x, *args):
        weight = args[0]
        n = weight.shape[0]
        return x.new_empty((x.shape[0], n))

    for name in ("linear_f32", "linear_q4", "linear_q8", "linear_q4_a8", "linear_q8_a8", "linear_q4_amx"):
        torch.library.register_fake(f"pagedserve_cpu::{name}")(fake)
    for name in ("linear_q4_vnni", "linear_a8_packed"):
        torch.library.register_fake(f"pagedserve_cpu::{name}")(
            lambda x, packed, dw, mw, n, bias, levels: x.new_empty((x.shape[0], n)))
    torch.library.register_fake("pagedserve_cpu::linear_q8_vnni")(
        lambda x, packed, dw, n, bias, levels: x.new_empty((x.shape[0], n)))
    torch.library.register_fake("pagedserve_cpu::dequantize_q4")(
        lambda codes, scale, mn, group_size: scale.new_empty((codes.shape[0], codes.shape[1] * 2)))
    torch.library.register_fake("pagedserve_cpu::dequantize_q8")(
        lambda codes, scale, group_size: scale.new_empty(codes.shape))
    torch.library.register_fake("pagedserve_cpu::paged_decode_attention")(lambda q, *args: torch.empty_like(q))
    torch.library.register_fake("pagedserve_cpu::paged_attention")(lambda q, *args, **kw: torch.empty_like(q))
    torch.library.register_fake("pagedserve_cpu::rms_norm")(
        lambda x, weight, eps, residual: (x.new_empty(x.shape),
                                          x.new_empty(x.shape if residual is not None else (0, x.shape[1]))))
    torch.library.register_fake("pagedserve_cpu::rotary_embedding")(
        lambda positions, x, cos_sin, is_neox: x.new_empty(x.shape))
    torch.library.register_fake("pagedserve_cpu::silu_and_mul")(
        lambda x: x.new_empty((x.shape[0], x.shape[1] // 2)))
    torch.library.register_fake("pagedserve_cpu::reshape_and_cache")(lambda key, value, kc, vc, slots: None)
    torch.library.register_fake("pagedserve_cpu::llama_decode_layers")(
        lambda hidden, *args: hidden.new_empty(hidden.shape))


def _check_cpu() -> str | None:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"CPU architecture {platform.machine()} (the kernels need x86-64 with AVX2)"
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ("AVX2", "AVX512"):
        return f"CPU capability {capability} (the kernels need AVX2 and FMA)"
    return None


def cpu_kernel_ops():
    """``torch.ops.pagedserve_cpu`` once the library is built and loaded, or None (see :func:`unavailable_reason`).

    Thread-safe; builds at most once per process. Never raises.
    """
    if "ops" in _state:   # set once, never changed: no lock on the per-call path
        return _state["ops"]
    with _lock:
        if "ops" not in _state:
            reason = _check_cpu()
            if reason is None:
                try:
                    path = build()
                    torch.ops.load_library(str(path))
                    _register_fakes()
                    log.info("cpu_kernels_loaded", path=str(path))
                except Exception as e:  # noqa: BLE001 - any failure leaves torch's kernels in place
                    reason = f"{type(e).__name__}: {e}"
            if reason is not None:
                log.warning("cpu_kernels_unavailable", reason=reason)
            _state["reason"] = reason
            _state["ops"] = None if reason else torch.ops.pagedserve_cpu   # last: the lock-free read keys on it
        return _state["ops"]


def unavailable_reason() -> str | None:
    """Why :func:`cpu_kernel_ops` returned None (None when it has not been called or succeeded)."""
    return _state.get("reason")  # type: ignore[return-value]
