"""Model-family adapters: how to run one stock Hugging Face decoder layer over a forest.

Most families share the pre-norm decoder block

    h = h + mixer(input_layernorm(h));  h = h + mlp(post_attention_layernorm(h))

and an adapter states its own placement where it differs (post-norm olmo3, sandwich gemma3:
:meth:`FamilyAdapter.decoder_block`). The norms, the MLP and the MoE block are token-wise, so the
executor calls the model's own modules on the [1, N, D] unique tokens. Only the token mixer
(attention or linear attention) sees the sequence, and an adapter supplies a tree-aware version of
it built from the same module's parameters and helper functions (no weight copies, no changes to
the model).

An adapter is a small object holding all of one family's knowledge, so that a new family is one
new file here (and its import in ``adapters/__init__.py``): which modules hold the embedding,
layers, final norm, rotary embedding and head; which mixer function runs each layer type
(:attr:`FamilyAdapter.mixers`); which config options it refuses; which module is its MoE router
and how the family balances experts; whether its stock cache samples exactly; which stock kernels
the fp64 test reference replaces; and the tiny and benchmark configurations. Everything else
(the test matrix, the sampler's cache check, the benchmark's models) reads these declarations
from the registry. Mixers reach the sequence only through a :class:`TreeOps` context, which the
runtime implements (:mod:`harts.runtime.handoff`).
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from enum import StrEnum
from typing import Protocol

import torch
from torch import nn

from harts.adapters.vision_language import VisionLanguage, text_view

__all__ = [
    "TreeOps",
    "MoEBalancing",
    "FamilyAdapter",
    "register",
    "adapter_for",
    "supported_families",
    "adapter_for_type",
    "all_families",
    "registered_adapter",
    "FamilyUnavailable",
    "hf_function",
    "logit_softcap",
]


class TreeOps(Protocol):
    """The three sequence operations a tree mixer calls, and the rotary tables it reads.

    - ``position_embeddings``: the rotary (cos, sin) at each token's path position, or None;
    - ``attend(query [1, H, n, d], key, value, scaling, window=None, sinks=None)`` -> [1, n, H, dv]:
      each token attends to its path (with ``window``, to the last ``window`` tokens of it; with
      ``sinks`` [H], a per-head logit joins the softmax denominator);
    - ``conv(mixed [n, C], weight [C, K], bias)`` -> [n, C]: depthwise causal conv along paths;
    - ``recurrence(rec, *inputs, scale=None)`` -> [n, H, V]: any recurrent layer described by a
      :class:`~harts.ops.recurrence.Recurrence` (inputs [n, H, ...] in its order; the gated delta
      rule is :data:`~harts.ops.recurrence.DELTA_RULE`), with parent-to-child state hand-off.

    For sparse attention whose keys an indexer picks per query among the query's own path:

    - ``path_rows(rows [n, C])`` -> [m, C]: per-token rows without gradient over the *key space*
      (the m rows of the context that earlier micro-batches computed, then the n tokens of this one;
      the context's rows handed over across cuts like keys);
    - ``query_blocks``: the tokens in blocks of whole trees (``start``, ``stop``, the key-space rows
      ``keys`` they can see, and in the block's indices ``key_positions``, ``query_positions``,
      ``path_mask`` [nb, mb] and ``key_predecessors(W)``);
    - ``attend(..., select=f)``: attention restricted, block by block, to ``f(block)`` [nb, mb] bool;
    - ``carry``: a dict for what one layer leaves to a later layer of the same micro-batch (a
      selection the next layer reuses);
    - ``key_position_embeddings``: the rotary (cos, sin) [1, m, d] at every key-space row (keys
      pooled from earlier tokens are rotated at their first token's position).

    ``path_token_ids(W)`` [n, W]: the token ids of each token's last W path tokens (-1 before the
    path start), for embeddings of a token's n-gram.
    """

    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None
    query_blocks: list
    carry: dict
    key_position_embeddings: tuple[torch.Tensor, torch.Tensor]

    def attend(
        self, query, key, value, scaling: float, window: int | None = None, sinks=None, select=None
    ) -> torch.Tensor: ...

    def path_rows(self, rows: torch.Tensor) -> torch.Tensor: ...

    def path_token_ids(self, window: int) -> torch.Tensor: ...

    def conv(self, mixed: torch.Tensor, weight, bias) -> torch.Tensor: ...

    def recurrence(self, recurrence, *inputs, scale: float | None = None) -> torch.Tensor: ...


Mixer = Callable[[nn.Module, torch.Tensor, TreeOps], torch.Tensor]


class MoEBalancing(StrEnum):
    """How a family keeps its experts balanced in training."""

    AUX_LOSS = "aux_loss"  # softmax routing trained with the Switch load-balancing loss
    BIAS = "bias"  # sigmoid routing with a score-correction bias, no aux loss (DeepSeek-V3)


class FamilyAdapter:
    """Base adapter for ``*ForCausalLM`` models whose backbone is ``model.model``.

    ``mixers``: layer type (as :meth:`layer_type` names it) -> (attribute of the decoder layer that
    holds the mixer module, tree mixer function); :meth:`mixer` reads it, and a layer type missing
    from it is refused naming the ones present. ``router_class``: class name of the family's MoE
    router (None: no MoE); every router returns ``(router_logits [N, E], weights [N, k],
    indices [N, k])``. ``moe_balancing``: how the family balances its experts (None: no MoE).
    """

    model_types: tuple[str, ...] = ()
    mixers: dict[str, tuple[str, Mixer]] = {}
    # config model types that stand for one of ``model_types``: the text causal LM of a family
    # whose ``model_type`` names its multimodal wrapper (qwen3_5_text -> qwen3_5)
    config_aliases: dict[str, str] = {}
    router_class: str | None = None
    moe_balancing: MoEBalancing | None = None
    sliding_windows: bool = False  # the adapter runs sliding-window layers (along paths)
    # the family's stock forward soft-caps its logits after lm_head by config.final_logit_softcapping
    # (c * tanh(logits / c)), and harts' head readers apply it (harts.ops.logprobs ``softcap``);
    # elsewhere a set final_logit_softcapping is refused
    final_logit_softcapping: bool = False
    # the adapter's final_norm folds a logit multiplier of the causal LM's head into the hidden states
    # (falcon_h1, granitemoehybrid): right for lm_head, wrong for any other head over the backbone
    folds_logit_scale: bool = False
    modeling_package: dict[str, str] = {}  # model type -> transformers.models package, where they differ
    # model type -> (oldest transformers version, why older ones are refused): where the stock
    # modeling code of older versions is itself wrong, so no exact equivalent exists
    min_transformers: dict[str, tuple[str, str]] = {}
    # Sampling through the stock cache (harts.rl.sampler), where cached decoding does not give the
    # log-probs of a full forward (measured by tests/test_rl.py's check): why, for every transformers
    # version (``inexact_cache``), or the oldest version measured exact (``exact_cache_from``;
    # earlier ones measured wrong or not measured)
    inexact_cache: str | None = None
    exact_cache_from: str | None = None
    # names of the chunked delta-rule functions in the family's modeling file (the signature of
    # transformers' ``torch_chunk_gated_delta_rule``): the fp64 test reference swaps them for the
    # plain fp64 recurrence, as their fp32 islands would otherwise stay in it (tests/reference.py)
    stock_delta_rule_kernels: tuple[str, ...] = ()
    # model type -> fields the benchmark's "small" models set on top of the shared widths
    # (harts.bench.cases; e.g. a head_dim that grows with the hidden size)
    small_overrides: dict[str, dict] = {}
    # attribute of a decoder layer holding an attention that runs beside its mixer on the same input
    # (falcon_h1): the executor calls neither module's forward; the FLOP model counts both
    parallel_attention: str | None = None
    # the family's multimodal wrapper (its vision tower, image token, M-RoPE positions), run as its
    # text causal LM beside the tower (harts.adapters.vision_language); None: text only
    vision_language: VisionLanguage | None = None

    def check_config(self, config) -> None:
        """Raise ValueError for configurations the adapter cannot run exactly (beyond the checks
        every family shares, :func:`check_common_config`)."""

    def balancing_bias(self, model: nn.Module, layer: int, router: nn.Module) -> torch.Tensor:
        """The bias a :attr:`MoEBalancing.BIAS` family moves with the expert loads for the router of
        decoder layer ``layer``: the router's ``e_score_correction_bias`` (lfm2_moe: its MoE block's)."""
        return router.e_score_correction_bias

    def logit_softcap(self, config) -> float | None:
        """The soft-cap c the stock forward applies to the head's logits, ``c * tanh(logits / c)``,
        or None (no cap, or a family that applies none)."""
        return getattr(config, "final_logit_softcapping", None) if self.final_logit_softcapping else None

    def check_model(self, model: nn.Module) -> None:
        """Raise ValueError when the loaded model lacks a module or attribute the adapter relies on
        (a transformers version that renamed it), naming the family and the missing piece."""

    def decoder_block(self, layer: nn.Module, hidden: torch.Tensor, mix: Callable, mlp: Callable):
        """One decoder layer around its token mixer ``mix`` and its ``mlp`` (both [1, N, D] -> [1, N, D]):
        the pre-norm block ``h += mix(input_layernorm(h)); h += mlp(post_attention_layernorm(h))``."""
        hidden = hidden + mix(layer.input_layernorm(hidden))
        return hidden + mlp(layer.post_attention_layernorm(hidden))

    def backbone(self, model: nn.Module) -> nn.Module:
        return model.model

    def embedding(self, backbone: nn.Module) -> nn.Module:
        """The token embedding (nemotron_h calls it ``embeddings``)."""
        return backbone.embed_tokens

    def final_norm(self, backbone: nn.Module) -> nn.Module:
        """The norm after the last decoder layer (lfm2 calls it ``embedding_norm``)."""
        return backbone.norm

    def rotary(self, backbone: nn.Module) -> nn.Module | None:
        return getattr(backbone, "rotary_emb", None)

    def layer_type(self, model: nn.Module, index: int) -> str:
        types = getattr(model.config, "layer_types", None)
        return types[index] if types is not None else "full_attention"

    def mixer(self, layer: nn.Module, layer_type: str) -> tuple[nn.Module, Mixer]:
        """Return (module, mixer function) for one decoder layer, from :attr:`mixers`."""
        if layer_type not in self.mixers:
            raise self.unknown_layer(layer_type)
        attribute, function = self.mixers[layer_type]
        return getattr(layer, attribute), function

    def unknown_layer(self, layer_type: str) -> ValueError:
        """The error for a layer type the adapter has no mixer for, naming the ones it has."""
        return ValueError(
            f"{'/'.join(self.model_types)}: layer type {layer_type!r} is not supported "
            f"(expected {' or '.join(self.mixers) or 'none'})"
        )

    def uncalled_modules(self, layer: nn.Module, layer_type: str) -> list[nn.Module]:
        """Modules of a layer, besides the layer and its mixer, whose forward harts never calls (their
        parts run over the forest): hooks on them are refused (a :attr:`parallel_attention`)."""
        return [getattr(layer, self.parallel_attention)] if self.parallel_attention else []

    def tiny_config(self, model_type: str, **overrides):
        """A toy configuration of ``model_type`` (tests, demos, benchmarks); keywords override fields."""
        raise NotImplementedError

    def randomize_tiny(self, model: nn.Module) -> None:
        """Give a tiny model's constant-initialised parameters random values where tests need them
        to differ (:func:`harts.tiny.tiny_model`); nothing by default."""

    # the transformers auto class that builds and loads the family's model for training: its causal
    # LM, or its multimodal model where that is the only class with a language-model head
    auto_class: str = "AutoModelForCausalLM"

    def model_from_config(self, config, **kwargs) -> nn.Module:
        """The stock model of ``config`` with random weights, through :attr:`auto_class`."""
        import transformers

        return getattr(transformers, self.auto_class).from_config(config, **kwargs)


# Fields every tiny configuration shares: a 128-token vocabulary and 64-wide hidden states.
TINY_COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    rms_norm_eps=1e-6,
    initializer_range=0.08,
    pad_token_id=0,
    eos_token_id=1,
    bos_token_id=2,
)


class Scaled:
    """A module's output times a constant: an embedding multiplier, or a logit multiplier folded into
    the final norm's output (exact for a head without bias)."""

    def __init__(self, module, factor: float):
        self.module, self.factor = module, factor

    def __call__(self, x):
        return self.module(x) * self.factor


