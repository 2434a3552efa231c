"""Degraded-mode hooks on megatron TransformerLayers and the controller the trainer drives.

`install_degraded_mode` replaces each layer's `forward` with a thin dispatcher: exact mode calls the
original bound method unchanged (bit-identical, one attribute read), degraded mode runs the
attention branch without a graph (technique 1, in the layers `mecefo.skip_attention_layers` names;
the others keep their attention graph) and the FFN through `ffn.degraded_ffn` (techniques 2-3).
The mode is the explicit module attribute `layer.mecefo_hooks.degraded`, set only by the
controller; each micro-batch's graph records the mode it was built with, so its backward follows it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import Tensor

from megatron_mecefo.errors import ConfigError
from megatron_mecefo.mecefo.config import MecefoConfig
from megatron_mecefo.mecefo.ffn import (
    FfnCall,
    FfnWeights,
    degraded_ffn,
    resolve_ffn_weights,
    rms_norm,
)
from megatron_mecefo.mecefo.lowrank import InputSecondMoment, SingularVectorCache
from megatron_mecefo.mecefo.masking import is_attention_branch_param
from megatron_mecefo.plan.techniques import DegradedTechniques

_HOOKS_ATTR = "mecefo_hooks"


class _ResidualOnly(torch.autograd.Function):
    """Returns the attention-branch result computed under no_grad; its grad goes to the residual.

    Forward value is exactly the exact-mode `h + Attn(LN1(h))` (same ops, same order); backward is
    the identity to `h`, i.e. the attention branch is a constant (MeCeFO's skip-connection).
    """

    @staticmethod
    def forward(ctx, residual: Tensor, branch_result: Tensor) -> Tensor:  # noqa: D102
        return branch_result

    @staticmethod
    def backward(ctx, grad: Tensor):  # noqa: D102
        return grad, None


@dataclasses.dataclass
class LayerHooks:
    """Degraded-mode state of one TransformerLayer (attached as `layer.mecefo_hooks`)."""

    layer_index: int
    """Position among the whole model's transformer layers, on any pipeline stage (seeds the
    randomized SVD)."""
    original_forward: Callable
    """The layer's bound `forward` before installation."""
    installed: DegradedTechniques
    """Techniques installed (config switches): FFN weights and V caches exist for these only."""
    active: DegradedTechniques
    """Techniques of the next degraded forward, a subset of `installed` (set by the controller
    from the plan's `MicroBatchTask.techniques`; default `installed`)."""
    ffn_weights: FfnWeights | None
    v1_cache: SingularVectorCache | None
    v2_cache: SingularVectorCache | None
    skips_attention: bool = True
    """In `mecefo.skip_attention_layers`: technique 1, when active, skips this layer's attention
    backward; False: its attention runs with its graph in degraded mode too."""
    degraded: bool = False
    """Set by the controller before each micro-batch forward."""
    bucket: int = 0
    """Current tau-bucket (step // tau), set by the controller at each step start."""
    collect: list[bool] = dataclasses.field(default_factory=lambda: [False, False])
    """activation basis: (fc1, fc2) input statistics still to be taken this step (the first
    exact micro-batch of each step feeds them)."""
    stat_handles: list = dataclasses.field(default_factory=list)
    """Forward pre-hooks on linear_fc1/linear_fc2 collecting input statistics."""

    @property
    def skip_attention(self) -> bool:
        """Technique 1 applies to this layer in the next degraded forward."""
        return self.active.skip_attention_backward and self.skips_attention

    @property
    def is_noop(self) -> bool:
        """No active technique applies to this layer: degraded == exact."""
        return not (self.skip_attention or self.functional_ffn)

    @property
    def functional_ffn(self) -> bool:
        """Recompute or low-rank active: run the FFN through `degraded_ffn`, else megatron's."""
        return self.active.recompute_ffn or self.active.lowrank_ffn_grad


def _split_hidden_states(args: tuple, kwargs: dict) -> tuple[Tensor, tuple, dict]:
    if args:
        return args[0], args[1:], kwargs
    kwargs = dict(kwargs)
    return kwargs.pop("hidden_states"), args, kwargs


