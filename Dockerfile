# syntax=docker/dockerfile:1.7
# megatron-mecefo on the NGC PyTorch image (CUDA, NCCL, torch, Transformer Engine and Apex come
# from the image and are never replaced).
#   docker build -t megatron-mecefo .                              # default NGC_TAG below
#   docker build --build-arg NGC_TAG=26.01-py3 -t megatron-mecefo .
# Running it (one node with docker, a cluster with enroot/pyxis): README.md, "Cluster: Slurm and
# Docker". Linted with hadolint in the test suite; no Docker engine was available to build it.
#
# NGC_TAG: megatron-core 0.16.1 (pinned in pyproject.toml) wants Transformer Engine >= 2.9 and
# < 2.12; move NGC_TAG and megatron-core together.
ARG NGC_TAG=25.12-py3
FROM nvcr.io/nvidia/pytorch:${NGC_TAG}

# Extras of pyproject.toml to install on top of the runtime dependencies ("gpu": triton, which the
# image already ships, so in practice nothing; add ",tensorboard" or ",wandb" as needed).
ARG MECEFO_EXTRAS=gpu

ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1 \
    OMP_NUM_THREADS=1

SHELL ["/bin/bash", "-o", "pipefail", "-c"]
WORKDIR /workspace/megatron-mecefo

# 1. Every package of the image, pinned at its image version, becomes a constraint for all later
#    installs: torch, transformer_engine, apex, triton, numpy, ... can be neither upgraded nor
#    replaced (a conflict fails the build instead). megatron-core is ours to choose.
RUN pip list --format=freeze | grep -v -i -E '^megatron[-_]core==' > /opt/image-constraints.txt

# 2. Our dependencies from pyproject.toml: a package the image already has is requested by name
#    only (the constraint keeps the image's version: torch, triton, numpy, ...); the others keep
#    the exact pin the CPU CI tests (megatron-core==0.16.1, sentencepiece, ...).
COPY pyproject.toml setup.py README.md ./
RUN python -c 'import re, sys, tomllib; \
key = lambda req: re.split(r"[=<>!~;@\[ ]", req.strip(), maxsplit=1)[0].lower().replace("_", "-"); \
project = tomllib.load(open("pyproject.toml", "rb"))["project"]; \
extras = [project["optional-dependencies"][e] for e in sys.argv[1].split(",") if e]; \
wanted = project["dependencies"] + sum(extras, []); \
image = {key(line) for line in open("/opt/image-constraints.txt")}; \
print("\n".join(key(req) if key(req) in image else req for req in wanted))' \
    "${MECEFO_EXTRAS}" > /opt/mecefo-requirements.txt
RUN cat /opt/mecefo-requirements.txt \
    && pip install --constraint /opt/image-constraints.txt --requirement /opt/mecefo-requirements.txt

# 3. The package itself, without dependency resolution (step 2 did that). The image's Python is
#    3.12; pyproject declares 3.11 (what the CPU CI runs), hence --ignore-requires-python.
COPY . .
RUN pip install --no-deps --no-build-isolation --ignore-requires-python --editable . \
    && python -c "import torch, transformer_engine, megatron.core, megatron_mecefo; \
print('torch', torch.__version__, 'TE', transformer_engine.__version__)"

CMD ["bash"]