def require(family: str, obj, *names: str) -> None:
    """ValueError naming ``family`` and what ``obj`` (a module or config) lacks among ``names``."""
    missing = [name for name in names if not hasattr(obj, name)]
    if missing:
        import transformers

        raise ValueError(
            f"{family}: {type(obj).__name__} has no {', '.join(missing)} in the installed transformers "
            f"{transformers.__version__}; harts' {family} adapter relies on it "
            f"(see the README's supported range)"
        )


# every family harts has an adapter for, available or not, in registration order (the import order
# of adapters/__init__.py): the order of harts.tiny.ALL_FAMILIES
_ADAPTERS: dict[str, FamilyAdapter] = {}
_REGISTRY: dict[str, FamilyAdapter] = {}
# families harts has an adapter for that the installed transformers lacks (or runs wrongly) -> why
_UNAVAILABLE: dict[str, str] = {}
_ALIASES: dict[str, str] = {}  # config model type -> registered family (FamilyAdapter.config_aliases)


class FamilyUnavailable(ValueError):
    """A family harts supports that the installed transformers does not have (or has a version of
    that harts refuses)."""


def _transformers_has(model_type: str) -> bool:
    return importlib.util.find_spec(f"transformers.models.{model_type}") is not None


def _too_old(version: str) -> bool:
    import transformers
    from packaging.version import Version

    return Version(transformers.__version__) < Version(version)


