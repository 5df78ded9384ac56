"""FLOP model behind the benchmark's *ideal speedup* (flat FLOPs / tree FLOPs).

Per token, forward, counted as 2 FLOPs per multiply-add:

- dense: every matmul weight a token meets once (attention and linear-attention projections, MLA
  down/up projections, gates, the depthwise short-convolution taps, dense MLPs, the MoE router,
  the ``top_k`` active routed experts and the shared experts, and the LM head): 2 x active
  weights. Embedding lookups, norms, activations and the softmax are left out (they are
  elementwise, small next to the matmuls, and per token in both layouts alike).
- linear attention (KDA, GDN): a per-token state update on each head's [K, V] state, costed as
  three matrix-vector products (read k^T S for the delta, the rank-one write, the output q^T S):
  2 * 3 * H * K * V. The constant depends on the kernel (chunked forms trade it for matmuls), but
  it is per token, so it scales like the dense part.
- full attention (GQA, gated, MLA): a token at path position p attends to p + 1 keys, costing
  2 * H * (d_qk + d_v) * (p + 1) (scores and the weighted sum of values).

Forward + backward = 3 x forward (backward is about two forwards), for every part alike.

A forest with N unique tokens then costs ``3 * (c_token * N + c_key * sum(p + 1))`` and its flat
layout the same sum over every trajectory's own tokens. Both use :func:`forest_flops` on a
:class:`~harts.forest.Forest` (the flat one built with ``share_prefixes=False``), so for an
attention-free model ideal speedup == R exactly, and full attention raises it above R when
shared prefixes are long. Every count is a Python int, so the ratios are exact.

What this leaves out: memory traffic, padding inside linear-attention calls, kernel launch and
Python overheads (which is why achieved speedup can fall short of the ideal), and the fact that
logits are needed only at positions that have loss rows (the head is counted on every token).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from torch import nn

from harts.adapters.base import adapter_for
from harts.forest import Forest
from harts.runtime.model_checks import resolve_model

__all__ = ["FlopModel", "flop_model", "forest_flops", "ideal_speedup", "FLOP_MODEL_TEXT"]

FLOP_MODEL_TEXT = (
    "FLOPs per fwd+bwd = 3 x forward; forward per token = 2 x active matmul weights "
    "(projections, conv taps, MLP / router + top-k and shared experts, LM head) "
    "+ 6*H*K*V per linear-attention layer (state update) "
    "+ 2*H*(d_qk+d_v)*(p+1) per full-attention layer at path position p; "
    "ideal speedup = flat FLOPs / tree FLOPs"
)


@dataclass(frozen=True)
class FlopModel:
    """Forward FLOP coefficients of one model (all ints).

    - ``dense_per_token``: matmul FLOPs every token costs (all layers and the head);
    - ``linear_state_per_token``: state-update FLOPs of all linear-attention layers per token;
    - ``attention_per_key``: FLOPs of all full-attention layers per (query, key) pair.
    """

    dense_per_token: int
    linear_state_per_token: int
    attention_per_key: int
    num_full_layers: int
    num_linear_layers: int

    @property
    def per_token(self) -> int:
        return self.dense_per_token + self.linear_state_per_token

    def as_dict(self) -> dict:
        return asdict(self)


def _expert_weights(experts: nn.Module) -> tuple[int, int]:
    """(weights of one routed expert, number of experts) for a fused experts module."""
    total = sum(p.numel() for p in experts.parameters(recurse=False) if p.dim() == 3)
    num = int(getattr(experts, "num_experts", 0))
    num = num or next(p.shape[0] for p in experts.parameters() if p.dim() == 3)
    return total // num, num


# Layer types without keys or states: a short convolution, or an MLP / MoE block standing as a
# layer of its own.
TOKEN_WISE_LAYERS = ("conv", "mlp", "moe")
# Layer types whose mixer attends (a window's keys counted as the whole path's).
# An indexed layer (sparse attention whose keys an indexer picks) runs masked calls over the whole
# path, as the stock layer does, plus its indexer over the path's pools.
ATTENTION_LAYERS = ("full_attention", "sliding_attention", "indexed_attention")


def _active_matmul_weights(layer: nn.Module, top_k: int) -> int:
    """Matmul weights one token meets in ``layer``.

    Every 2-D ``weight`` (Linear projections, and routers, which are plain modules holding a
    [E, D] weight), every Conv1d kernel (depthwise taps), and ``top_k`` of the routed experts.
    Norm weights are 1-D; gate constants (``A_log``, ``dt_bias``) are not named ``weight``.
    """
    # Routed experts are a fused module named "experts" (3-D weights); shared experts are plain MLPs.
    experts = [m for name, m in layer.named_modules() if name.rsplit(".", 1)[-1] == "experts"]
    expert_params = {id(p) for m in experts for p in m.parameters(recurse=False)}
    conv = {id(m.weight) for m in layer.modules() if isinstance(m, nn.Conv1d)}
    # an embedding inside a layer (Qwen4-Exp's n-gram table) is read by lookup, not multiplied
    lookups = {id(m.weight) for m in layer.modules() if isinstance(m, nn.Embedding)}
    count = 0
    for name, p in layer.named_parameters():
        if id(p) in expert_params or id(p) in lookups or name.rsplit(".", 1)[-1] != "weight":
            continue
        if p.dim() == 2 or id(p) in conv:
            count += p.numel()
    for m in experts:
        per_expert, _ = _expert_weights(m)
        count += top_k * per_expert
    return count


def _linear_state_flops(mixer: nn.Module) -> int:
    """6 * H * K * V for one KDA (num_heads, head_dim), GDN (num_v_heads, head_k_dim, head_v_dim) or
    Mamba-2 (num_heads, ssm_state_size, head_dim) or Mamba (intermediate_size, ssm_state_size, 1) layer."""
    if hasattr(mixer, "ssm_state_size") and hasattr(mixer, "num_heads"):  # Mamba-2: K = state size
        heads, k, v = mixer.num_heads, mixer.ssm_state_size, mixer.head_dim
    elif hasattr(mixer, "ssm_state_size") and hasattr(mixer, "intermediate_size"):  # Mamba: H = channels
        heads, k, v = mixer.intermediate_size, mixer.ssm_state_size, 1
    elif hasattr(mixer, "num_v_heads"):
        heads, k, v = mixer.num_v_heads, mixer.head_k_dim, mixer.head_v_dim
    elif hasattr(mixer, "num_heads") and hasattr(mixer, "head_dim"):
        heads, k, v = mixer.num_heads, mixer.head_dim, mixer.head_dim
    elif hasattr(mixer, "num_attention_heads") and hasattr(mixer, "head_dim"):  # lightning attention
        heads, k, v = mixer.num_attention_heads, mixer.head_dim, mixer.head_dim
    else:
        raise ValueError(f"cannot read linear-attention state sizes from {type(mixer).__name__}")
    return 2 * 3 * int(heads) * int(k) * int(v)


def _attention_key_flops(mixer: nn.Module, config) -> int:
    """2 * H * (d_qk + d_v): FLOPs of one (query, key) pair in a full-attention layer (MLA or GQA)."""
    heads = int(config.num_attention_heads)
    head_dim = getattr(mixer, "head_dim", None) or config.hidden_size // heads
    d_qk = int(getattr(mixer, "qk_head_dim", None) or head_dim)
    d_v = int(getattr(mixer, "v_head_dim", None) or head_dim)
    return 2 * heads * (d_qk + d_v) + _indexer_key_flops(getattr(mixer, "indexer", None))


def _indexer_key_flops(indexer) -> int:
    """FLOPs per (query, key) pair of a sparse-attention indexer: its heads score one pool of P keys
    per query (GLM-5 Next's k-pool indexer, Qwen4-Exp's QSA), so 2 * heads * width / P."""
    if indexer is None:
        return 0
    names = (("n_heads", "head_dim", "index_kpool"), ("index_n_heads", "index_head_dim", "compress_ratio"))
    for heads, width, pool in names:
        if hasattr(indexer, heads):
            product = int(getattr(indexer, heads)) * int(getattr(indexer, width))
            return 2 * product // int(getattr(indexer, pool))
    raise ValueError(
        f"the FLOP model cannot read the sizes of {type(indexer).__name__}; add them in harts.runtime.flops"
    )


def flop_model(model: nn.Module) -> FlopModel:
    """The forward FLOP coefficients of a supported ``*ForCausalLM`` (read from its modules)."""
    model = resolve_model(model)  # a multimodal model: its text causal LM
    adapter = adapter_for(model)
    config = model.config
    top_k = int(getattr(config, "num_experts_per_tok", 0) or 0)
    layers = adapter.backbone(model).layers[: config.num_hidden_layers]
    dense = 2 * model.lm_head.weight.numel()
    state = attn = 0
    n_full = n_linear = 0
    for i, layer in enumerate(layers):
        dense += 2 * _active_matmul_weights(layer, top_k)
        layer_type = adapter.layer_type(model, i)
        mixer = adapter.mixer(layer, layer_type)[0]
        if layer_type == "linear_attention":
            state += _linear_state_flops(mixer)
            n_linear += 1
        elif layer_type == "hybrid":  # a linear mixer and the adapter's parallel_attention side by side
            state += _linear_state_flops(mixer)
            attn += _attention_key_flops(getattr(layer, adapter.parallel_attention), config)
            n_linear += 1
            n_full += 1
        elif layer_type in TOKEN_WISE_LAYERS:  # projections, MLP or MoE only: per-token work above
            continue
        elif layer_type in ATTENTION_LAYERS:
            attn += _attention_key_flops(mixer, config)
            n_full += 1
        else:
            raise ValueError(
                f"the FLOP model has no term for layer type {layer_type!r} "
                f"({model.config.model_type}); add one in harts.runtime.flops"
            )
    return FlopModel(dense, state, attn, n_full, n_linear)


def forest_flops(fm: FlopModel, forest: Forest) -> int:
    """Forward + backward FLOPs of one pass over ``forest``'s unique tokens (an int).

    The flat layout is the same call on ``build_forest(trajectories, share_prefixes=False)``.
    """
    keys = int((forest.token_position + 1).sum())
    return 3 * (fm.per_token * forest.num_tokens + fm.attention_per_key * keys)


def ideal_speedup(fm: FlopModel, tree: Forest, flat: Forest) -> float:
    """Flat FLOPs / tree FLOPs (int / int: correctly rounded)."""
    return forest_flops(fm, flat) / forest_flops(fm, tree)