def degraded_layer_forward(layer: torch.nn.Module, hooks: LayerHooks, *args, **kwargs):
    """TransformerLayer.forward in degraded mode; returns `(output, context)` like megatron."""
    kwargs.pop("dynamic_inference_decode_only", None)
    hidden_states, rest, kwargs = _split_hidden_states(args, kwargs)
    if hooks.skip_attention:
        # Attention branch (input norm, attention, bias-dropout-add) runs without a graph: no
        # attention activations kept, no attention/input-norm gradients; grad flows via residual.
        with torch.no_grad():
            attn_result, context = layer._forward_attention(hidden_states, *rest, **kwargs)
        hidden = _ResidualOnly.apply(hidden_states, attn_result)
    else:
        hidden, context = layer._forward_attention(hidden_states, *rest, **kwargs)
    if not hooks.functional_ffn:
        output = layer._forward_mlp(
            hidden, kwargs.get("inference_context"), padding_mask=kwargs.get("padding_mask")
        )
        return output, context
    fc1, fc2 = hooks.ffn_weights.fc1, hooks.ffn_weights.fc2
    lowrank = hooks.active.lowrank_ffn_grad
    call = FfnCall(
        weights=hooks.ffn_weights,
        v1=hooks.v1_cache.get(fc1, hooks.bucket) if lowrank and hooks.v1_cache else None,
        v2=hooks.v2_cache.get(fc2, hooks.bucket) if lowrank and hooks.v2_cache else None,
        recompute=hooks.active.recompute_ffn,
    )
    mlp_out = degraded_ffn(hidden, call)  # [s, b, d], the MLP branch only
    with layer.bias_dropout_add_exec_handler():  # residual + dropout(mlp_out), as megatron does
        output = layer.mlp_bda(layer.training, layer.config.bias_dropout_fusion)(
            (mlp_out, None), hidden, layer.hidden_dropout
        )
    return output, context


def _install_input_statistics(layer: torch.nn.Module, hooks: LayerHooks) -> None:
    """activation basis: forward pre-hooks on the FFN linears that fold the input of the first
    exact, gradient-building micro-batch of each step into its cache's second moment. Degraded
    micro-batches (which run the modules only when neither recompute nor low-rank is active) and
    evaluation (no grad) do not feed the statistics."""
    weights = hooks.ffn_weights
    fc1_mod, fc2_mod = layer.mlp.linear_fc1, layer.mlp.linear_fc2
    # TE fuses the pre-MLP RMSNorm into linear_fc1: its input is un-normalised, apply the norm
    fused_norm = weights.norm_weight is getattr(fc1_mod, "layer_norm_weight", None)
    norm = (lambda x: rms_norm(x, weights, weights.norm_weight)) if fused_norm else None

    def make(index: int, cache: SingularVectorCache, transform):
        def pre_hook(module, args, kwargs):
            if hooks.collect[index] and not hooks.degraded and torch.is_grad_enabled():
                hooks.collect[index] = False
                x = args[0] if args else kwargs["input_"]
                cache.stats.update(x, transform)

        return pre_hook

    for index, (mod, cache, transform) in enumerate(
        ((fc1_mod, hooks.v1_cache, norm), (fc2_mod, hooks.v2_cache, None))
    ):
        handle = mod.register_forward_pre_hook(make(index, cache, transform), with_kwargs=True)
        hooks.stat_handles.append(handle)


def _make_dispatcher(layer: torch.nn.Module, hooks: LayerHooks) -> Callable:
    original = hooks.original_forward

    def forward(*args, **kwargs):
        if not hooks.degraded or hooks.is_noop:  # all techniques off: degraded == exact
            return original(*args, **kwargs)
        return degraded_layer_forward(layer, hooks, *args, **kwargs)

    return forward


def find_transformer_layers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """Megatron TransformerLayers in `model` (any wrapper), by duck typing, in module order."""
    return [
        (name, m)
        for name, m in model.named_modules()
        if hasattr(m, "_forward_attention") and hasattr(m, "_forward_mlp") and hasattr(m, "mlp")
    ]


