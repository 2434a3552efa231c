"""The only package that imports `megatron.core`: model build, parallel state, DDP/optimizer stack,
the CPU compatibility layer and dataset adapters. Submodules import megatron lazily where they
can."""

from megatron_mecefo.mcore import eager_jit as _eager_jit

_eager_jit.install()
