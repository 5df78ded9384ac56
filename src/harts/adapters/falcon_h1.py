"""``falcon_h1`` (TII Falcon-H1): every decoder layer runs a Mamba-2 mixer and a grouped-query
attention with RoPE *in parallel* on the same normed input; their scaled outputs are summed into
the residual stream, followed by a SwiGLU MLP.

The layer, as the stock forward computes it (``x = input_layernorm(h)``)::

    h = h + ssm_out_multiplier * mamba(x) + attention_out_multiplier * attention(attention_in_multiplier * x)
    h = h + feed_forward(pre_ff_layernorm(h))

Both mixers reach the sequence through the same context: the attention hands its keys/values
over micro-batch cuts, the Mamba-2 mixer its conv inputs and scan states, each in its own slot of
the layer's hand-over.

Falcon-H1's muP multipliers, as the stock modules apply them:

- ``embedding_multiplier``: the token embeddings are scaled before the first layer;
- ``ssm_in_multiplier`` on the Mamba input and ``ssm_multipliers`` (the module's ``mup_vector``)
  on the ``in_proj`` outputs (z, x, B, C, dt), both inside
  :func:`~harts.adapters.mixers.mamba2_mixer`'s projection; ``mamba_rms_norm`` chooses the gated
  RMSNorm (``mamba_norm_before_gate``, ``n_groups``: the module's own) or ``y * silu(z)``;
- ``key_multiplier`` on the keys before RoPE; the attention scale is ``head_dim ** -0.5``;
- ``mlp_multipliers``: inside the stock MLP module, which runs as is;
- ``lm_head_multiplier``: the stock forward multiplies the logits by it after ``lm_head``. harts
  reads the head from the final hidden states (per trajectory, or chunked log-probs that use the
  head's weight directly), so the factor is applied to the final norm's output instead: for a head
  without bias, ``lm_head(h * m) = lm_head(h) * m`` (equal up to rounding). The final hidden
  states harts returns are therefore the stock ones times ``lm_head_multiplier``.
"""

from __future__ import annotations

from functools import partial

import torch

from harts.adapters.base import TINY_COMMON, FamilyAdapter, Scaled, TreeOps, hf_function, register, require
from harts.adapters.mixers import mamba2_mixer

__all__ = ["FalconH1Adapter", "falcon_h1_attention"]

_LAYER = (
    "input_layernorm",
    "pre_ff_layernorm",
    "feed_forward",
    "mamba",
    "self_attn",
    "attention_in_multiplier",
    "ssm_out_multiplier",
    "attn_out_multiplier",
)
_MAMBA = (
    "in_proj",
    "conv1d",
    "activation",
    "dt_bias",
    "A_log",
    "D",
    "out_proj",
    "num_heads",
    "head_dim",
    "ssm_state_size",
    "intermediate_size",
    "n_groups",
    "conv_dim",
    "time_step_limit",
    "mamba_rms_norm",
    "ssm_in_multiplier",
    "mup_vector",
)
_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling", "key_multiplier")


def falcon_h1_attention(attn, x, ctx: TreeOps) -> torch.Tensor:
    """``FalconH1Attention.forward``: keys scaled by ``key_multiplier`` before RoPE."""
    n = x.shape[1]
    shape = (1, n, -1, attn.head_dim)
    query = attn.q_proj(x).view(shape).transpose(1, 2)
    key = attn.k_proj(x).view(shape).transpose(1, 2) * attn.key_multiplier
    value = attn.v_proj(x).view(shape).transpose(1, 2)
    cos, sin = ctx.position_embeddings
    query, key = hf_function(attn, "apply_rotary_pos_emb")(query, key, cos, sin)
    return attn.o_proj(ctx.attend(query, key, value, attn.scaling).reshape(1, n, -1))


def _projection(mixer, x):
    """Falcon-H1's Mamba input projection with its muP multipliers, in the stock order."""
    return mixer.in_proj(x * mixer.ssm_in_multiplier) * mixer.mup_vector


def _parallel(mamba, x, ctx: TreeOps, layer) -> torch.Tensor:
    """Both mixers of one layer on the same normed input, scaled and summed as the stock layer."""
    ssm = mamba2_mixer(mamba, x, ctx, gated_norm=mamba.mamba_rms_norm, project=_projection)
    ssm = ssm * layer.ssm_out_multiplier
    attention = falcon_h1_attention(layer.self_attn, x * layer.attention_in_multiplier, ctx)
    return ssm + attention * layer.attn_out_multiplier


class FalconH1Adapter(FamilyAdapter):
    model_types = ("falcon_h1",)
    # one layer type: the Mamba mixer stands as the layer's mixer, the attention runs beside it
    mixers = {"hybrid": ("mamba", _parallel)}
    parallel_attention = "self_attn"
    exact_cache_from = "5.24.0"  # 5.10.4: 0.014 off after a branch point

    def check_model(self, model):
        backbone = self.backbone(model)
        require(
            "falcon_h1",
            backbone,
            "embed_tokens",
            "layers",
            "final_layernorm",
            "rotary_emb",
            "embedding_multiplier",
            "lm_head_multiplier",
        )
        if backbone.lm_head_multiplier != 1 and getattr(model.lm_head, "bias", None) is not None:
            raise ValueError(
                f"falcon_h1: lm_head_multiplier={backbone.lm_head_multiplier} with a biased lm_head: harts "
                f"folds the multiplier into the head's input, which is exact only for a head without bias"
            )
        for layer in backbone.layers[: model.config.num_hidden_layers]:
            require("falcon_h1", layer, *_LAYER)
            require("falcon_h1", layer.mamba, *_MAMBA)
            if layer.mamba.mamba_rms_norm:
                require("falcon_h1", layer.mamba, "norm")
            require("falcon_h1", layer.self_attn, *_ATTENTION)

    def embedding(self, backbone):
        return Scaled(backbone.embed_tokens, backbone.embedding_multiplier)

    folds_logit_scale = True  # final_norm scales by the head multiplier (module docstring)

    def final_norm(self, backbone):
        return Scaled(backbone.final_layernorm, backbone.lm_head_multiplier)

    def layer_type(self, model, index):
        return "hybrid"

    def decoder_block(self, layer, hidden, mix, mlp):
        hidden = hidden + mix(layer.input_layernorm(hidden))
        return hidden + layer.feed_forward(layer.pre_ff_layernorm(hidden))

    def mixer(self, layer, layer_type):
        module, parallel = super().mixer(layer, layer_type)
        return module, partial(parallel, layer=layer)  # the layer holds the attention and the multipliers

    def tiny_config(self, model_type, **overrides):
        from transformers import FalconH1Config

        fields = dict(
            TINY_COMMON,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=96,
            mamba_d_ssm=128,
            mamba_n_heads=8,
            mamba_d_head=16,
            mamba_n_groups=2,
            mamba_d_state=16,
            mamba_d_conv=4,
            mamba_chunk_size=8,
            mamba_rms_norm=True,
            mamba_norm_before_gate=False,
            tie_word_embeddings=False,
            embedding_multiplier=1.5,
            lm_head_multiplier=0.5,
            key_multiplier=0.7,
            attention_in_multiplier=0.8,
            attention_out_multiplier=0.9,
            ssm_in_multiplier=1.2,
            ssm_out_multiplier=0.6,
            ssm_multipliers=[0.9, 1.1, 0.8, 1.3, 0.7],
            mlp_multipliers=[1.2, 0.8],
        )
        fields.pop("rms_norm_eps")
        return FalconH1Config(**{**fields, **overrides}, rms_norm_eps=1e-5)


register(FalconH1Adapter())
