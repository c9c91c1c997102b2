# Tandem for NVIDIA GPU nodes: CUDA 12.8 runtime, the CUDA builds of torch and triton from PyPI
# (torch 2.10 is the newest whose PyPI wheel is built for CUDA 12), nvidia-nccl-cu12, Tandem.
#
#   docker build -t tandem .
#   docker run --gpus all --ipc=host -p 8000:8000 -v /models:/models:ro tandem /models/NAME [options]
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

# gcc and the Python headers stay in the image: Triton compiles its CUDA launcher at run time.
# Versions come from the pinned base image's Ubuntu release.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
        ca-certificates gcc libc6-dev python3.12 python3.12-dev python3.12-venv \
    && rm -rf /var/lib/apt/lists/* \
    && python3.12 -m venv "$VIRTUAL_ENV"

# The heavy layer first, so that a change to Tandem's code does not re-download CUDA wheels.
RUN pip install --no-cache-dir \
        "torch==${TORCH_VERSION}" "triton==${TRITON_VERSION}" "nvidia-nccl-cu12==${NCCL_VERSION}"

WORKDIR /opt/tandem
COPY pyproject.toml README.md ./
COPY server ./server
COPY engine ./engine
COPY models ./models
COPY kernels ./kernels
COPY configs ./configs
COPY docker ./docker
RUN pip install --no-cache-dir "./[gpu]" \
    && python -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"

# Non-root; model folders are mounted read-only (-v /models:/models:ro), nothing is written there.
RUN useradd --no-log-init --create-home --uid 10001 --shell /bin/bash tandem
USER 10001

EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=20m --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('TANDEM_PORT', '8000'), timeout=4)"]
ENTRYPOINT ["/opt/tandem/docker/entrypoint.sh"]
