# kvxfer sidecar image: only what `kvxfer-server` imports (no torch, no CUDA
# wheels). docs/deploy.md: how to build, run and deploy it.
#   docker build -t kvxfer:0.1.0 .                        CPU / DRAM (default)
#   docker build -t kvxfer:0.1.0-gpu --build-arg GPU=true .   adds CuPy (CUDA IPC path)
# CI has no Docker daemon: tests/test_deploy.py runs deploy/image/install.sh (the
# build stage's one step) in a fresh venv, starts a sidecar from it and probes it
# with deploy/image/kvxfer-health; make deploy-check lints this file (hadolint,
# checkov). Pin the base by digest when you publish: `docker buildx imagetools
# inspect python:3.11.14-slim-bookworm` prints it (no registry is reachable here).
FROM python:3.11.14-slim-bookworm AS build
ARG GPU=false
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md LICENSE ./
COPY deploy/image ./deploy/image
# kvxfer/v1/*.proto link to proto/kvxfer/v1/ (shipped in the wheel).
COPY proto ./proto
COPY kvxfer ./kvxfer
COPY server ./server
COPY client ./client
RUN deploy/image/install.sh /opt/venv /src "${GPU}"

FROM python:3.11.14-slim-bookworm
ARG GPU=false
LABEL org.opencontainers.image.title="kvxfer" \
      org.opencontainers.image.description="KV-cache transfer sidecar for prefill/decode disaggregated LLM serving" \
      org.opencontainers.image.version="0.1.0" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.base.name="docker.io/library/python:3.11.14-slim-bookworm" \
      io.kvxfer.gpu="${GPU}"
# uid/gid 10001: run the engine container as the same uid (the engine socket is
# 0600 and /dev/shm segments must be owned by the registering uid).
RUN groupadd --system --gid 10001 kvxfer \
    && useradd --system --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin kvxfer \
    && install -d -o 10001 -g 10001 -m 0700 /run/kvxfer
COPY --from=build /opt/venv /opt/venv
COPY --chmod=0755 deploy/image/kvxfer-health /opt/venv/bin/kvxfer-health
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    KVXFER_ENGINE_ADDRESS=unix:/run/kvxfer/engine.sock \
    KVXFER_METRICS_ADDRESS=0.0.0.0:9400 \
    KVXFER_TLS__CERT_FILE=/etc/kvxfer/tls/tls.crt \
    KVXFER_TLS__KEY_FILE=/etc/kvxfer/tls/tls.key \
    KVXFER_TLS__CA_FILE=/etc/kvxfer/tls/ca.crt
USER 10001:10001
# PeerService (7500) is mTLS only: mount tls.crt, tls.key and ca.crt at
# /etc/kvxfer/tls (the server exits 2 naming the missing file otherwise) and set
# KVXFER_PEER_ADDRESS to the pod/host IP, e.g. "$(POD_IP):7500" in Kubernetes.
# Unset, the peer port binds 127.0.0.1:7500 (reachable from the pod only); it is
# never 0.0.0.0 by default. Prometheus scrapes 9400; the engine talks over the
# unix socket in /run/kvxfer (share it with the engine as a volume).
EXPOSE 7500 9400
HEALTHCHECK --interval=10s --timeout=5s --start-period=30s --retries=3 \
    CMD ["kvxfer-health", "--service", "kvxfer.v1.EngineService"]
ENTRYPOINT ["kvxfer-server"]
CMD []
