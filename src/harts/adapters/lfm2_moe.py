"""``lfm2_moe`` (Liquid LFM2-MoE): :mod:`lfm2`'s gated short convolutions and GQA with q/k norms,
with a sigmoid-routed MoE feed-forward (``num_dense_layers`` dense SwiGLU layers first).

The MoE block runs as the stock module on the unique tokens. Its router (``Lfm2MoeTopKRouter``)
scores experts with a sigmoid, chooses the top k by score plus the block's ``expert_bias`` (a
buffer, when ``use_expert_bias``), and weighs them by their unbiased scores (normalised with
``norm_topk_prob``, times ``routed_scaling_factor``): balanced by moving that bias, with no
auxiliary loss (:attr:`MoEBalancing.BIAS`); harts' bias update moves the block's ``expert_bias``.

MoE statistics need the router module; in transformers versions whose MoE block still routes
itself (5.10), the model trains but MoE statistics are refused as for a dense family.
"""

from __future__ import annotations

from harts.adapters.base import TINY_COMMON, MoEBalancing, register, require
from harts.adapters.gqa_family import router_if_it_chooses
from harts.adapters.lfm2 import Lfm2Adapter

__all__ = ["Lfm2MoeAdapter"]


class Lfm2MoeAdapter(Lfm2Adapter):
    model_types = ("lfm2_moe",)
    moe_balancing = MoEBalancing.BIAS
    rotary_name = "pos_emb"

    @property
    def router_class(self):
        return router_if_it_chooses("lfm2_moe", "Lfm2MoeSparseMoeBlock", "Lfm2MoeTopKRouter")

    def balancing_bias(self, model, layer, router):
        block = self.backbone(model).layers[layer].feed_forward
        if not getattr(block, "use_expert_bias", False):
            raise ValueError(
                "lfm2_moe: use_expert_bias=False: the model routes without a bias, so there is none to move"
            )
        require("lfm2_moe", block, "expert_bias")
        return block.expert_bias

    def tiny_config(self, model_type, **overrides):
        from transformers import Lfm2MoeConfig

        # conv (dense MLP), attention + MoE, conv + MoE, conv + MoE
        fields = dict(
            TINY_COMMON,
            intermediate_size=96,
            moe_intermediate_size=32,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            norm_eps=1e-5,
            conv_L_cache=3,
            conv_bias=True,
            num_dense_layers=1,
            num_experts=8,
            num_experts_per_tok=2,
            use_expert_bias=True,
            routed_scaling_factor=1.5,
            norm_topk_prob=True,
            tie_word_embeddings=False,
            layer_types=["conv", "full_attention", "conv", "conv"],
            rope_theta=10000.0,
        )
        fields.pop("rms_norm_eps")
        return Lfm2MoeConfig(**{**fields, **overrides})

    def randomize_tiny(self, model):
        # the expert biases start at zero: small random values, so that their use in routing is tested
        import torch

        with torch.no_grad():
            for layer in self.backbone(model).layers:
                if hasattr(layer.feed_forward, "expert_bias"):
                    layer.feed_forward.expert_bias.uniform_(-0.05, 0.05)


register(Lfm2MoeAdapter())
