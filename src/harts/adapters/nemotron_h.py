"""``nemotron_h`` (NVIDIA Nemotron-H, Nemotron 3 Nano): Mamba-2 layers, grouped-query attention
without position embeddings, and separate MLP (squared-ReLU) or MoE layers.

Each decoder layer holds one block, ``residual + mixer(norm(residual))``, whose ``mixer`` is
a Mamba-2 SSD layer, an attention layer, a dense MLP or a sigmoid-routed MoE (grouped top-k with a
score-correction bias, shared experts, no auxiliary loss). Only the first two see the sequence;
the MLP and MoE blocks are token-wise and run as the stock modules.

Runs from transformers 5.24: the Mamba-2 scan of earlier versions is wrong across chunk boundaries.

Refused: ``sliding_window`` (the attention layers would slide); multi-token-prediction layers are
past ``num_hidden_layers`` and not run, as in the stock forward.
"""

from __future__ import annotations

from functools import partial

from harts.adapters.base import TINY_COMMON, FamilyAdapter, MoEBalancing, register, require
from harts.adapters.mixers import MAMBA2_MIXER_ATTRIBUTES, gqa_attention, mamba2_mixer

__all__ = ["NemotronHAdapter"]

_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling")


def _token_wise(block, x, ctx):
    """An MLP or MoE block in a mixer's place: the stock module on the unique tokens."""
    return block(x)


class NemotronHAdapter(FamilyAdapter):
    model_types = ("nemotron_h",)
    router_class = "NemotronHTopkRouter"
    moe_balancing = MoEBalancing.BIAS
    mixers = {
        "linear_attention": ("mixer", mamba2_mixer),
        "full_attention": ("mixer", partial(gqa_attention, rope=False)),
        "mlp": ("mixer", _token_wise),
        "moe": ("mixer", _token_wise),
    }
    min_transformers = {
        "nemotron_h": (
            "5.24.0",
            "the Mamba-2 scan of earlier versions carries states between chunks wrongly (on "
            "5.10.4 the logits of a 17-token sequence depend on chunk_size: 1.1e-3 apart at 8 "
            "and 64), so no training to be exact against exists there",
        )
    }

    def check_config(self, config):
        if getattr(config, "sliding_window", None) is not None:
            raise ValueError(f"nemotron_h: sliding_window={config.sliding_window} is not supported by harts")

    def check_model(self, model):
        backbone = self.backbone(model)
        require("nemotron_h", backbone, "embeddings", "layers", "norm_f")
        for i, layer in enumerate(backbone.layers[: model.config.num_hidden_layers]):
            require("nemotron_h", layer, "norm", "mixer")
            layer_type = self.layer_type(model, i)
            if layer_type == "linear_attention":
                require("nemotron_h", layer.mixer, *MAMBA2_MIXER_ATTRIBUTES)
            elif layer_type == "full_attention":
                require("nemotron_h", layer.mixer, *_ATTENTION)

    def embedding(self, backbone):
        return backbone.embeddings

    def final_norm(self, backbone):
        return backbone.norm_f

    def layer_type(self, model, index):
        return model.config.layers_block_type[index]

    def decoder_block(self, layer, hidden, mix, mlp):
        return hidden + mix(layer.norm(hidden))

    def tiny_config(self, model_type, **overrides):
        from transformers import NemotronHConfig

        fields = dict(
            TINY_COMMON,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            intermediate_size=96,
            mamba_num_heads=8,
            mamba_head_dim=16,
            ssm_state_size=16,
            n_groups=2,
            conv_kernel=4,
            chunk_size=8,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_group=2,
            topk_group=1,
            moe_intermediate_size=32,
            moe_shared_expert_intermediate_size=32,
            layer_norm_epsilon=1e-5,
            hybrid_override_pattern="M*EM-",
        )
        fields.pop("rms_norm_eps")
        return NemotronHConfig(**{**fields, **overrides})


register(NemotronHAdapter())
