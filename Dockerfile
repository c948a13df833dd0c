# kvxfer sidecar image (CPU / DRAM default). GPU nodes add the `gpu` extra.
FROM python:3.11-slim

WORKDIR /opt/kvxfer
COPY pyproject.toml constraints.txt README.md ./
COPY kvxfer ./kvxfer
COPY server ./server
COPY client ./client
RUN pip install --no-cache-dir -c constraints.txt . \
    && useradd --system --uid 10001 kvxfer
USER 10001
# Peers dial 7500 (PeerService), Prometheus scrapes 9400; the engine talks over the
# unix socket in a volume shared with it. Settings: flags, KVXFER_* or --config.
# PeerService on a non-loopback address needs mTLS: mount the certificate, key and
# CA at these paths (the server refuses to start without them), or, on a network
# you trust, unset them and pass --insecure-peer-port.
ENV KVXFER_TLS__CERT_FILE=/etc/kvxfer/tls/tls.crt \
    KVXFER_TLS__KEY_FILE=/etc/kvxfer/tls/tls.key \
    KVXFER_TLS__CA_FILE=/etc/kvxfer/tls/ca.crt
EXPOSE 7500 9400
ENTRYPOINT ["kvxfer-server"]
CMD ["--peer-address", "0.0.0.0:7500", "--engine-address", "unix:/run/kvxfer/engine.sock", \
     "--metrics-address", "0.0.0.0:9400"]
