"""``qwen4_exp`` (Qwen4-Exp): Gated DeltaNet linear layers, gated attention whose keys a QSA indexer
picks per query over pooled blocks of its path, gated residual hyper-connections with block
injection weights around every block, a per-layer n-gram embedding (PLE) with a dilated
convolution on chosen linear layers, softmax-routed MoE with a gated shared expert.

The text model (``Qwen4ExpForCausalLM``, config type ``qwen4_exp_text``) runs as it is; the
multimodal ``Qwen4ExpForConditionalGeneration`` runs as its language model and head on text
rollouts, its images refused (:class:`~harts.adapters.vision_language.TextOnly`).

What each part is along a tree:

- the residual stream is ``hc_count`` streams per token, flattened ([1, n, hc * D]); the gated
  residuals (``attn_hyper_connection``, ``mlp_hyper_connection``, the final
  ``hyper_connection_mixer``) are token-wise and run as they are;
- PLE: a token's n-gram ids hash the last ``ngram_size`` tokens of its path (an EOS cuts the
  context, as in stock), so the stock n-gram embedding runs on each token's path window; its gated
  value then goes through the dilated depthwise convolution along the path (``ctx.conv`` with the
  kernel spread over the dilation: the same taps, zeros between them), handed across cuts beside the
  GDN convolution's inputs;
- QSA: blocks of ``indexer_compress_ratio`` tokens by path position; a block's key is the mean of
  its tokens' indexer keys, normed and rotated at its first token's position; a query scores the
  complete blocks ending on its path (``sum_h relu(q_h . k) / sqrt(d)``), keeps the
  ``indexer_budget / indexer_compress_ratio`` best and its own incomplete block
  (:mod:`harts.adapters.pooled_selection`). The choice is discrete (no gradient reaches the
  indexer in stock either), so its keys cross cuts as rows without gradient.
"""

from __future__ import annotations

import math
from functools import partial

import torch
import torch.nn.functional as F

from harts.adapters.base import (
    TINY_COMMON,
    FamilyAdapter,
    MoEBalancing,
    TreeOps,
    hf_function,
    register,
    require,
)
from harts.adapters.mixers import gdn_mixer, gqa_attention, qwen3_5_gdn_projections
from harts.adapters.pooled_selection import pool_ends, select_pools
from harts.adapters.vision_language import TextOnly

__all__ = ["Qwen4ExpAdapter"]

_LAYER_ATTRIBUTES = ("mlp", "ple", "attn_hyper_connection", "mlp_hyper_connection")
_PLE_ATTRIBUTES = (
    "ple_embedding",
    "key_proj",
    "value_proj",
    "norm_key",
    "norm_query",
    "norm_conv",
    "conv1d",
    "hidden_size",
    "hc_count",
)
_INDEXER_ATTRIBUTES = (
    "index_qk_proj",
    "q_layernorm",
    "k_layernorm",
    "index_n_heads",
    "index_head_dim",
    "compress_ratio",
    "block_topk",
)


def qsa_selection(indexer, x: torch.Tensor, ctx: TreeOps):
    """``select(block)`` -> [nb, mb] bool: the keys each query attends to, as
    ``Qwen4ExpTextQSAIndexer`` picks them for the trajectory alone. ``x`` [1, n, D]: the attention's
    input."""
    with torch.no_grad():
        n, heads, width, size = (
            x.shape[1],
            indexer.index_n_heads,
            indexer.index_head_dim,
            indexer.compress_ratio,
        )
        rotate = hf_function(indexer, "apply_rotary_pos_emb")
        query, key = indexer.index_qk_proj(x)[0].split([heads * width, width], dim=-1)
        query = indexer.q_layernorm(query.reshape(1, n, heads, width))
        cos, sin = ctx.position_embeddings
        query = rotate(query, cos=cos, sin=sin, unsqueeze_dim=2)[0].float()  # [n, H, d]
        keys = ctx.path_rows(key)  # [m, d]
        key_cos, key_sin = ctx.key_position_embeddings

    @torch.no_grad()
    def select(block) -> torch.Tensor:
        ends, members = pool_ends(block, size)
        rows = block.keys[members]  # key-space rows of each block's tokens
        pooled = indexer.k_layernorm(keys[rows].float().mean(dim=1).to(keys.dtype))  # [E, d]
        starts = rows[:, 0]  # a block of keys is rotated at its first token's position
        pooled = rotate(pooled[:, None], cos=key_cos[0, starts], sin=key_sin[0, starts])[:, 0]
        scores = torch.einsum("nhd,ed->neh", query[block.start : block.stop], pooled.float())
        index = torch.relu(scores).sum(dim=-1) / math.sqrt(width)
        return select_pools(index, ends, block, size, indexer.block_topk, tail=True)

    return select


