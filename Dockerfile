# One image for every role (api, worker, migrate). For GPU workers build FROM a CUDA runtime image
# (e.g. --build-arg BASE=pytorch/pytorch:2.7.0-cuda12.6-cudnn9-runtime) and drop the CPU torch line.
ARG BASE=python:3.11-slim
FROM ${BASE}

ARG TORCH_SPEC="torch==2.13.0"
ARG TORCH_INDEX="https://download.pytorch.org/whl/cpu"
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
WORKDIR /app

# g++: the CPU engine compiles its kernels with torch.compile (inductor writes C++); without it they
# run eagerly, several times slower, with a warning.
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*
RUN pip install "${TORCH_SPEC}" --index-url "${TORCH_INDEX}" || pip install "${TORCH_SPEC}"
COPY pyproject.toml README.md ./
# every package of pyproject's list (tests/deploy/test_dockerfile.py keeps the two in step)
COPY api api
COPY batchfile batchfile
COPY broker broker
COPY engine engine
COPY pagedbatch_kernels pagedbatch_kernels
COPY migrations migrations
COPY pagedbatch pagedbatch
COPY settings settings
COPY store store
COPY workers workers
RUN pip install ".[triton,s3]" || pip install ".[s3]"

EXPOSE 8000
CMD ["pagedbatch", "api", "--port", "8000"]