def register(adapter: FamilyAdapter) -> FamilyAdapter:
    """Register ``adapter`` for each of its model types that the installed transformers has (from
    the adapter's ``min_transformers`` version on)."""
    import transformers

    for name in adapter.model_types:
        _ADAPTERS[name] = adapter
        _REGISTRY.pop(name, None), _UNAVAILABLE.pop(name, None)
        if not _transformers_has(adapter.modeling_package.get(name, name)):
            _UNAVAILABLE[name] = (
                f"{name} is not in the installed transformers {transformers.__version__}; "
                f"install a version that has it (see the README's supported range)"
            )
        elif name in adapter.min_transformers and _too_old(adapter.min_transformers[name][0]):
            version, why = adapter.min_transformers[name]
            _UNAVAILABLE[name] = (
                f"{name} needs transformers >= {version} (installed: {transformers.__version__}): {why}"
            )
        else:
            _REGISTRY[name] = adapter
    for alias, name in adapter.config_aliases.items():
        if name in _REGISTRY:
            _ALIASES[alias] = name
    return adapter


def supported_families() -> list[str]:
    """The families this installation runs (those of harts' adapters that transformers has)."""
    return sorted(_REGISTRY)


def all_families() -> list[str]:
    """Every family harts has an adapter for, in registration order, including those the installed
    transformers lacks (:func:`adapter_for_type` refuses them, saying why)."""
    return list(_ADAPTERS)