def qsa_attention(attn, x: torch.Tensor, ctx: TreeOps) -> torch.Tensor:
    """Qwen4-Exp's gated attention over the keys its QSA indexer selects along each path."""
    return gqa_attention(attn, x, ctx, output_gate=True, select=qsa_selection(attn.indexer, x, ctx))


def ple_tree(ple, streams: torch.Tensor, ctx: TreeOps) -> torch.Tensor:
    """``Qwen4ExpTextPLELayer`` over the forest: [1, n, hc * D] streams -> what the layer adds to them."""
    embedding = ple.ple_embedding
    ids = ctx.path_token_ids(embedding.ngram_size)  # [n, ngram]: the token last
    ids = torch.where(ids >= 0, ids, embedding.eos_token_id)  # before the path start: EOS, as stock pads
    embedded = embedding(ids, None)[:, -1][None]  # each window's last token is the token itself
    shape = (ple.hc_count, ple.hidden_size)
    key = ple.norm_key(ple.key_proj(embedded)).unflatten(-1, shape)
    value = ple.value_proj(embedded)
    query = ple.norm_query(streams).unflatten(-1, shape)
    gate = (key * query).sum(dim=-1, keepdim=True) / math.sqrt(ple.hidden_size)
    gate = gate.abs().clamp_min(1e-6).sqrt() * gate.sign()
    gated = torch.sigmoid(gate) * value.unsqueeze(-2)
    normed = ple.norm_conv(gated.flatten(-2))
    conv = ple.conv1d  # depthwise, dilated: taps d apart become a kernel of (K - 1) d + 1 with zeros between
    weight, dilation = conv.weight[:, 0], conv.dilation[0]
    taps = weight.shape[-1]
    spread = F.pad(weight[:, :, None], (0, dilation - 1)).reshape(weight.shape[0], -1)
    spread = spread[:, : (taps - 1) * dilation + 1]
    out = F.silu(ctx.conv(normed[0], spread, conv.bias)).to(normed.dtype)
    return gated.flatten(-2) + out[None]


def _with_residuals(mixer, module, streams: torch.Tensor, ctx: TreeOps, layer) -> torch.Tensor:
    """The stock layer up to its MLP: PLE added to the streams, the attention gated residual's
    input, the token mixer, its output injected into every stream."""
    if layer.ple is not None:
        streams = streams + ple_tree(layer.ple, streams, ctx)
    mixed, hyper_input, injection = layer.attn_hyper_connection(streams)
    out = mixer(module, mixed, ctx)
    return hyper_input + (out.unsqueeze(-2) * injection.unsqueeze(-1)).flatten(-2)


class _Streams:
    """The token embedding repeated over the ``hc_count`` streams: [n] ids -> [n, hc * D]."""

    def __init__(self, embedding, streams: int):
        self.embedding, self.streams = embedding, streams

    def __call__(self, ids):
        return self.embedding(ids).repeat(1, self.streams)


