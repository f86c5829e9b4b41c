"""Host emulator for the CUDA kernels of ``cuda/`` (see simt_host.hpp for what it emulates).

:class:`Simulator` compiles one kernel instantiation at a time with g++ (the same source text NVRTC gets, from
:func:`pagedserve.kernels.load_source`, with ``extern __shared__`` arrays turned into pointers to the emulated
dynamic shared memory), caches the shared library on disk by the hash of its source and of every emulator header
(:func:`build_key`), and runs it on CPU tensors with the exact argument tuple and launch geometry
:mod:`pagedserve.kernels` computes. A :class:`Simulator` is a :class:`pagedserve.kernels.KernelRuntime` for CPU
tensors: installed (``with sim.install():``, i.e. :func:`pagedserve.kernels.use_runtime`), the public launchers
(argument checks, plans, split-K scratch buffers and all) run unchanged on it.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import numpy as np
import torch

from pagedserve import kernels
from pagedserve.kernels import ModuleKey

HERE = Path(__file__).resolve().parent
_EXTERN_SHARED_RE = re.compile(r"extern\s+__shared__\s+(\w+)\s+(\w+)\s*\[\s*\]\s*;")
_STATIC_SHARED_RE = re.compile(r"(?<!extern )__shared__\s+(\w+)\s+(\w+)\s*\[([^\]]+)\]\s*;")
CXX_FLAGS = ("-std=c++17", "-O2", "-fPIC", "-shared", "-fno-strict-aliasing", "-Wno-unknown-pragmas",
             "-Wno-attributes", "-DPAGEDSERVE_SIMT_HOST=1", "-DNDEBUG")


class SimtError(RuntimeError):
    """The emulator stopped a kernel: deadlock, divergent warp collective, bad shared-memory address, __trap()."""


def compiler() -> str | None:
    """The C++ compiler to use (``$CXX`` or g++), or None when there is none."""
    return shutil.which(os.environ.get("CXX", "g++"))


def host_include_dirs() -> list[str]:
    """CUDA headers for the host compile: ``$PAGEDSERVE_SIMT_CUDA_INCLUDE``, else the nvidia-cuda-runtime-cu12
    wheel's (what the stand-in headers in include/ were written against), else whatever NVRTC would use."""
    import importlib.util
    if os.environ.get("PAGEDSERVE_SIMT_CUDA_INCLUDE"):
        return [os.environ["PAGEDSERVE_SIMT_CUDA_INCLUDE"]]
    spec = importlib.util.find_spec("nvidia")
    for base in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(base) / "cuda_runtime" / "include"
        if (candidate / "cuda_fp16.h").is_file():
            return [str(candidate)]
    return kernels.cuda_include_dirs()


def unavailable() -> str | None:
    """Why the emulator cannot build kernels here (no g++, no CUDA headers), or None when it can."""
    if compiler() is None:
        return "needs g++ for the host emulator"
    if not host_include_dirs():
        return "needs the CUDA headers (nvidia-cuda-runtime-cu12) for the host emulator"
    return None


def cache_dir() -> Path:
    base = os.environ.get("PAGEDSERVE_SIMT_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "pagedserve", "simt")
    return Path(base)


def translation_unit(source: str, names: tuple[str, ...]) -> str:
    """C++ for kernel ``source`` (CUDA text, includes inlined): the emulator header, the source with ``extern
    __shared__`` arrays pointed at the emulated dynamic shared memory and static ``__shared__`` arrays at the
    block's static arena, and an entry point ``simt_entry_<i>`` per template instantiation ``names[i]``."""
    source = _EXTERN_SHARED_RE.sub(r"\1* \2 = reinterpret_cast<\1*>(::simt::dynamic_smem());", source)
    source = _STATIC_SHARED_RE.sub(
        lambda m: f"{m[1]}* {m[2]} = ::simt::static_smem<{m[1]}>({m[3]}, {m.start()});", source)
    if "__shared__" in source:
        raise SimtError("the emulator takes __shared__ arrays only (`__shared__ T name[N];` or `extern __shared__ "
                        "T name[];`)")
    entries = [
        f'extern "C" __attribute__((visibility("default"))) int simt_entry_{i}(const std::uint64_t* slots, '
        "int num_slots, const unsigned* geometry, std::size_t smem, int workers, std::uint64_t seed, char* err, "
        "std::size_t err_len) {\n"
        f"  return ::simt::launch(&{name}, slots, num_slots, geometry, smem, workers, seed, err, err_len);\n}}\n"
        for i, name in enumerate(names)]
    return '#include "simt_host.hpp"\n' + source + "\n" + "".join(entries)


def emulator_headers() -> dict[str, str]:
    """Every header of the emulator, by path relative to tests/simt (``"simt_sync.hpp"``,
    ``"include/nv/target"``) with its text: the ``*.hpp`` files of this folder (simt_host.hpp and the parts it
    includes) and the stand-in CUDA headers under include/."""
    paths = [*HERE.glob("*.hpp"), *(p for p in (HERE / "include").rglob("*") if p.is_file())]
    return {p.relative_to(HERE).as_posix(): p.read_text() for p in sorted(paths)}


def build_key(unit: str, cxx: str, includes: list[str], headers: dict[str, str],
              flags: tuple[str, ...] = CXX_FLAGS) -> str:
    """Cache key (24 hex digits) of a compiled kernel library: the translation unit, the compiler path, flags and
    include folders, and each header's name and text (``headers``, normally :func:`emulator_headers`; order of
    the mapping does not matter), so an edit to any emulator header rebuilds instead of loading a stale library."""
    parts = [unit, *flags, *includes, *(f"{name}\0{headers[name]}" for name in sorted(headers)), cxx]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:24]


