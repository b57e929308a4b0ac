# syntax=docker/dockerfile:1
# The drafter: n-gram tables in LMDB under /data, no model and no torch.
#
#   docker build -f deploy/drafter.Dockerfile -t specdec-drafter .
#   export SPECDEC_DRAFTER_CLIENT_TOKEN=$(openssl rand -hex 32)  # verifiers: SPECDEC_VERIFIER_DRAFTER_TOKEN
#   docker run -e SPECDEC_DRAFTER_CLIENT_TOKEN -p 127.0.0.1:50051:50051 -p 127.0.0.1:9101:9101 \
#       -v drafter-data:/data specdec-drafter
#
# It listens on 0.0.0.0 in the container, so it refuses to start without a
# client token (or --client-token-file, or --verifier-identities under mutual
# TLS), or SPECDEC_DRAFTER_INSECURE=1 where the network itself is the
# boundary (docker-compose.yml: no published port).
#
# Build context: the repository root (see .dockerignore).
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1

WORKDIR /src
# The project is one package whose dependencies include torch, transformers and
# the rest of the verifier's stack (gigabytes the drafter never imports), so
# the project goes in with --no-deps and the drafter's own runtime
# dependencies go in first, at the versions pyproject.toml pins (one place for
# versions). tests/deploy checks that the drafter imports nothing else.
COPY pyproject.toml deploy/pinned_requirements.py ./
RUN python pinned_requirements.py \
        grpcio grpcio-health-checking grpcio-reflection protobuf lmdb numpy \
        opentelemetry-api opentelemetry-sdk opentelemetry-exporter-otlp-proto-grpc prometheus-client \
        nats-py nkeys pynacl \
        > /tmp/drafter-requirements.txt \
    && pip install -r /tmp/drafter-requirements.txt \
    && rm /tmp/drafter-requirements.txt
COPY specdec ./specdec
COPY drafter_service ./drafter_service
RUN pip install --no-deps . && rm -rf /src

# A fixed numeric uid: Kubernetes' runAsNonRoot can only verify a numeric USER.
RUN groupadd --system --gid 10001 specdec \
    && useradd --system --uid 10001 --gid 10001 --create-home --home-dir /home/specdec specdec \
    && mkdir -p /data \
    && chown 10001:10001 /data
# Declared after the chown: a new named volume starts with the image's
# (writable) /data. The tables live in /data/drafter, one LMDB environment per
# vocabulary, and survive restarts (acknowledged writes are fsync'd).
VOLUME /data
USER 10001:10001
WORKDIR /home/specdec

ENV SPECDEC_DRAFTER_HOST=0.0.0.0 \
    SPECDEC_DRAFTER_PORT=50051 \
    SPECDEC_DRAFTER_DB=/data/drafter \
    SPECDEC_DRAFTER_METRICS_PORT=9101 \
    SPECDEC_DRAFTER_HEALTH_PORT=50061
# gRPC (specdec.v1.Drafter, grpc.health.v1, reflection); Prometheus /metrics;
# the health port (plaintext grpc.health.v1 on threads of its own: it answers
# however busy the service port is, and tells only SERVING or NOT_SERVING).
EXPOSE 50051 9101 50061

# SERVING once the tables are open; NOT_SERVING again while draining on SIGTERM.
# --timeout is above specdec.healthcheck's own 5 s deadline, so it can say why.
HEALTHCHECK --interval=10s --timeout=10s --start-period=30s --retries=3 \
    CMD ["python", "-m", "specdec.healthcheck", "127.0.0.1:50061"]

# Exec form: the service is PID 1 and gets SIGTERM itself (it drains, then exits 0).
ENTRYPOINT ["python", "-m", "drafter_service"]
