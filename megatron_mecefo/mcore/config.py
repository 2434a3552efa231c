"""Model-shape and parallel-layout configs (pure dataclasses; no megatron import)."""

from __future__ import annotations

import dataclasses
from typing import Literal


@dataclasses.dataclass(kw_only=True)
class ModelConfig:
    """A LLaMA-style decoder: RMSNorm, SwiGLU, RoPE, no biases, untied embeddings."""

    name: str = "custom"
    """Label used in logs and benchmark tables."""
    num_layers: int = 2
    """Transformer layers."""
    hidden_size: int = 64
    """Model width d."""
    ffn_hidden_size: int = 172
    """SwiGLU inner width f (linear_fc1 is 2f x d, linear_fc2 is d x f)."""
    num_attention_heads: int = 4
    """Attention heads; must divide hidden_size."""
    num_query_groups: int | None = None
    """Grouped-query attention groups; None = multi-head attention."""
    vocab_size: int = 512
    """Embedding rows; must be >= the tokenizer's vocabulary."""
    seq_length: int = 64
    """Training sequence length (also the RoPE maximum)."""
    rotary_base: int = 10000
    """RoPE base."""
    norm_epsilon: float = 1e-5
    """RMSNorm epsilon."""
    init_method_std: float = 0.02
    """Std of the normal weight init."""
    hidden_dropout: float = 0.0
    """Dropout after attention/FFN."""
    attention_dropout: float = 0.0
    """Dropout on attention probabilities."""
    spec: Literal["auto", "te", "local"] = "auto"
    """Layer spec: Transformer Engine ('te', needs CUDA + TE), megatron 'local', or 'auto'."""

    def __post_init__(self) -> None:
        for name in (
            "num_layers",
            "hidden_size",
            "ffn_hidden_size",
            "num_attention_heads",
            "vocab_size",
            "seq_length",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be divisible by num_attention_heads "
                f"({self.num_attention_heads})"
            )
        if self.num_query_groups is not None and self.num_attention_heads % self.num_query_groups:
            raise ValueError("num_attention_heads must be divisible by num_query_groups")
        for name in ("hidden_dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name} must be in [0, 1)")

    def num_parameters(self) -> int:
        """Parameter count (embedding + output layer + layers + final norm)."""
        d, f, layers = self.hidden_size, self.ffn_hidden_size, self.num_layers
        kv = (
            d
            if self.num_query_groups is None
            else d // self.num_attention_heads * self.num_query_groups
        )
        attn = d * (d + 2 * kv) + d * d
        ffn = 2 * f * d + d * f
        return 2 * self.vocab_size * d + layers * (attn + ffn + 2 * d) + d

    def flops_per_token(self) -> float:
        """Training FLOPs per token: 6N for the matmuls plus attention scores (MFU convention)."""
        d, s, layers = self.hidden_size, self.seq_length, self.num_layers
        dense = self.num_parameters() - self.vocab_size * d  # input embedding is a lookup
        return 6.0 * dense + 12.0 * layers * d * s


@dataclasses.dataclass(kw_only=True)
class ParallelConfig:
    """Process layout. DP size is world_size / (TP x PP)."""

    tensor_model_parallel_size: int = 1
    """TP degree."""
    pipeline_model_parallel_size: int = 1
    """PP degree: each replica is a pipeline of this many stages (megatron's 1F1B schedule);
    `model.num_layers` must divide by it (or see the two fields below)."""
    num_layers_in_first_pipeline_stage: int | None = None
    """Layers of the first stage when it holds fewer than the others (it also holds the
    embedding); null: an even split. Llama 3 405B: 126 layers on 16 stages, 7 + 14 x 8 + 7."""
    num_layers_in_last_pipeline_stage: int | None = None
    """Layers of the last stage (it also holds the output layer and the loss); null: even."""
    virtual_pipeline_model_parallel_size: int | None = None
    """Model chunks per stage for megatron's interleaved schedule: not supported (null only)."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """torch.distributed backend: auto = nccl with CUDA, gloo without."""
    timeout_s: float = 120.0
    """Collective timeout."""

    def __post_init__(self) -> None:
        if self.tensor_model_parallel_size < 1:
            raise ValueError("tensor_model_parallel_size must be >= 1")
        if self.pipeline_model_parallel_size < 1:
            raise ValueError("pipeline_model_parallel_size must be >= 1")
        if self.virtual_pipeline_model_parallel_size is not None:
            raise ValueError(
                "virtual_pipeline_model_parallel_size (megatron's interleaved schedule) is not "
                "supported: it needs every step's micro-batch count per rank to be >= PP with a "
                "remainder of 0 or >= PP, and takeover plans give ranks between M and 2M "
                "micro-batches; the trainer also holds one model chunk per rank (README, "
                "Pipeline parallelism)"
            )
        uneven = (self.num_layers_in_first_pipeline_stage, self.num_layers_in_last_pipeline_stage)
        if any(n is not None for n in uneven) and self.pipeline_model_parallel_size < 3:
            raise ValueError(
                "num_layers_in_first/last_pipeline_stage need pipeline_model_parallel_size >= 3"
            )
        if any(n is not None and n < 1 for n in uneven):
            raise ValueError("num_layers_in_first/last_pipeline_stage must be >= 1")
        if self.timeout_s <= 0:
            raise ValueError("timeout_s must be > 0")


def check_layout(world_size: int, tp: int, pp: int) -> None:
    """`DistributedSetupError` (exit 4) unless `world_size` ranks divide into TP x PP."""
    from megatron_mecefo.errors import DistributedSetupError

    if world_size < 1 or world_size % (tp * pp):
        raise DistributedSetupError(
            f"world size {world_size} is not divisible by TP x PP = {tp} x {pp}; launch a "
            f"multiple of {tp * pp} processes or change parallel.tensor_model_parallel_size"
        )
