# syntax=docker/dockerfile:1
# ThinkGate production image: the gateway and the router runtime only (`pip install thinkgate`, no extras), no
# compiler, a non-root user, the embedded engine off. Point the tiers at your vLLM (or any OpenAI-compatible)
# servers with a mounted config and Redis with REDIS_URL:
#   docker build -t thinkgate .
#   docker run -p 8080:8080 -v $PWD/thinkgate.yaml:/etc/thinkgate/thinkgate.yaml:ro \
#     -e THINKGATE_CONFIG=/etc/thinkgate/thinkgate.yaml -e REDIS_URL=redis://redis:6379/0 thinkgate
# The embedded-engine image (local vLLM on CPU with the shipped model, private Redis) is Dockerfile.dev.

FROM python:3.11-slim AS builder
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY gateway ./gateway
COPY router ./router
# Build the wheel, then install it alone (base dependencies, all binary wheels) into a venv the final stage copies.
RUN pip wheel --no-deps -w /dist . \
    && python -m venv /opt/thinkgate \
    && /opt/thinkgate/bin/pip install --only-binary=:all: /dist/thinkgate-*.whl

FROM python:3.11-slim
COPY --from=builder /opt/thinkgate /opt/thinkgate
RUN useradd --system --uid 10001 --home-dir /var/lib/thinkgate --create-home thinkgate
USER thinkgate
WORKDIR /var/lib/thinkgate
ENV PATH=/opt/thinkgate/bin:$PATH \
    THINKGATE_ENGINE__ENABLED=false \
    THINKGATE_REDIS__START_IF_MISSING=false \
    THINKGATE_SERVER__HOST=0.0.0.0 \
    THINKGATE_SERVER__PORT=8080 \
    THINKGATE_STATE_DIR=/var/lib/thinkgate \
    PYTHONUNBUFFERED=1
EXPOSE 8080
HEALTHCHECK --interval=15s --timeout=3s --start-period=20s --retries=3 \
    CMD python -c "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('THINKGATE_SERVER__PORT', '8080'), timeout=2)"
CMD ["thinkgate", "serve"]
