"""The one module that reads the process environment.

Every environment variable the server, its workers and its kernel build look at is read here, through a function
(never at import time), so a test can pass its own mapping and a reader can see the whole list in one place:

- ``PAGEDSERVE_<FIELD>``: a default for one config field (:func:`pagedserve_settings`; :mod:`pagedserve.cli` turns
  the values into flag defaults).
- ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``: set by ``torchrun`` for a tensor-parallel job across machines
  (:func:`torchrun_rank`).
- ``CXX``: the C++ compiler for the CPU kernels (:func:`cxx_compiler`).
- ``PAGEDSERVE_KERNEL_CACHE_DIR``: where compiled CPU kernels are cached (:func:`kernel_cache_dir`); not a config
  field, so the CLI leaves it out of its unknown-variable warning.
- The OpenTelemetry SDK's standard ``OTEL_*`` variables that tracing (``--otlp-traces-endpoint``) follows
  (:func:`otel_settings`): service name and resource, sampler, OTLP protocol, batch export delay.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

ENV_PREFIX = "PAGEDSERVE_"
KERNEL_CACHE_DIR_VAR = ENV_PREFIX + "KERNEL_CACHE_DIR"
# PAGEDSERVE_* names that are not serve settings (this module's own, and the client CLI's PAGEDSERVE_TARGET): the
# CLI neither warns about nor converts them.
NON_FIELD_VARS = frozenset({KERNEL_CACHE_DIR_VAR, ENV_PREFIX + "TARGET"})


def _env(environ: Mapping[str, str] | None) -> Mapping[str, str]:
    return os.environ if environ is None else environ


def pagedserve_settings(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The ``PAGEDSERVE_*`` config variables, keyed by the lower-cased rest of the name
    (``PAGEDSERVE_MAX_NUM_SEQS=8`` -> ``{"max_num_seqs": "8"}``); :data:`NON_FIELD_VARS` are left out."""
    return {k[len(ENV_PREFIX):].lower(): v for k, v in _env(environ).items()
            if k.startswith(ENV_PREFIX) and k != ENV_PREFIX and k not in NON_FIELD_VARS}


@dataclass(frozen=True, slots=True)
class TorchrunRank:
    """One process's place in a torchrun job."""
    rank: int        # global rank, 0 = the server
    world_size: int  # number of processes (= tensor_parallel_size)
    local_rank: int  # rank on this machine (picks the GPU)


def torchrun_rank(environ: Mapping[str, str] | None = None) -> TorchrunRank:
    """``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK`` (default 0) as torchrun sets them.

    Raises:
        KeyError: ``RANK`` or ``WORLD_SIZE`` is missing (not started by torchrun).
        ValueError: a value is not an integer.
    """
    env = _env(environ)
    return TorchrunRank(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", "0")))


def cxx_compiler(environ: Mapping[str, str] | None = None) -> str | None:
    """``$CXX`` when set and non-empty, else None (the caller then tries ``c++`` and ``g++``)."""
    return _env(environ).get("CXX") or None


def kernel_cache_dir(environ: Mapping[str, str] | None = None) -> Path:
    """Where compiled kernels are cached: ``$PAGEDSERVE_KERNEL_CACHE_DIR`` or ``~/.cache/pagedserve``."""
    value = _env(environ).get(KERNEL_CACHE_DIR_VAR)
    return Path(value) if value else Path.home() / ".cache" / "pagedserve"


@dataclass(frozen=True, slots=True)
class OtelSettings:
    """The OpenTelemetry variables tracing reads (the specification's names and defaults; unset: None). The OTLP
    exporter itself still reads its transport variables (``OTEL_EXPORTER_OTLP_HEADERS``, ``..._CERTIFICATE``,
    ``..._TIMEOUT``, ``..._COMPRESSION``) as the SDK documents them."""
    service_name: str | None          # OTEL_SERVICE_NAME
    resource_attributes: str | None   # OTEL_RESOURCE_ATTRIBUTES: "key=value,key=value"
    sampler: str | None               # OTEL_TRACES_SAMPLER (default parentbased_always_on)
    sampler_arg: str | None           # OTEL_TRACES_SAMPLER_ARG (the ratio of the traceidratio samplers)
    protocol: str | None              # OTEL_EXPORTER_OTLP_TRACES_PROTOCOL, else OTEL_EXPORTER_OTLP_PROTOCOL
    schedule_delay_ms: str | None     # OTEL_BSP_SCHEDULE_DELAY: milliseconds between batch exports


def otel_settings(environ: Mapping[str, str] | None = None) -> OtelSettings:
    """The ``OTEL_*`` variables of :class:`OtelSettings` (an empty value counts as unset)."""
    env = _env(environ)

    def get(name: str) -> str | None:
        return env.get(name) or None

    return OtelSettings(get("OTEL_SERVICE_NAME"), get("OTEL_RESOURCE_ATTRIBUTES"), get("OTEL_TRACES_SAMPLER"),
                        get("OTEL_TRACES_SAMPLER_ARG"),
                        get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or get("OTEL_EXPORTER_OTLP_PROTOCOL"),
                        get("OTEL_BSP_SCHEDULE_DELAY"))