class DegradedModeController:
    """Switches every hooked layer between exact and degraded mode; owns the V caches.

    The trainer calls `on_step_start(step)` once per step and `set_degraded(flag)` before each
    micro-batch forward (the flag is captured by that micro-batch's graph).
    """

    def __init__(self, cfg: MecefoConfig, layers: list[tuple[str, torch.nn.Module]]):
        self._cfg = cfg
        self._layers = layers
        self._degraded = False
        self._step = 0
        self._attention_params = _attention_params_by_skip(layers)
        self._skips_every_layer = all(skips for skips in self._attention_params.values())

    @property
    def enabled(self) -> bool:
        """False when `cfg.enabled` is off (nothing installed)."""
        return self._cfg.enabled

    @property
    def degraded(self) -> bool:
        """Mode the next micro-batch forward will run in."""
        return self._degraded

    @property
    def layer_names(self) -> list[str]:
        return [name for name, _ in self._layers]

    def set_degraded(self, flag: bool, techniques: DegradedTechniques | None = None) -> None:
        """Exact (False) or degraded (True) for the micro-batches forwarded from now on.

        Args:
            flag: Degraded mode on.
            techniques: Degraded only: the techniques to use (a plan's `MicroBatchTask.
                techniques`), a subset of the configured switches; None = all configured ones.

        Raises:
            ConfigError: `flag` is True but MeCeFO is disabled (`mecefo.enabled=false`), or
                `techniques` asks for one the config switched off (not installed).
        """
        if flag and not self._cfg.enabled:
            raise ConfigError(
                "a step plan asked for degraded (MeCeFO) micro-batches, but mecefo.enabled=false; "
                "set mecefo.enabled=true or use a takeover policy without degraded mode (spread)"
            )
        installed = self._cfg.techniques
        active = installed if techniques is None or not flag else techniques
        if not active.issubset(installed):
            raise ConfigError(
                f"a step plan asked for degraded techniques {active.key!r}, but the mecefo config "
                f"installs only {installed.key!r}; switch them on in `mecefo`"
            )
        self._degraded = bool(flag)
        for _, layer in self._layers:
            hooks = getattr(layer, _HOOKS_ATTR)
            hooks.degraded = self._degraded
            hooks.active = active

    def on_step_start(self, step: int) -> None:
        """Record the step; V of every layer is refreshed lazily when step // tau changes."""
        self._step = int(step)
        bucket = self._step // self._cfg.tau
        for _, layer in self._layers:
            hooks = getattr(layer, _HOOKS_ATTR)
            hooks.bucket = bucket
            if hooks.stat_handles and self._step % self._cfg.activation_stats_interval == 0:
                hooks.collect = [True, True]

    @property
    def skip_layer_indices(self) -> frozenset[int]:
        """Layers (0-based, model order) whose attention backward degraded mode skips when
        technique 1 is active (empty when it is switched off or nothing is installed)."""
        if not self._cfg.skip_attention_backward:
            return frozenset()
        hooks = [getattr(layer, _HOOKS_ATTR) for _, layer in self._layers]
        return frozenset(h.layer_index for h in hooks if h.skips_attention)

    def is_masked_param(self, name: str) -> bool:
        """Whether the trainer averages this parameter's grad over exact replicas only.

        True for attention-branch parameters (input norm, self-attention) of the layers in
        `mecefo.skip_attention_layers` when the attention-backward skip is on: only those lack
        gradients from degraded micro-batches. Names may carry wrapper prefixes such as `module.`.

        Raises:
            ValueError: with a subset of layers skipping, an attention-branch name that is none of
                the hooked layers' parameters (its layer, hence its scaling, is unknown).
        """
        if not (self._cfg.enabled and self._cfg.skip_attention_backward):
            return False
        if self._skips_every_layer:
            return is_attention_branch_param(name)
        if not is_attention_branch_param(name):
            return False
        skips = self._attention_params.get(_strip_wrappers(name))
        if skips is None:
            raise ValueError(
                f"is_masked_param: {name!r} is an attention-branch parameter of no hooked "
                "transformer layer; with mecefo.skip_attention_layers="
                f"{self._cfg.skip_attention_layers!r} its layer decides whether it is masked"
            )
        return skips

    def singular_vectors(self, layer_index: int) -> tuple[Tensor | None, Tensor | None]:
        """Cached (V1, V2) of this stage's `layer_index`-th layer (None before its first degraded
        forward or when off)."""
        hooks = getattr(self._layers[layer_index][1], _HOOKS_ATTR)
        v1 = hooks.v1_cache.vectors if hooks.v1_cache else None
        v2 = hooks.v2_cache.vectors if hooks.v2_cache else None
        return v1, v2

    def basis_sources(self) -> list[tuple[str | None, str | None]]:
        """Per layer, where the cached (V1, V2) came from: "weight_svd", "activation" or None."""
        out = []
        for _, layer in self._layers:
            hooks = getattr(layer, _HOOKS_ATTR)
            caches = (hooks.v1_cache, hooks.v2_cache)
            out.append(tuple(c.source if c else None for c in caches))
        return out

    def clear_caches(self) -> None:
        """Drop every cached V and input statistic (call after loading weights from a checkpoint
        or a peer)."""
        for _, layer in self._layers:
            hooks = getattr(layer, _HOOKS_ATTR)
            for cache in (hooks.v1_cache, hooks.v2_cache):
                if cache is not None:
                    cache.clear()

    def uninstall(self) -> None:
        """Restore every layer's original forward."""
        self.set_degraded(False)
        for _, layer in self._layers:
            for handle in getattr(layer, _HOOKS_ATTR).stat_handles:
                handle.remove()
            del layer.forward  # the instance attribute; the class method shows through again
            delattr(layer, _HOOKS_ATTR)
        self._layers = []


