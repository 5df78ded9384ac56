"""``glm5_next`` (GLM-5 Next, GLM-5.3-Flash): KDA linear layers with low-rank forget and output
gates; NoPE MLA layers whose keys a lightning indexer picks per query over pooled groups of its
path, one layer running the indexer and the next reusing its choice
(:mod:`harts.adapters.glm5_next_indexer`); manifold-constrained hyper-connections around every block
(``hc_mult`` residual streams per token, collapsed into a block's input and expanded back by
weights computed from the streams); sigmoid-routed MoE with a shared expert and a score-correction
bias; clamped SwiGLU.

The family ships no causal LM class: users load ``Glm5NextForConditionalGeneration``, and harts runs
its language model and head on text rollouts (:class:`~harts.adapters.vision_language.TextOnly`).
Its images are refused:
harts does not run GLM-5 Next's vision tower over a forest's images.

Hyper-connections are token-wise (each token's streams mix only among themselves), so the
executor carries [1, n, hc_mult, D] streams from the embedding to the final collapse unchanged;
only the token mixers see the sequence.
"""

from __future__ import annotations

from functools import partial

import torch

from harts.adapters.base import TINY_COMMON, FamilyAdapter, MoEBalancing, register, require
from harts.adapters.glm5_next_indexer import indexed_mla_attention
from harts.adapters.mixers import kda_mixer
from harts.adapters.vision_language import TextOnly

__all__ = ["Glm5NextAdapter"]

_LAYER_ATTRIBUTES = ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm", "attn_hc", "ffn_hc")
_KDA_ATTRIBUTES = (
    "q_proj",
    "k_proj",
    "v_proj",
    "conv1d",
    "activation",
    "forget_gate",
    "b_proj",
    "g_a_proj",
    "g_b_proj",
    "o_norm",
    "o_proj",
)
_MLA_ATTRIBUTES = (
    "q_a_proj",
    "q_a_layernorm",
    "q_b_proj",
    "kv_a_proj_with_mqa",
    "kv_a_layernorm",
    "expand_kv",
    "o_proj",
    "indexer",
    "next_skip_topk",
    "scaling",
)
_INDEXER_ATTRIBUTES = (
    "wq_b",
    "wk",
    "k_norm",
    "weights_proj",
    "index_kpool_compress_ape",
    "index_kpool_compress_gate",
    "index_kpool_always_select_tail",
)


def _hyper_connected(connection, streams: torch.Tensor, block) -> torch.Tensor:
    """One block inside its hyper-connection, as the stock decoder layer: the streams [1, n, N, D]
    collapsed into the block's input, its output expanded back and added to the mixed streams."""
    dtype = streams.dtype
    post, comb, collapsed = connection(streams)
    out = block(collapsed)
    mixed = torch.matmul(comb.to(dtype).transpose(-1, -2), streams)
    return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + mixed


class _Streams:
    """The token embedding spread over the ``hc_mult`` residual streams: [n] ids -> [n, N, D]."""

    def __init__(self, embedding, streams: int):
        self.embedding, self.streams = embedding, streams

    def __call__(self, ids):
        embedded = self.embedding(ids)
        return embedded.unsqueeze(-2).expand(*embedded.shape[:-1], self.streams, -1).contiguous()


class _CollapsedNorm:
    """The final collapse of the streams (their mean) and the final norm: [1, n, N, D] -> [1, n, D]."""

    def __init__(self, backbone):
        self.backbone = backbone

    def __call__(self, streams):
        return self.backbone.norm(self.backbone.hc_head(streams))


