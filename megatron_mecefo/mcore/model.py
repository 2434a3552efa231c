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


def build_transformer_config(
    cfg: ModelConfig, *, tp_size: int, bf16: bool, pp_size: int = 1, stages: tuple = (None, None)
):
    """The megatron `TransformerConfig` for `cfg` (`stages`: layers of the first and last
    pipeline stage when they differ from an even split)."""
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
        pipeline_model_parallel_size=pp_size,
        num_layers_in_first_pipeline_stage=stages[0],
        num_layers_in_last_pipeline_stage=stages[1],
        use_cpu_initialization=True,
        # build_gpt_model sets every parameter afterwards (init_layout_independent): megatron's
        # own draw would be thrown away (half of a model build). Its initialisation still runs
        # (perform_initialization=False would also skip the tensor-parallel attributes it sets)
        init_method=_no_draw,
        output_layer_init_method=_no_draw,
        embedding_init_method=_no_draw,
        bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        pipeline_dtype=torch.bfloat16 if bf16 else torch.float32,
        apply_rope_fusion=False,
    )


def _no_draw(tensor) -> None:
    """Megatron's init method, left to `init_layout_independent`."""


def build_gpt_model(
    cfg: ModelConfig,
    *,
    tp_size: int = 1,
    bf16: bool = False,
    pp_size: int = 1,
    stages: tuple = (None, None),
    seed: int = 0,
    init: bool = True,
):
    """Build this rank's GPTModel (its pipeline stage, un-wrapped), initialised the same whatever
    the TP x PP layout (`init_layout_independent`; `init=False`: left unset, for a rank that
    takes every weight from saved or a peer's state). Returns `(model, transformer_config,
    spec_name)`."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    spec_name = resolve_spec(cfg.spec)
    tcfg = build_transformer_config(cfg, tp_size=tp_size, bf16=bf16, pp_size=pp_size, stages=stages)
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
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=False,
        position_embedding_type="rope",
        rotary_base=cfg.rotary_base,
    )
    if init:
        init_layout_independent(
            model, cfg, seed, tp_rank=ps.get_tensor_model_parallel_rank(), tp_size=tp_size
        )
    if bf16:
        from megatron.core.transformer.module import Float16Module

        model = Float16Module(tcfg, model)
    return model, tcfg, spec_name


_OUTPUT_PROJECTIONS = (".linear_proj.weight", ".linear_fc2.weight")
_NORMS = ("layernorm.weight", "layer_norm_weight", "final_layernorm.weight")


def init_layout_independent(model, cfg: ModelConfig, seed: int, *, tp_rank: int, tp_size: int):
    """Re-initialise every parameter from (seed, its name in the whole model), as megatron's
    CPU initialisation would (normal(0, std); output projections std / sqrt(2 x layers); norms
    1), so that any TP x PP layout starts from the same weights: a pipeline stage's layers are
    named by their global index, and a TP shard is its slice of the full tensor. Megatron's own
    initialisation draws from one generator in construction order, so a later stage would start
    its layers where the first stage did (and differ from the unpipelined model)."""
    import hashlib
    import math

    layers = getattr(getattr(model, "decoder", None), "layers", [])
    offset = layers[0].layer_number - 1 if len(layers) else 0
    std = cfg.init_method_std
    for name, param in model.named_parameters():
        global_name = _global_name(name, offset)
        if global_name.endswith(_NORMS):
            value = torch.ones(param.shape)
        else:
            full = list(param.shape)
            dim = getattr(param, "partition_dim", -1) if getattr(param, "tensor_model_parallel",
                                                                  False) else -1  # fmt: skip
            if dim >= 0:
                full[dim] *= tp_size
            digest = hashlib.sha256(f"{seed}/{global_name}".encode()).digest()
            gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))
            scale = std / math.sqrt(2.0 * cfg.num_layers) if name.endswith(
                _OUTPUT_PROJECTIONS
            ) else std  # fmt: skip
            value = torch.empty(full).normal_(0.0, scale, generator=gen)
            if dim >= 0:  # this rank's slice, as megatron's CPU init takes it (with its stride)
                stride = getattr(param, "partition_stride", 1)
                pieces = value.split(full[dim] // tp_size // stride, dim=dim)
                value = torch.cat(pieces[tp_rank::tp_size], dim=dim)
        with torch.no_grad():
            param.copy_(value.to(param.dtype))


def _global_name(name: str, layer_offset: int) -> str:
    """`decoder.layers.<local>.rest` -> `decoder.layers.<global>.rest`."""
    parts = name.split(".")
    if len(parts) > 2 and parts[0] == "decoder" and parts[1] == "layers":
        parts[2] = str(int(parts[2]) + layer_offset)
    return ".".join(parts)


def preload_megatron() -> None:
    """Import the megatron-core modules a training run uses (a warm spare pays this up front)."""
    import megatron.core.distributed  # noqa: F401
    import megatron.core.models.gpt  # noqa: F401
    import megatron.core.models.gpt.gpt_layer_specs  # noqa: F401
    import megatron.core.optimizer  # noqa: F401
    import megatron.core.pipeline_parallel  # noqa: F401
    import megatron.core.tensor_parallel  # noqa: F401
