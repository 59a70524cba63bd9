# syntax=docker/dockerfile:1.26.0@sha256:ecfaec9ed6d810b56388c508f4121597bfbba70d41a6dfeee4d8cad5f295fc32
# kvplan: the KV-cache planning gRPC service.
#
#   docker build -t kvplan .
#   docker run --rm -p 50051:50051 -p 9464:9464 -e KVPLAN_DEVICES=8xH100-80GB \
#     -e KVPLAN_HOST=0.0.0.0 kvplan   # a trial on a trusted machine: no credentials
#
# The image has the server extra only: no torch (the torch.cuda probe is the separate
# `torch` extra). Devices come from KVPLAN_DEVICES, a static inventory, or from what the
# workers report. See docs/deployment.md.

# The Python base of both stages: Python 3.11 on Debian bookworm, the release the
# suite runs on, pinned by the digest of its multi-arch index (Python 3.11.16, built
# 1 Sep 2026; docs/kubernetes.md#the-image says where the digest comes from and how to
# refresh it). The tag is kept for readers; the digest alone decides what is pulled.
# `make image` builds on a Debian bookworm base made with debootstrap where Docker Hub
# cannot be reached, by overriding this ARG (scripts/build-image).
ARG PYTHON_IMAGE=python:3.11-slim-bookworm@sha256:c425d915a89a6dcd3183b1797ad9bd8878caff5a417f6371c8df93c8ea8b727f

# ---- builder: the wheel, from the files .dockerignore lets into the context ----------
FROM ${PYTHON_IMAGE} AS builder
WORKDIR /src
# What the runtime stage installs besides kvplan: the package's own requirements with
# its server extra (pyproject.toml), pinned by constraints.txt. And the build backend
# at its pinned version (setuptools in constraints.txt), in a throwaway venv, instead of
# the newest release that build isolation would fetch. Both change only with these two
# files, so a rebuild after a code change reuses this layer.
COPY pyproject.toml constraints.txt ./
RUN python -m venv /build \
    && /build/bin/pip install --no-cache-dir --disable-pip-version-check \
        --constraint constraints.txt setuptools \
    && mkdir /pins \
    && python -c 'import tomllib; p = tomllib.load(open("pyproject.toml", "rb"))["project"]; print(*p["dependencies"], *p["optional-dependencies"]["server"], sep="\n")' \
        > /pins/requirements.txt \
    && cp constraints.txt /pins/constraints.txt
COPY . .
# SOURCE_DATE_EPOCH: the wheel's zip timestamps are this date, not the files' mtimes
# (which a fresh clone resets), so the same tree gives the same wheel, byte for byte.
# Its digest is what the runtime stage copies: the install is redone exactly when the
# wheel changed.
RUN SOURCE_DATE_EPOCH=315532800 /build/bin/pip wheel --no-cache-dir \
        --disable-pip-version-check --no-build-isolation --no-deps --wheel-dir /wheels . \
    && sha256sum /wheels/kvplan-*.whl > /pins/kvplan-wheel.sha256

# ---- runtime: the wheel with its server extra, in a venv at /opt/kvplan --------------
FROM ${PYTHON_IMAGE} AS runtime

LABEL org.opencontainers.image.title="kvplan" \
      org.opencontainers.image.description="KV-cache planning gRPC service for LLM inference engines" \
      org.opencontainers.image.licenses="Apache-2.0"

# A fixed, unprivileged uid/gid: volume permissions and runAsNonRoot checks can rely on it.
RUN groupadd --system --gid 10001 kvplan \
    && useradd --system --uid 10001 --gid kvplan --no-create-home \
        --home-dir /nonexistent --shell /usr/sbin/nologin kvplan

# The dependencies, in a layer of their own, each at the version the suite was run
# against (constraints.txt, `make lock`), not whatever PyPI has that day. A COPY is
# cached by the content of what it copies, a RUN only by its text (buildah 1.28): the
# copied pins make this layer follow pyproject.toml and constraints.txt.
COPY --from=builder /pins/requirements.txt /pins/constraints.txt /usr/local/share/kvplan/
RUN python -m venv /opt/kvplan \
    && /opt/kvplan/bin/pip install --no-cache-dir --disable-pip-version-check \
        --constraint /usr/local/share/kvplan/constraints.txt \
        --requirement /usr/local/share/kvplan/requirements.txt \
    && install -d -o 10001 -g 10001 -m 0750 /var/lib/kvplan

# kvplan itself. The wheel is bind-mounted from the builder, so it never lands in a
# layer; its digest is copied first, so a changed wheel is installed anew instead of
# a cached layer holding the old one, and the install checks that the mounted wheel is
# that one. --no-index: every dependency must already be there, from the layer above.
# The build fails if anything pulled in torch.
COPY --from=builder /pins/kvplan-wheel.sha256 /usr/local/share/kvplan/
RUN --mount=type=bind,from=builder,source=/wheels,target=/wheels \
    sha256sum --check --quiet /usr/local/share/kvplan/kvplan-wheel.sha256 \
    && wheel="$(echo /wheels/kvplan-*.whl)" \
    && /opt/kvplan/bin/pip install --no-cache-dir --disable-pip-version-check --no-index \
        --constraint /usr/local/share/kvplan/constraints.txt "${wheel}[server]" \
    && /opt/kvplan/bin/python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is not None)"

# Settings are KVPLAN_* variables (server/config.py); flags after the image name win.
# KVPLAN_HOST=auto: gRPC on every interface only once callers must authenticate
# (KVPLAN_TOKEN_FILE, or mutual TLS: KVPLAN_TLS_CERT/KEY/CLIENT_CA); otherwise loopback.
# Metrics stay reachable for scraping; they carry no engine ids (docs/security.md).
ENV PATH=/opt/kvplan/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    KVPLAN_HOST=auto \
    KVPLAN_PORT=50051 \
    KVPLAN_METRICS_HOST=0.0.0.0 \
    KVPLAN_METRICS_PORT=9464 \
    KVPLAN_LOG_FORMAT=json \
    KVPLAN_LOG_LEVEL=INFO \
    KVPLAN_STATE_DIR=/var/lib/kvplan

# Plans, rendezvous and leases (SQLite, WAL): keep them across container restarts.
VOLUME ["/var/lib/kvplan"]

USER 10001:10001
WORKDIR /opt/kvplan

# 50051: gRPC (kvplan.v1.KVCachePlanner, grpc.health.v1.Health, reflection)
# 9464: Prometheus /metrics
EXPOSE 50051 9464

# grpc.health.v1 Check against 127.0.0.1:$KVPLAN_PORT; exit 0 only when SERVING.
HEALTHCHECK --interval=15s --timeout=5s --start-period=10s --retries=3 \
    CMD ["kvplan", "health", "--timeout", "3"]

# SIGTERM drains: NOT_SERVING, in-flight calls get KVPLAN_GRACE_S (10 s) to finish.
STOPSIGNAL SIGTERM
ENTRYPOINT ["kvplan", "serve"]
