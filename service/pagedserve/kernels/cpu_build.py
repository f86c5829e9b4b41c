"""Building and loading pagedserve's CPU kernels (``csrc/cpu_kernels.cpp``) as torch custom ops.

The C++ source ships as package data. On first use it is compiled with the system C++ compiler against the installed
torch's headers and libraries (about 20 s on 2 cores) into a shared library cached under
``~/.cache/pagedserve/cpu_kernels/`` (``$PAGEDSERVE_KERNEL_CACHE_DIR/cpu_kernels`` when set) (keyed by a hash of the source, the flags and the torch version; written to a
temporary name and renamed, so concurrent builds are safe), then loaded with ``torch.ops.load_library``. The ops
(``torch.ops.pagedserve_cpu.linear_f32 / linear_q4 / linear_q8 / paged_decode_attention``, see the source's header
for the formats) get fake
(meta) implementations so ``torch.compile`` traces through them as opaque calls.

The kernels need an x86-64 CPU with AVX2 and FMA; :func:`cpu_linear_ops` returns None, with the reason in
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
from importlib import resources
from pathlib import Path

import structlog
import torch

from .. import envs

log = structlog.get_logger(__name__)

SOURCE = "cpu_kernels.cpp"
CXX_FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-std=c++20", "-fopenmp", "-shared", "-fPIC", "-w")

_lock = threading.Lock()
_state: dict[str, object] = {}


def source_text() -> str:
    return resources.files("pagedserve.kernels").joinpath("csrc", SOURCE).read_text()


def _compiler() -> str | None:
    for name in (envs.cxx_compiler(), "c++", "g++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _command(cxx: str, src: Path, out: Path) -> list[str]:
    root = Path(torch.__file__).parent
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return [cxx, *CXX_FLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={abi}", f"-I{root / 'include'}",
            f"-I{root / 'include' / 'torch' / 'csrc' / 'api' / 'include'}", str(src), f"-L{root / 'lib'}",
            "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{root / 'lib'}", "-o", str(out)]


def build(cache_dir: Path | None = None) -> Path:
    """Compile the library (or find it in ``cache_dir``, default ``<envs.kernel_cache_dir()>/cpu_kernels``) and return
    its path.

    Raises:
        RuntimeError: no C++ compiler, or the compiler's error output when the build fails.
    """
    cache_dir = envs.kernel_cache_dir() / "cpu_kernels" if cache_dir is None else cache_dir
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found ($CXX, c++ or g++)")
    text = source_text()
    key = hashlib.sha256("\0".join([text, *CXX_FLAGS, torch.__version__, sys.version]).encode()).hexdigest()[:16]
    target = cache_dir / f"pagedserve_cpu_linear_{key}.so"
    if target.exists():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    log.info("cpu_kernels_building", source=SOURCE, compiler=cxx, target=str(target))  # about 20 s, once per cache
    with tempfile.TemporaryDirectory(dir=cache_dir) as tmp:
        src = Path(tmp) / SOURCE
        src.write_text(text)
        out = Path(tmp) / target.name
        proc = subprocess.run(_command(cxx, src, out), capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"building {SOURCE} failed:\n{proc.stderr[-4000:]}")
        os.replace(out, target)
    return target


def _register_fakes() -> None:
    def fake(x, *args):
        weight = args[0]
        n = weight.shape[0]
        return x.new_empty((x.shape[0], n))

    for name in ("linear_f32", "linear_q4", "linear_q8"):
        torch.library.register_fake(f"pagedserve_cpu::{name}")(fake)
    torch.library.register_fake("pagedserve_cpu::paged_decode_attention")(lambda q, *args: torch.empty_like(q))
    torch.library.register_fake("pagedserve_cpu::rms_norm")(
        lambda x, weight, eps, residual: (x.new_empty(x.shape),
                                          x.new_empty(x.shape if residual is not None else (0, x.shape[1]))))
    torch.library.register_fake("pagedserve_cpu::rotary_embedding")(
        lambda positions, x, cos_sin, is_neox: x.new_empty(x.shape))
    torch.library.register_fake("pagedserve_cpu::silu_and_mul")(
        lambda x: x.new_empty((x.shape[0], x.shape[1] // 2)))
    torch.library.register_fake("pagedserve_cpu::reshape_and_cache")(lambda key, value, kc, vc, slots: None)


def _check_cpu() -> str | None:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"CPU architecture {platform.machine()} (the kernels need x86-64 with AVX2)"
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ("AVX2", "AVX512"):
        return f"CPU capability {capability} (the kernels need AVX2 and FMA)"
    return None


def cpu_linear_ops():
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
    """Why :func:`cpu_linear_ops` returned None (None when it has not been called or succeeded)."""
    return _state.get("reason")  # type: ignore[return-value]