def _strip_wrappers(name: str) -> str:
    """A parameter name without the `module.` prefixes DDP / Float16Module wrappers add."""
    while name.startswith("module."):
        name = name[len("module.") :]
    return name


def _attention_params_by_skip(layers: list[tuple[str, torch.nn.Module]]) -> dict[str, bool]:
    """Attention-branch parameter names (wrapper prefixes stripped) of every hooked layer, taken
    from the layer module's own parameters, -> whether that layer skips attention backward."""
    out = {}
    for layer_name, layer in layers:
        skips = getattr(layer, _HOOKS_ATTR).skips_attention
        for param_name, _ in layer.named_parameters():
            if is_attention_branch_param(param_name):
                out[_strip_wrappers(f"{layer_name}.{param_name}")] = skips
    return out


def install_degraded_mode(model: torch.nn.Module, cfg: MecefoConfig) -> DegradedModeController:
    """Hook every TransformerLayer of `model` for degraded mode and return the controller.

    Args:
        model: A megatron GPTModel, possibly wrapped (DDP, Float16Module).
        cfg: MeCeFO switches. With `cfg.enabled` False nothing is installed and the controller's
            `set_degraded(True)` raises.

    Returns:
        The controller (exact mode).

    Raises:
        ConfigError: `cfg.skip_attention_layers` names a layer the model does not have.
        ValueError: no TransformerLayer found or hooks already installed.
        NotImplementedError: a layer the degraded FFN cannot handle (MoE, biases, sequence
            parallelism).
    """
    if not cfg.enabled:
        return DegradedModeController(cfg, [])
    layers = find_transformer_layers(model)
    if not layers:
        raise ValueError("install_degraded_mode: no megatron TransformerLayer found in the model")
    # a pipeline stage holds some of the layers: index them as in the whole model
    first = getattr(layers[0][1], "layer_number", 1) - 1
    total = getattr(getattr(layers[0][1], "config", None), "num_layers", None) or len(layers)
    try:
        skip_layers = cfg.skip_layer_indices(total)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    functional_ffn = cfg.recompute_ffn or cfg.lowrank_ffn_grad
    for index, (name, layer) in enumerate(layers, start=first):
        if hasattr(layer, _HOOKS_ATTR):
            raise ValueError(f"degraded-mode hooks are already installed on {name}")
        weights = resolve_ffn_weights(layer) if functional_ffn else None
        v1_cache = v2_cache = None
        if weights is not None and cfg.lowrank_ffn_grad:
            v1_cache, v2_cache = (
                SingularVectorCache(
                    rank=cfg.resolve_rank(w.shape[1]),
                    method=cfg.svd_method,
                    seed=2 * index + j,
                    stats=InputSecondMoment(max_tokens=cfg.activation_stats_tokens, window=cfg.tau)
                    if cfg.lowrank_basis == "activation"
                    else None,
                )
                for j, w in enumerate((weights.fc1, weights.fc2))
            )
        hooks = LayerHooks(
            layer_index=index,
            original_forward=layer.forward,
            installed=cfg.techniques,
            active=cfg.techniques,
            ffn_weights=weights,
            v1_cache=v1_cache,
            v2_cache=v2_cache,
            skips_attention=index in skip_layers,
        )
        setattr(layer, _HOOKS_ATTR, hooks)
        if v1_cache is not None and v1_cache.stats is not None:
            _install_input_statistics(layer, hooks)
        layer.forward = _make_dispatcher(layer, hooks)
    return DegradedModeController(cfg, layers)
