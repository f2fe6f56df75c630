# cbq worker/producer image. The default base is CPU-only; for GPUs build with a CUDA PyTorch base:
#   docker build --build-arg BASE=pytorch/pytorch:2.11.0-cuda13.0-cudnn9-runtime -t cbq .
ARG BASE=python:3.11-slim
FROM ${BASE}
WORKDIR /app
# torch first, so the project's range never pulls a different build (the CUDA base already has one).
ARG TORCH_SPEC="torch==2.13.0"
RUN python -c "import torch" 2>/dev/null || pip install --no-cache-dir "${TORCH_SPEC}" --index-url https://download.pytorch.org/whl/cpu
COPY pyproject.toml README.md ./
COPY schemas schemas
COPY producer producer
COPY worker worker
COPY examples examples
RUN pip install --no-cache-dir .
ENTRYPOINT ["cbq"]
CMD ["--help"]
