"""Compiling the CUDA sources with NVRTC (through CuPy) and caching the modules.

Each kernel family is one ``.cu`` file, read with its local includes inlined (:mod:`pagedserve.kernels.sources`),
so the text handed to NVRTC (and hashed by CuPy's on-disk kernel cache) is the whole translation unit. A module is
compiled per :class:`ModuleKey` (family, dtype, head_dim, block_size, arch) with the templates it needs as NVRTC
name expressions, and cached for the life of the process. Compiling for a named architecture without a GPU (the
ptxas report): :mod:`pagedserve.kernels.cubin`.
"""
from __future__ import annotations

import importlib.util
import re
import threading
from dataclasses import dataclass
from pathlib import Path

from . import geometry as geo
from .sources import load_source

FAMILY_SOURCES = {"cache": "cache_ops.cu", "decode": "decode_attention.cu",
                  "prefill": "prefill_attention.cu", "elementwise": "elementwise.cu", "moe": "moe.cu"}
FP32_SOURCES = {"prefill": "prefill_attention_fp32.cu"}  # fp32 variants kept in their own file


class KernelCompileError(RuntimeError):
    """NVRTC rejected a kernel source; the message carries the compiler log."""


@dataclass(frozen=True, slots=True)
class ModuleKey:
    """One compiled module: a kernel family for one configuration and GPU architecture."""

    family: str                  # key of FAMILY_SOURCES
    dtype: str | None = None     # "float16" | "bfloat16" | "float32" (None: dtype-agnostic family)
    head_dim: int | None = None
    block_size: int | None = None
    arch: str = "sm_90"          # "sm_80", "sm_90", ...

    @property
    def source_file(self) -> str:
        """The ``.cu`` file (in the CUDA source folder) this module compiles."""
        if self.dtype == "float32" and self.family in FP32_SOURCES:
            return FP32_SOURCES[self.family]
        return FAMILY_SOURCES[self.family]

    def name_expressions(self) -> tuple[str, ...]:
        """The template instantiations this module holds."""
        d, hd, bs = self.dtype, self.head_dim, self.block_size
        if self.family == "cache":
            units = tuple(geo.COPY_UNITS)
            return (tuple(geo.reshape_and_cache_kernel_name(u) for u in units)
                    + tuple(geo.copy_blocks_kernel_name(u) for u in units))
        if self.family == "decode":
            return (tuple(geo.decode_kernel_name(d, hd, bs, t) for t in geo.DECODE_GQA_TILES)
                    + (geo.decode_merge_kernel_name(d, hd),))
        if self.family == "prefill":
            if d == "float32":  # the decode kernel's partitions, so its GQA tiles
                return tuple(geo.prefill_kernel_name(d, hd, bs, t) for t in geo.DECODE_GQA_TILES)
            return (geo.prefill_kernel_name(d, hd, bs),)
        if self.family == "elementwise":
            vecs = sorted({geo.vec_elems(d), 1})
            return (tuple(geo.rms_norm_kernel_name(d, v, r) for v in vecs for r in (False, True))
                    + tuple(geo.rotary_kernel_name(d, n) for n in (True, False))
                    + tuple(geo.silu_and_mul_kernel_name(d, v) for v in vecs))
        if self.family == "moe":
            return (geo.moe_topk_kernel_name(True), geo.moe_topk_kernel_name(False), geo.moe_combine_kernel_name(d))
        raise ValueError(f"family: unknown kernel family {self.family!r}")


_modules: dict[ModuleKey, object] = {}
_functions: dict[tuple[ModuleKey, str], object] = {}
_lock = threading.Lock()


def _header_cudart_major(include_dir: Path) -> int | None:
    header = include_dir / "cuda_runtime_api.h"
    if not header.is_file():
        return None
    match = re.search(r"#define\s+CUDART_VERSION\s+(\d+)", header.read_text(errors="ignore"))
    return int(match.group(1)) // 1000 if match else None


def nvrtc_version() -> tuple[int, int]:
    from cupy_backends.cuda.libs import nvrtc
    return tuple(nvrtc.getVersion())  # type: ignore[return-value]


def cuda_include_dirs() -> list[str]:
    """Directories holding the CUDA headers (cuda_fp16.h, ...) for NVRTC: the CUDA toolkit CuPy found, else the
    nvidia-cuda-runtime wheel's, preferring one whose CUDA major version matches NVRTC's."""
    candidates: list[Path] = []
    try:
        import cupy
        cuda_path = cupy.cuda.get_cuda_path()
        if cuda_path:
            candidates.append(Path(cuda_path) / "include")
    except Exception:  # noqa: BLE001 - CuPy without a toolkit path: fall through to the wheels
        pass
    spec = importlib.util.find_spec("nvidia")
    for base in (spec.submodule_search_locations or []) if spec else []:
        for sub in ("cuda_runtime/include", "cu13/include", "cu12/include"):
            candidates.append(Path(base) / sub)
    existing = [c for c in candidates if (c / "cuda_fp16.h").is_file()]
    try:
        major = nvrtc_version()[0]
    except Exception:  # noqa: BLE001 - no NVRTC: the compile itself will report it
        major = None
    matching = [c for c in existing if _header_cudart_major(c) == major]
    chosen = matching or existing
    return [str(chosen[0])] if chosen else []


def nvrtc_options(include_dirs: list[str] | None = None) -> tuple[str, ...]:
    """Options shared by run-time modules and :func:`pagedserve.kernels.cubin.compile_to_cubin`. No
    --use_fast_math: exp2f, expf and rsqrtf keep their accurate forms (CuPy adds -ftz=true to run-time compiles, so
    the CPU compile adds it too)."""
    dirs = cuda_include_dirs() if include_dirs is None else include_dirs
    return ("-std=c++17", "-DNDEBUG", *(f"-I{d}" for d in dirs))


def get_kernel(key: ModuleKey, name: str):
    """The ``cupy.RawKernel`` for template ``name`` of module ``key``, compiling on first use (cached).

    Must be called with the target device current (``cupy.cuda.Device``): RawModule compiles for it.
    """
    cached = _functions.get((key, name))
    if cached is not None:
        return cached
    import cupy
    with _lock:
        module = _modules.get(key)
        if module is None:
            source = load_source(key.source_file)
            module = cupy.RawModule(code=source, options=nvrtc_options(),
                                    name_expressions=list(key.name_expressions()))
            _modules[key] = module
        try:
            function = module.get_function(name)
        except cupy.cuda.compiler.CompileException as exc:
            _modules.pop(key, None)
            raise KernelCompileError(f"{key}: {exc}") from exc
        _functions[(key, name)] = function
        return function


def nvrtc_available() -> bool:
    """True when CuPy's NVRTC bindings load and the CUDA headers are found (no GPU needed)."""
    try:
        nvrtc_version()
    except Exception:  # noqa: BLE001 - any loader failure means "not available"
        return False
    return bool(cuda_include_dirs())
