# cbq worker/producer image. The default base is CPU-only; for GPUs build with a CUDA PyTorch base:
#   docker build --build-arg BASE=pytorch/pytorch:2.11.0-cuda13.0-cudnn9-runtime -t cbq .
ARG BASE=python:3.11-slim
FROM ${BASE}
WORKDIR /app
# torch first, so the project's range never pulls a different build (the CUDA base already has one).
# For a small CPU-only image pass PyTorch's CPU wheel index: --build-arg TORCH_PIP_ARGS="--index-url <cpu index>".
ARG TORCH_SPEC="torch==2.13.0"
ARG TORCH_PIP_ARGS=""
RUN python -c "import torch" 2>/dev/null || pip install --no-cache-dir "${TORCH_SPEC}" ${TORCH_PIP_ARGS}
COPY pyproject.toml README.md ./
COPY schemas schemas
COPY producer producer
COPY worker worker
COPY examples examples
RUN pip install --no-cache-dir ".[server]"
ENTRYPOINT ["cbq"]
CMD ["--help"]