def build(source: str, names: tuple[str, ...], label: str) -> ctypes.CDLL:
    """Compile kernel ``source`` with entry points for ``names`` into a shared library (cached on disk by the hash
    of everything that goes into it) and load it. Raises SimtError when g++ is missing or fails."""
    cxx = compiler()
    if cxx is None:
        raise SimtError("no C++ compiler (g++) found")
    unit = translation_unit(source, names)
    includes = [str(HERE / "include"), str(HERE), *host_include_dirs()]
    target = cache_dir() / f"{build_key(unit, cxx, includes, emulator_headers())}.so"
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            src = Path(tmp) / "kernel.cpp"
            src.write_text(unit)
            out = Path(tmp) / "kernel.so"
            proc = subprocess.run([cxx, *CXX_FLAGS, *(f"-I{d}" for d in includes), str(src), "-o", str(out),
                                   "-lpthread"], capture_output=True, text=True)
            if proc.returncode:
                raise SimtError(f"g++ failed for {label}:\n{proc.stderr[-6000:]}")
            os.replace(out, target)
    lib = ctypes.CDLL(str(target))
    lib.simt_set_ranges.restype = None
    lib.simt_set_ranges.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_int]
    for i in range(len(names)):
        entry = getattr(lib, f"simt_entry_{i}")
        entry.restype = ctypes.c_int
        entry.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_int, ctypes.POINTER(ctypes.c_uint),
                          ctypes.c_size_t, ctypes.c_int, ctypes.c_uint64, ctypes.c_char_p, ctypes.c_size_t]
    return lib


def run(entry, label: str, grid, block, args, smem_bytes: int, workers: int, seed: int = 0) -> None:
    """Call one entry point: ``args`` are numpy scalars (pointers as ``np.uint64`` addresses); ``seed`` 0 runs a
    block's threads in thread order between barriers, any other value in a pseudo-random order per pass."""
    slots = (ctypes.c_uint64 * max(1, len(args)))()
    for i, a in enumerate(args):
        raw = np.asarray(a).tobytes()
        if len(raw) > 8:
            raise SimtError(f"argument {i} of {label} is {len(raw)} bytes")
        slots[i] = int.from_bytes(raw.ljust(8, b"\0"), "little")
    geometry = (ctypes.c_uint * 6)(*grid, *block)
    err = ctypes.create_string_buffer(2048)
    if entry(slots, len(args), geometry, smem_bytes, workers, seed, err, len(err)):
        raise SimtError(f"{label}: {err.value.decode(errors='replace')}")


PROBE_NAMES = ("probe_mma<__half>", "probe_mma<__nv_bfloat16>", "probe_ldmatrix<false>", "probe_ldmatrix<true>",
               "probe_reduce", "probe_cp_async", "probe_divergent", "probe_smem_overrun", "probe_missing_barrier",
               "probe_shfl_segments", "probe_split_barrier")


def probe_source() -> str:
    """cuda/common.cuh followed by probes.cu: valid CUDA for NVRTC and input for the emulator."""
    return kernels.load_source("common.cuh") + (HERE / "probes.cu").read_text()


