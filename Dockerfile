# The ext_proc service image; it also runs the emulated engines of the compose `cpu` profile
# (`extproc engine`, from the gateway_lab package, hence both packages are installed).
#   docker build -t llm-fair-gateway/extproc .
# Runs as an unprivileged user; the admin server binds 0.0.0.0 inside the container only
# (compose publishes nothing of it; Kubernetes probes reach it on the pod IP).
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

RUN groupadd --system --gid 10001 extproc \
 && useradd --system --uid 10001 --gid extproc --no-create-home --home-dir /nonexistent \
      --shell /usr/sbin/nologin extproc

WORKDIR /src
COPY pyproject.toml README.md ./
COPY extproc ./extproc
COPY gateway_lab ./gateway_lab
RUN pip install . && rm -rf /src

# The example policy; mount your own folder over /etc/extproc/policies (a folder, not a file,
# so that replacing the file on the host is seen by the hot reload).
COPY policies /etc/extproc/policies

WORKDIR /
USER 10001:10001
EXPOSE 50051 9090
ENV EXTPROC_LOG_FORMAT=json \
    EXTPROC_DRAIN_GRACE=30
STOPSIGNAL SIGTERM
HEALTHCHECK --interval=10s --timeout=3s --start-period=20s --retries=3 \
  CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:9090/healthz', timeout=2)"]
ENTRYPOINT ["extproc"]
CMD ["serve", "--policy", "/etc/extproc/policies/default.yaml", "--grpc", "0.0.0.0:50051", "--admin", "0.0.0.0:9090"]