class Glm5NextAdapter(FamilyAdapter):
    model_types = ("glm5_next",)
    config_aliases = {"glm5_next_text": "glm5_next"}
    auto_class = "AutoModelForImageTextToText"
    router_class = "Glm5NextTextTopkRouter"
    moe_balancing = MoEBalancing.BIAS
    vision_language = TextOnly("glm5_next", ("glm5_next",))
    mixers = {
        "linear_attention": (
            "self_attn",
            partial(kda_mixer, output_gate=lambda attn, x: attn.g_b_proj(attn.g_a_proj(x))),
        ),
        "indexed_attention": ("self_attn", indexed_mla_attention),
    }
    stock_delta_rule_kernels = ("chunk_kimi_delta_attention",)
    small_overrides = {
        "glm5_next": dict(
            moe_intermediate_size=64,
            linear_head_dim=32,
            qk_nope_head_dim=32,
            v_head_dim=32,
            index_head_dim=32,
        )
    }

    def check_config(self, config) -> None:
        types, indexers = config.layer_types, config.indexer_types
        for i, layer_type in enumerate(types[: config.num_hidden_layers]):
            shared = layer_type == "indexed_attention" and indexers[i] == "shared"
            if shared and (i == 0 or types[i - 1] != "indexed_attention" or indexers[i - 1] != "full"):
                raise ValueError(
                    f"glm5_next: layer {i} reuses the previous layer's indexer selection (indexer_types "
                    f"'shared'), but layer {i - 1} is not an indexed layer that runs its indexer"
                )

    def check_model(self, model) -> None:
        backbone = self.backbone(model)
        require("glm5_next", backbone, "embed_tokens", "layers", "norm", "hc_head")
        for layer in backbone.layers:
            require("glm5_next", layer, *_LAYER_ATTRIBUTES)
            attention = layer.self_attn
            if hasattr(attention, "forget_gate"):
                require("glm5_next", attention, *_KDA_ATTRIBUTES)
            else:
                require("glm5_next", attention, *_MLA_ATTRIBUTES)
                if attention.indexer is not None:
                    require("glm5_next", attention.indexer, *_INDEXER_ATTRIBUTES)

    def decoder_block(self, layer, hidden, mix, mlp):
        """The stock layer: attention, then the MLP or MoE, each inside its hyper-connection."""
        hidden = _hyper_connected(layer.attn_hc, hidden, lambda x: mix(layer.input_layernorm(x)))
        return _hyper_connected(layer.ffn_hc, hidden, lambda x: mlp(layer.post_attention_layernorm(x)))

    def embedding(self, backbone):
        return _Streams(backbone.embed_tokens, backbone.config.hc_mult)

    def final_norm(self, backbone):
        return _CollapsedNorm(backbone)

    def rotary(self, backbone):
        return None  # NoPE: the stock layers get no position embeddings

    def tiny_config(self, model_type, **overrides):
        from transformers.models.glm5_next import Glm5NextConfig

        text = dict(
            TINY_COMMON,
            intermediate_size=96,
            moe_intermediate_size=32,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=4,
            q_lora_rank=32,
            kv_lora_rank=24,
            qk_rope_head_dim=0,
            qk_nope_head_dim=16,
            v_head_dim=16,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_shared_experts=1,
            n_group=1,
            topk_group=1,
            linear_head_dim=16,
            linear_num_heads=4,
            linear_conv_kernel_dim=4,
            index_topk=8,
            index_kpool=4,
            index_head_dim=16,
            index_n_heads=8,
            hc_mult=4,
            hc_sinkhorn_iters=20,
            layer_types=["linear_attention", "indexed_attention", "indexed_attention", "linear_attention"],
            indexer_types=["full", "full", "shared", "full"],
            mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
        )
        vision = dict(
            depth=1,
            hidden_size=16,
            num_heads=2,
            intermediate_size=32,
            patch_size=2,
            temporal_patch_size=1,
            spatial_merge_size=2,
            out_hidden_size=TINY_COMMON["hidden_size"],
            projection_intermediate_size=32,
        )
        return Glm5NextConfig(text_config={**text, **overrides}, vision_config=vision)

    def randomize_tiny(self, model) -> None:
        """Non-trivial values for what the stock initialisation sets to constants (the pools' position
        biases and gates, the hyper-connections' biases and scales), so that tests exercise them."""
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if name.endswith("index_kpool_compress_ape"):
                    parameter.normal_(0.0, 0.5)
                elif name.endswith("index_kpool_compress_gate"):
                    parameter.normal_(0.0, 0.1)
                elif name.endswith("hc.base"):
                    parameter.normal_(0.0, 0.1)
                elif name.endswith("hc.scale"):
                    parameter.uniform_(0.8, 1.2)


register(Glm5NextAdapter())