class Probes:
    """The probe kernels of probes.cu on the emulator: ``launch(name, grid, block, args, smem_bytes)``."""

    def __init__(self, workers: int = 1, seed: int = 0):
        self.workers, self.seed = workers, seed
        self.lib = build(probe_source(), PROBE_NAMES, "probes")

    def launch(self, name: str, grid, block, args, smem_bytes: int = 0) -> None:
        # no range check for the probes: clear what a Simulator launch left (g_ranges, an inline variable, is one
        # STB_GNU_UNIQUE object shared by every emulator library in the process)
        self.lib.simt_set_ranges((ctypes.c_uint64 * 1)(), 0)
        run(getattr(self.lib, f"simt_entry_{PROBE_NAMES.index(name)}"), name, grid, block, args, smem_bytes,
            self.workers, self.seed)


class Simulator:
    """Compiles and runs kernel instantiations on the CPU: a :class:`pagedserve.kernels.KernelRuntime` for CPU
    tensors (module keys of architecture ``"simt"``).

    Args:
        workers: OS threads that run blocks in parallel (default: the CPU count).
        num_sms: the SM count the runtime reports (132, an H100/H200, by default; no launch plan depends on it).
        transform: applied to each kernel source before compiling (tests use it to plant a bug).
        seed: the order a block's threads run in between barriers: 0 thread order, else pseudo-random per pass
            (the default, so a result that depends on a missing barrier does not pass by luck of the order).
        source_dir: the CUDA source folder (default: the package's, :func:`pagedserve.kernels.find_source_dir`).
    """

    def __init__(self, workers: int | None = None, num_sms: int = 132, transform=None, seed: int = 1,
                 source_dir: str | Path | None = None):
        self.workers = workers or os.cpu_count() or 1
        self.seed = seed
        self.sm_count = num_sms
        self.transform = transform
        self.source_dir = source_dir
        self._libs: dict[ModuleKey, ctypes.CDLL] = {}
        self._ranges: list[tuple[int, int]] = []  # storages of the tensor arguments of the next launch
        self._lock = threading.Lock()
        self.launches: list[tuple[str, tuple, tuple, int]] = []  # (name, grid, block, smem) of every launch

    def library(self, key: ModuleKey) -> ctypes.CDLL:
        """Module ``key`` compiled for the host: every name expression of the key, as on the GPU."""
        with self._lock:
            lib = self._libs.get(key)
        if lib is None:
            source = kernels.load_source(key.source_file, self.source_dir)
            if self.transform is not None:
                source = self.transform(source)
            lib = build(source, key.name_expressions(), str(key))
            with self._lock:
                self._libs[key] = lib
        return lib

    def precompile(self, keys: list[ModuleKey], jobs: int | None = None) -> None:
        """Compile several modules in parallel (g++ runs in subprocesses)."""
        from concurrent.futures import ThreadPoolExecutor
        with ThreadPoolExecutor(max_workers=jobs or os.cpu_count() or 1) as pool:
            list(pool.map(self.library, keys))

    # ---- KernelRuntime ------------------------------------------------------------------------------------------
    def check_device(self, **tensors: torch.Tensor) -> torch.device:
        """CPU tensors only."""
        for arg, t in tensors.items():
            if t.device.type != "cpu":
                raise ValueError(f"{arg}: the emulator runs on CPU tensors, got device {t.device}")
        return torch.device("cpu")

    def num_sms(self, index: int | None) -> int:
        return self.sm_count

    def device_arch(self, index: int | None) -> str:
        return "simt"

    def pointer(self, t: torch.Tensor) -> np.uint64:
        """The tensor's address, noting its storage as memory the next launch may read (through __ldg and
        cp.async)."""
        storage = t.untyped_storage()
        self._ranges.append((storage.data_ptr(), storage.data_ptr() + storage.nbytes()))
        return np.uint64(t.data_ptr())

    def launch(self, key: ModuleKey, name: str, device, grid, block, args, smem_bytes: int = 0) -> None:
        """Run instantiation ``name`` of module ``key`` on the CPU; it may read only the storages of the tensors
        :meth:`pointer` saw since the last launch."""
        names = key.name_expressions()
        if name not in names:
            raise SimtError(f"{name} is not an instantiation of module {key}")
        lib = self.library(key)
        ranges, self._ranges = self._ranges, []
        flat = (ctypes.c_uint64 * max(1, 2 * len(ranges)))(*(v for r in ranges for v in r))
        lib.simt_set_ranges(flat, len(ranges))
        self.launches.append((name, tuple(grid), tuple(block), smem_bytes))
        run(getattr(lib, f"simt_entry_{names.index(name)}"), name, grid, block, args, smem_bytes, self.workers,
            self.seed)

    def install(self):
        """Context manager: this emulator is the kernels' runtime inside the block
        (:func:`pagedserve.kernels.use_runtime`); yields it."""
        return kernels.use_runtime(self)