def registered_adapter(model_type: str | None) -> FamilyAdapter | None:
    """The adapter harts has for ``model_type`` (or a config alias of it), whether the installed
    transformers runs the family or not, or None: for reading what the adapter declares."""
    return _ADAPTERS.get(_ALIASES.get(model_type, model_type))


def _unavailable(model_type: str) -> FamilyUnavailable:
    return FamilyUnavailable(_UNAVAILABLE[model_type])


def adapter_for_type(model_type: str) -> FamilyAdapter:
    """The adapter registered for ``model_type``; ValueError naming the supported families."""
    model_type = _ALIASES.get(model_type, model_type)
    if model_type in _UNAVAILABLE:
        raise _unavailable(model_type)
    if model_type not in _REGISTRY:
        raise ValueError(f"unknown family {model_type!r}; harts supports: {', '.join(supported_families())}")
    return _REGISTRY[model_type]


def adapter_for(model: nn.Module) -> FamilyAdapter:
    config = getattr(model, "config", None)
    model_type = _ALIASES.get(getattr(config, "model_type", None), getattr(config, "model_type", None))
    if model_type in _UNAVAILABLE:
        raise _unavailable(model_type)
    if model_type not in _REGISTRY:
        raise ValueError(
            f"unsupported model family {model_type!r} ({type(model).__name__}); "
            f"harts supports: {', '.join(supported_families())}"
        )
    view = text_view(model, _REGISTRY[model_type].vision_language)
    if view is not None:  # a multimodal model: what harts runs and checks is its text causal LM
        model, config = view, view.config
    adapter = _REGISTRY[model_type]
    if not _has_backbone(adapter, model) or not (hasattr(model, "lm_head") or hasattr(model, "score")):
        raise ValueError(
            "expected a causal LM with .model and .lm_head (e.g. AutoModelForCausalLM), or a critic or "
            f"reward model with .model and .score (e.g. AutoModelForTokenClassification), got "
            f"{type(model).__name__}"
        )
    if not hasattr(model, "lm_head") and adapter.folds_logit_scale:
        raise ValueError(
            f"{model_type}: harts folds the family's logit scale into the final norm's output (exact for its "
            f"lm_head only), so a score head over the backbone's hidden states is not supported"
        )
    check_common_config(
        config,
        sliding_windows=adapter.sliding_windows,
        final_logit_softcapping=adapter.final_logit_softcapping,
    )
    adapter.check_config(config)
    adapter.check_model(model)
    return adapter


