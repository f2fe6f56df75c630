# cbq worker/producer image. The default base is CPU-only; docker-compose.yml builds the worker on a CUDA
# PyTorch base instead:
#   docker build --build-arg BASE=pytorch/pytorch:2.11.0-cuda13.0-cudnn9-runtime -t cbq:cuda .
ARG BASE=python:3.11-slim
FROM ${BASE}
WORKDIR /app
# Triton compiles a small C launcher for its kernels the first time they run, so a CUDA worker needs a C
# compiler (and the C library headers) at run time; CPU-only images pass CC_PACKAGES="" and skip it.
ARG CC_PACKAGES="gcc libc6-dev"
RUN if [ -n "${CC_PACKAGES}" ]; then \
        apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends ${CC_PACKAGES} \
        && rm -rf /var/lib/apt/lists/*; \
    fi
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
# Run as a user, not root. The Hugging Face cache, /models and the server's /data/files are volumes in
# docker-compose.yml; creating the directories here gives a named volume mounted on them this user's ownership.
ARG UID=1000
RUN useradd --create-home --uid "${UID}" cbq \
    && mkdir -p /home/cbq/.cache/huggingface /models /data/files \
    && chown -R cbq /home/cbq/.cache /models /data
USER cbq
ENV HF_HOME=/home/cbq/.cache/huggingface
ENTRYPOINT ["cbq"]
CMD ["--help"]
