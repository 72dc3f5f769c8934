# One image for every role (api, worker, migrate). For GPU workers build FROM a CUDA runtime image
# (e.g. --build-arg BASE=pytorch/pytorch:2.7.0-cuda12.6-cudnn9-runtime) and drop the CPU torch line.
ARG BASE=python:3.11-slim
FROM ${BASE}

ARG TORCH_SPEC="torch==2.13.0"
ARG TORCH_INDEX="https://download.pytorch.org/whl/cpu"
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
WORKDIR /app

RUN pip install "${TORCH_SPEC}" --index-url "${TORCH_INDEX}" || pip install "${TORCH_SPEC}"
COPY pyproject.toml README.md ./
COPY api api
COPY workers workers
COPY engine engine
COPY kernels kernels
COPY migrations migrations
COPY pagedbatch pagedbatch
RUN pip install ".[triton,s3]" || pip install ".[s3]"

EXPOSE 8000
CMD ["pagedbatch", "api", "--port", "8000"]
