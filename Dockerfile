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
ENTRYPOINT ["kvxfer-cli"]
CMD ["--help"]
