"""Build a LLaMA-style megatron-core `GPTModel` from a `ModelConfig`.

Transformer Engine spec when TE and CUDA are present (or `spec: te`), the local spec otherwise.
RMSNorm, SwiGLU, RoPE, no biases, untied embeddings. Weights are initialised on the CPU RNG with the
same seed on every rank (`use_cpu_initialization`), so DP replicas start identical.
"""

from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F

from megatron_mecefo.errors import ConfigError
from megatron_mecefo.mcore.config import ModelConfig


def transformer_engine_available() -> bool:
    """True when TE's PyTorch extension can be used (CUDA present and the module importable)."""
    if not torch.cuda.is_available() or importlib.util.find_spec("transformer_engine") is None:
        return False
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # a broken TE install (e.g. the empty PyPI meta package) raises RuntimeError
        return False
    return True


def resolve_spec(spec: str) -> str:
    """'auto' -> 'te' or 'local'; 'te' without TE is a ConfigError."""
    if spec == "auto":
        return "te" if transformer_engine_available() else "local"
    if spec == "te" and not transformer_engine_available():
        raise ConfigError(
            "model.spec=te needs CUDA and Transformer Engine (use the NGC PyTorch image); "
            "use model.spec=local or auto"
        )
    return spec


def build_transformer_config(cfg: ModelConfig, *, tp_size: int, bf16: bool):
    """The megatron `TransformerConfig` for `cfg`."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        ffn_hidden_size=cfg.ffn_hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_query_groups,
        normalization="RMSNorm",
        layernorm_epsilon=cfg.norm_epsilon,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        hidden_dropout=cfg.hidden_dropout,
        attention_dropout=cfg.attention_dropout,
        init_method_std=cfg.init_method_std,
        tensor_model_parallel_size=tp_size,
        use_cpu_initialization=True,
        bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        pipeline_dtype=torch.bfloat16 if bf16 else torch.float32,
        apply_rope_fusion=False,
    )


def build_gpt_model(cfg: ModelConfig, *, tp_size: int = 1, bf16: bool = False):
    """Build the GPTModel (un-wrapped). Returns `(model, transformer_config, spec_name)`."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    spec_name = resolve_spec(cfg.spec)
    tcfg = build_transformer_config(cfg, tp_size=tp_size, bf16=bf16)
    if spec_name == "te":
        layer_spec = get_gpt_layer_with_transformer_engine_spec()
    else:
        layer_spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    if cfg.vocab_size % tp_size:
        raise ConfigError(
            f"model.vocab_size ({cfg.vocab_size}) must be divisible by tensor_model_parallel_size "
            f"({tp_size})"
        )
    model = GPTModel(
        config=tcfg,
        transformer_layer_spec=layer_spec,
        vocab_size=cfg.vocab_size,
        max_sequence_length=cfg.seq_length,
        pre_process=True,
        post_process=True,
        share_embeddings_and_output_weights=False,
        position_embedding_type="rope",
        rotary_base=cfg.rotary_base,
    )
    if bf16:
        from megatron.core.transformer.module import Float16Module

        model = Float16Module(tcfg, model)
    return model, tcfg, spec_name


def preload_megatron() -> None:
    """Import the megatron-core modules a training run uses (a warm spare pays this up front)."""
    import megatron.core.distributed  # noqa: F401
    import megatron.core.models.gpt  # noqa: F401
    import megatron.core.optimizer  # noqa: F401
    import megatron.core.pipeline_parallel  # noqa: F401
    import megatron.core.tensor_parallel  # noqa: F401
