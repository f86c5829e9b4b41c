"""Compiling a kernel module to CUBIN for a named architecture (``sm_80``, ``sm_90``) without a GPU, with ptxas's
resource report, so CPU-only tests can check that every kernel builds and that none spills registers."""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from .build import KernelCompileError, ModuleKey, nvrtc_options
from .sources import load_source


@dataclass(frozen=True, slots=True)
class KernelResources:
    """ptxas's report for one kernel."""

    registers: int
    stack_frame_bytes: int
    spill_store_bytes: int
    spill_load_bytes: int


@dataclass(frozen=True, slots=True)
class CubinResult:
    cubin: bytes
    log: str                              # NVRTC log, including ptxas -v output
    lowered_names: dict[str, str]         # name expression -> mangled kernel name
    resources: dict[str, KernelResources]  # name expression -> ptxas report


def parse_ptxas_log(log: str) -> dict[str, KernelResources]:
    """Per mangled kernel name: registers, stack frame and spill bytes from ``ptxas -v`` output."""
    out: dict[str, KernelResources] = {}
    current, frame = None, (0, 0, 0)
    for line in log.splitlines():
        if m := re.search(r"Compiling entry function '([^']+)'", line):
            current = m.group(1)
        elif (m := re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)):
            frame = tuple(int(x) for x in m.groups())
        elif (m := re.search(r"Used (\d+) registers", line)) and current is not None:
            out[current] = KernelResources(int(m.group(1)), *frame)
            current, frame = None, (0, 0, 0)
    return out


def compile_to_cubin(key: ModuleKey, source_dir: Path | str | None = None,
                     include_dirs: list[str] | None = None) -> CubinResult:
    """Compile module ``key`` for ``key.arch`` to CUBIN with NVRTC and ``--ptxas-options=-v``; needs no GPU.

    Raises:
        KernelCompileError: with the NVRTC log, when compilation fails.
    """
    return compile_source_to_cubin(load_source(key.source_file, source_dir), key.source_file,
                                   key.name_expressions(), key.arch, include_dirs, label=str(key))


def compile_source_to_cubin(source: str, filename: str, names: tuple[str, ...], arch: str,
                            include_dirs: list[str] | None = None, label: str = "") -> CubinResult:
    """:func:`compile_to_cubin` for any CUDA source text with template instantiations ``names``."""
    from cupy_backends.cuda.libs import nvrtc
    prog = nvrtc.createProgram(source, filename, [], [])
    try:
        for name in names:
            nvrtc.addNameExpression(prog, name)
        options = [f"-arch={arch}", *nvrtc_options(include_dirs), "-ftz=true", "--ptxas-options=-v"]
        try:
            nvrtc.compileProgram(prog, options)
        except nvrtc.NVRTCError as exc:
            raise KernelCompileError(f"{label or filename}: {exc}\n{nvrtc.getProgramLog(prog)}") from exc
        log = nvrtc.getProgramLog(prog)
        lowered = {name: nvrtc.getLoweredName(prog, name) for name in names}
        by_mangled = parse_ptxas_log(log)
        resources = {name: by_mangled[m] for name, m in lowered.items() if m in by_mangled}
        return CubinResult(cubin=nvrtc.getCUBIN(prog), log=log, lowered_names=lowered, resources=resources)
    finally:
        nvrtc.destroyProgram(prog)
