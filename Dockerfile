# syntax=docker/dockerfile:1
# hybridserve images, one target per kind of machine:
#
#   docker build --target cpu  -t hybridserve:cpu  .   python 3.11 slim, torch 2.13.0 CPU build
#   docker build --target cuda -t hybridserve:cuda .   CUDA runtime, torch 2.13.0 CUDA build and the
#                                                      [cuda] extra (mamba-ssm, causal-conv1d, flash-attn)
#
# The CUDA kernels compile in the `cuda-build` stage (nvcc) for TORCH_CUDA_ARCH_LIST only, MAX_JOBS at a
# time; a narrower list builds faster (`--build-arg TORCH_CUDA_ARCH_LIST=9.0` for H100/H200 only). The
# torch wheel's CUDA (TORCH_INDEX_URL) must match the base image's CUDA major version, as the kernels link
# against both.
#
# Both images run the server from /app (configs/ sits beside it). Their default command serves the bundled
# tiny model on an embedded Ray cluster (`docker run --shm-size=2g -p 8000:8000 hybridserve:cpu`; Ray keeps
# its object store in /dev/shm, 64 MB by default in Docker). docker-compose.yml and
# deploy/kuberay/ run `ray start` and `hybridserve serve` instead.

ARG PYTHON_VERSION=3.11
ARG CUDA_VERSION=12.8.1
ARG UBUNTU_VERSION=24.04

# ---- cpu: laptops, CI, CPU-only Ray workers ----
FROM python:${PYTHON_VERSION}-slim-bookworm AS cpu
# PyPI's Linux torch wheel is the multi-GB CUDA build: take torch from the CPU wheel index, at the
# version constraints/cpu.txt pins, before anything can ask PyPI for it
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /app
COPY constraints/ constraints/
RUN pip install -c constraints/cpu.txt --index-url ${TORCH_INDEX_URL} torch
COPY . .
# torch is already satisfied (2.13.0+cpu meets the constraint's ==2.13.0): nothing replaces it
RUN pip install -c constraints/cpu.txt '.[model,cluster]' \
    && useradd --create-home hybridserve && mkdir -p out && chown hybridserve out
USER hybridserve
EXPOSE 8000 8265 6379
CMD ["hybridserve", "serve", "--host", "0.0.0.0", "--port", "8000"]

# ---- cuda-build: compiles the [cuda] kernels against the CUDA torch (not shipped) ----
FROM nvidia/cuda:${CUDA_VERSION}-devel-ubuntu${UBUNTU_VERSION} AS cuda-build
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
ARG TORCH_CUDA_ARCH_LIST="8.0;8.6;8.9;9.0"
ARG MAX_JOBS=8
ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-dev python3-venv git \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /app
RUN pip install --index-url ${TORCH_INDEX_URL} torch==${TORCH_VERSION} \
    && pip install ninja packaging wheel setuptools
COPY . .
# --no-build-isolation: the kernels build against the torch above; the constraint keeps their own
# requirements from swapping it for PyPI's
RUN echo "torch==${TORCH_VERSION}" > /tmp/torch-pin.txt \
    && TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST}" MAX_JOBS=${MAX_JOBS} \
       pip install --no-build-isolation -c /tmp/torch-pin.txt '.[model,cluster,cuda]'

# ---- cuda: GPU Ray workers and heads ----
FROM nvidia/cuda:${CUDA_VERSION}-runtime-ubuntu${UBUNTU_VERSION} AS cuda
ENV PYTHONUNBUFFERED=1 DEBIAN_FRONTEND=noninteractive
RUN apt-get update && apt-get install -y --no-install-recommends python3 \
    && rm -rf /var/lib/apt/lists/*
COPY --from=cuda-build /opt/venv /opt/venv
COPY --from=cuda-build /app /app
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /app
RUN useradd --create-home hybridserve && mkdir -p out && chown hybridserve out
USER hybridserve
EXPOSE 8000 8265 6379
# configs/local.yaml is the CPU machine's: one replica on one GPU here, with the CUDA kernels
CMD ["hybridserve", "serve", "--host", "0.0.0.0", "--port", "8000", "--set", "engine.device=cuda", \
     "--set", "engine.kernels=auto", "--set", "cluster.num_gpus_per_rank=1", "--set", "cluster.num_replicas=1", \
     "--set", "cluster.min_replicas=1", "--set", "cluster.max_replicas=1"]
