# syntax=docker/dockerfile:1.7
# megatron-mecefo on the NGC PyTorch image (CUDA, NCCL, torch, Transformer Engine and Apex come
# from the image and are never replaced).
#   docker build -t megatron-mecefo .                              # default NGC_TAG below
#   docker build --build-arg NGC_TAG=26.01-py3 -t megatron-mecefo .
# Running it (one node with docker, a cluster with enroot/pyxis): README.md, "Cluster: Slurm and
# Docker". Linted with hadolint in the test suite; no Docker engine was available to build it.
#
# NGC_TAG: megatron-core 0.16 (pyproject.toml: >=0.16.1,<0.17) wants Transformer Engine >= 2.9 and
# < 2.12 and the image's torch; move NGC_TAG and megatron-core together. Python is the image's
# (3.12), which pyproject's requires-python (>=3.11) admits.
ARG NGC_TAG=25.12-py3
FROM nvcr.io/nvidia/pytorch:${NGC_TAG}

# Extras of pyproject.toml to install on top of the runtime dependencies ("gpu": triton, which the
# image already ships, so in practice nothing; add ",tensorboard" or ",wandb" as needed; never
# "te": the image has Transformer Engine).
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

# 2. Our dependencies from pyproject.toml, with their ranges, under the image's constraints: a
#    package the image has stays at the image's version (and the build fails if that version is
#    outside our range); the rest resolve within pyproject's ranges. In its own layer, before the
#    sources, so that a source change does not reinstall them. tests/cluster/test_docker.py runs
#    this step's resolution against a fake image.
COPY pyproject.toml setup.py README.md ./
RUN python -c 'import sys, tomllib; \
project = tomllib.load(open("pyproject.toml", "rb"))["project"]; \
extras = [project["optional-dependencies"][e] for e in sys.argv[1].split(",") if e]; \
print("\n".join(project["dependencies"] + sum(extras, [])))' \
    "${MECEFO_EXTRAS}" > /opt/mecefo-requirements.txt
RUN cat /opt/mecefo-requirements.txt \
    && pip install --constraint /opt/image-constraints.txt --requirement /opt/mecefo-requirements.txt

# 3. The package itself, without dependency resolution (step 2 did that).
COPY . .
RUN pip install --no-deps --no-build-isolation --editable . \
    && python -c "import torch, transformer_engine, megatron.core, megatron_mecefo; \
print('torch', torch.__version__, 'TE', transformer_engine.__version__)"

CMD ["bash"]