class Qwen4ExpAdapter(FamilyAdapter):
    model_types = ("qwen4_exp",)
    config_aliases = {"qwen4_exp_text": "qwen4_exp"}
    router_class = "Qwen4ExpTextTopKRouter"
    moe_balancing = MoEBalancing.AUX_LOSS
    vision_language = TextOnly("qwen4_exp", ("qwen4_exp",))
    mixers = {
        "linear_attention": ("linear_attn", partial(gdn_mixer, projections=qwen3_5_gdn_projections)),
        "indexed_attention": ("self_attn", qsa_attention),
    }
    stock_delta_rule_kernels = ("torch_chunk_gated_delta_rule",)
    small_overrides = {
        "qwen4_exp": dict(
            moe_intermediate_size=64,
            shared_expert_intermediate_size=64,
            head_dim=32,
            linear_key_head_dim=32,
            linear_value_head_dim=32,
            indexer_head_dim=32,
        )
    }

    def check_config(self, config) -> None:
        if hasattr(config, "text_config"):
            raise ValueError("qwen4_exp: the multimodal model runs as its language model (a TextView)")
        if config.linear_num_value_heads % config.linear_num_key_heads:
            raise ValueError(
                f"qwen4_exp: linear_num_value_heads={config.linear_num_value_heads} is not a multiple of "
                f"linear_num_key_heads={config.linear_num_key_heads}"
            )
        if "indexed_attention" in config.layer_types and config.indexer_n_heads is None:
            raise ValueError(
                "qwen4_exp: attention layers without a QSA indexer (indexer_n_heads unset) are not supported"
            )

    def check_model(self, model) -> None:
        backbone = self.backbone(model)
        require("qwen4_exp", backbone, "embed_tokens", "layers", "rotary_emb", "hyper_connection_mixer")
        for layer in backbone.layers[: model.config.num_hidden_layers]:
            require("qwen4_exp", layer, *_LAYER_ATTRIBUTES)
            if layer.ple is not None:
                require("qwen4_exp", layer.ple, *_PLE_ATTRIBUTES)
            if hasattr(layer, "self_attn"):
                require("qwen4_exp", layer.self_attn, "indexer", "q_proj", "k_proj", "v_proj", "o_proj")
                require("qwen4_exp", layer.self_attn.indexer, *_INDEXER_ATTRIBUTES)

    def mixer(self, layer, layer_type):
        module, function = super().mixer(layer, layer_type)
        return module, partial(_with_residuals, function, layer=layer)

    def uncalled_modules(self, layer, layer_type):
        """The PLE layer's forward is not called (its parts are), nor its convolution's (its weight is
        read): hooks on them are refused."""
        return [layer.ple, layer.ple.conv1d] if layer.ple is not None else []

    def decoder_block(self, layer, hidden, mix, mlp):
        """``mix``: PLE, the attention's gated residual, the token mixer and its injection; then the
        MoE inside its own gated residual."""
        hidden = mix(hidden)
        mixed, hyper_input, injection = layer.mlp_hyper_connection(hidden)
        out = mlp(mixed)
        return hyper_input + (out.unsqueeze(-2) * injection.unsqueeze(-1)).flatten(-2)

    def embedding(self, backbone):
        return _Streams(backbone.embed_tokens, backbone.config.hc_count)

    def final_norm(self, backbone):
        return backbone.hyper_connection_mixer  # collapses the streams into one, normed

    def tiny_config(self, model_type, **overrides):
        from transformers.models.qwen4_exp import Qwen4ExpTextConfig

        fields = dict(
            TINY_COMMON,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            linear_conv_kernel_dim=4,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=2,
            hc_count=4,
            hc_lowrank=16,
            ple_layer_ids=[1],
            ple_embed_dim=32,
            ple_conv_kernel_size=4,
            ngram_size=3,
            heads_per_ngram=2,
            ngram_vocab_size_base=1000,
            indexer_n_heads=4,
            indexer_kv_heads=1,
            indexer_head_dim=16,
            indexer_budget=8,
            indexer_compress_ratio=4,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.5,
                "mrope_section": [2, 1, 1],
            },
            layer_types=["linear_attention", "indexed_attention", "linear_attention", "indexed_attention"],
        )
        return Qwen4ExpTextConfig(**{**fields, **overrides})

    def randomize_tiny(self, model) -> None:
        """The PLE convolution starts at zero (stock initialisation): random taps, so that tests see it."""
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if name.endswith("ple.conv1d.weight"):
                    parameter.normal_(0.0, 0.3)


register(Qwen4ExpAdapter())