def _has_backbone(adapter: FamilyAdapter, model: nn.Module) -> bool:
    """Whether ``model`` holds the backbone where ``adapter`` reads it (``.model``; mamba2's
    ``.backbone``)."""
    try:
        adapter.backbone(model)
    except AttributeError:
        return False
    return True


# Rotary types whose tables depend only on the position, not on the sequence's length: a token's
# rotation is then the same in the forest as in its trajectory alone.
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "proportional")


def logit_softcap(model: nn.Module) -> float | None:
    """The final logit soft-cap of a supported ``model`` (:meth:`FamilyAdapter.logit_softcap`): what
    every reader of its head applies to the logits before the temperature."""
    config = model.config
    return adapter_for_type(config.model_type).logit_softcap(config)


def check_common_config(config, sliding_windows: bool = False, final_logit_softcapping: bool = False) -> None:
    """Options no family runs exactly over a forest: length-dependent rotary scaling, unknown rotary
    types; sliding windows and final logit soft-capping unless the family's adapter runs them. One
    line naming the option."""
    family = config.model_type
    if not sliding_windows and (
        getattr(config, "use_sliding_window", False)
        or "sliding_attention" in (getattr(config, "layer_types", None) or [])
    ):
        raise ValueError(f"{family}: sliding-window attention is not supported by harts yet")
    rope = getattr(config, "rope_parameters", None) or {}
    types = {rope.get("rope_type", "default")} if "rope_type" in rope or not rope else set()
    types |= {v.get("rope_type", "default") for v in rope.values() if isinstance(v, dict)}
    for rope_type in types:
        if rope_type in ("dynamic", "longrope"):
            raise ValueError(
                f"{family}: rope_type {rope_type!r} rescales by sequence length, which differs per "
                f"trajectory; use a static rope_type ({', '.join(STATIC_ROPE_TYPES)})"
            )
        if rope_type not in STATIC_ROPE_TYPES:
            raise ValueError(
                f"{family}: unknown rope_type {rope_type!r}; harts runs {', '.join(STATIC_ROPE_TYPES)}"
            )
    softcap = getattr(config, "final_logit_softcapping", None)
    if softcap is not None and not final_logit_softcapping:
        raise ValueError(
            f"{family}: final_logit_softcapping={softcap} (a tanh on the logits after lm_head) is not "
            f"applied by harts for this family; set it to None"
        )


def hf_function(module: nn.Module, name: str):
    """A helper function (e.g. ``apply_rotary_pos_emb``) from the module's own modeling file.

    Using the family's own helper keeps conventions such as interleaved or partial rotary
    dimensions exactly as the stock model applies them.
    """
    return getattr(sys.modules[type(module).__module__], name)
