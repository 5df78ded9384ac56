"""``jamba`` (AI21 Jamba): Mamba (selective scan) layers interleaved with grouped-query attention
without position embedding; each layer's feed-forward is a dense SwiGLU MLP or a softmax-routed
MoE (unnormalised top-k weights), trained with the Switch load-balancing loss.

The Mamba mixer (``JambaMambaMixer``) is run as its stock forward computes it, with the
sequence parts replaced: ``in_proj`` -> (x, gate); the depthwise causal conv1d on x along each
token's path (``ctx.conv``) and the activation; ``x_proj`` -> (dt, B, C) and Jamba's RMSNorms on
each; ``dt_proj`` and softplus; then the selective scan

    h_t[d, n] = exp(dt_t[d] A[d, n]) h_{t-1}[d, n] + dt_t[d] B_t[n] x_t[d],
    y_t[d] = sum_n C_t[n] h_t[d, n] + D[d] x_t[d]

with A = -exp(A_log), in fp32 as the stock scan. This is
:data:`~harts.ops.recurrence.GATED_LINEAR_ATTENTION` with one head per inner channel d (K = the
state size, V = 1): q = C and k = B (the same for every channel), v = dt * x, g = dt * A, scale 1;
its state hand-off carries each channel's [N, 1] state across node boundaries and cuts. Then
``y * silu(gate)`` and ``out_proj``. Layer kinds come from ``config.layers_block_type``; the
decoder layer's norms are ``input_layernorm`` and ``pre_ff_layernorm`` around ``feed_forward``,
the final norm ``final_layernorm``.

MoE statistics need a router module that returns its choice (``JambaTopKRouter``); in
transformers versions whose MoE block still routes itself, the model trains but MoE statistics
are refused as for a dense family.

Refused: ``hidden_act`` other than silu (the stock mixers gate the scan output with silu in one
transformers version and with ``hidden_act`` in another, so no single reference exists).
Layout options (``attn_layer_period/offset``, ``expert_layer_period/offset``, ``mamba_dt_rank``,
the projection and conv biases) run as configured; ``use_mamba_kernels``, ``use_mambapy`` and
``use_associative_scan`` choose how the stock code computes the same scan and do not matter here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from harts.adapters.base import TINY_COMMON, FamilyAdapter, MoEBalancing, TreeOps, register, require
from harts.adapters.gqa_family import router_if_it_chooses
from harts.ops.recurrence import GATED_LINEAR_ATTENTION

__all__ = ["JambaAdapter", "jamba_attention", "jamba_mamba", "module_norms"]

_LAYER = ("input_layernorm", "pre_ff_layernorm", "feed_forward")
_MAMBA = (
    "in_proj",
    "conv1d",
    "act",
    "x_proj",
    "dt_layernorm",
    "b_layernorm",
    "c_layernorm",
    "dt_proj",
    "A_log",
    "D",
    "out_proj",
    "time_step_rank",
    "ssm_state_size",
    "intermediate_size",
)
_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling")


def jamba_attention(attn, x, ctx: TreeOps) -> torch.Tensor:
    """Grouped-query attention without position embedding, as ``JambaAttention.forward``."""
    n = x.shape[1]
    shape = (1, n, -1, attn.head_dim)
    query = attn.q_proj(x).view(shape).transpose(1, 2)
    key = attn.k_proj(x).view(shape).transpose(1, 2)
    value = attn.v_proj(x).view(shape).transpose(1, 2)
    return attn.o_proj(ctx.attend(query, key, value, attn.scaling).reshape(1, n, -1))


def module_norms(mixer, time_step, b, c):
    """Jamba's norms on dt, B and C: the mixer's ``dt_layernorm``, ``b_layernorm``, ``c_layernorm``."""
    return mixer.dt_layernorm(time_step), mixer.b_layernorm(b), mixer.c_layernorm(c)


def jamba_mamba(mixer, x, ctx: TreeOps, norms=module_norms) -> torch.Tensor:
    """``JambaMambaMixer``'s forward over the forest (see the module docstring), its dtypes as the
    stock slow path: dt in the model's dtype, the scan in fp32 (fp64 for fp64 models), the scan
    output back in the model's dtype before the skip term and the gate. ``norms(mixer, dt, B, C)``
    gives the normed (dt, B, C); None: no norms (the plain Mamba mixer, ``mamba``)."""
    n = x.shape[1]
    dtype = x.dtype
    hidden, gate = mixer.in_proj(x)[0].chunk(2, dim=-1)  # [N, I] each
    conv = mixer.conv1d
    hidden = mixer.act(ctx.conv(hidden, conv.weight.squeeze(1), conv.bias)).to(dtype)
    state = mixer.ssm_state_size
    time_step, b, c = torch.split(mixer.x_proj(hidden), [mixer.time_step_rank, state, state], dim=-1)
    if norms is not None:
        time_step, b, c = norms(mixer, time_step, b, c)
    dt = F.softplus(mixer.dt_proj(time_step))  # [N, I]
    f = torch.promote_types(dtype, torch.float32)
    a = -torch.exp(mixer.A_log.to(f))  # [I, N]
    dt, xf = dt.to(f), hidden.to(f)
    channels = mixer.intermediate_size
    q = c.to(f)[:, None, :].expand(n, channels, state)
    k = b.to(f)[:, None, :].expand(n, channels, state)
    g = dt[..., None] * a  # [N, I, N]
    y = ctx.recurrence(GATED_LINEAR_ATTENTION, q, k, (dt * xf)[..., None], g, scale=1.0)[..., 0]
    y = y.to(dtype) + hidden * mixer.D.to(f)
    y = y * F.silu(gate)
    return mixer.out_proj(y.to(dtype)[None])


class JambaAdapter(FamilyAdapter):
    model_types = ("jamba",)
    moe_balancing = MoEBalancing.AUX_LOSS
    mixers = {"linear_attention": ("mamba", jamba_mamba), "full_attention": ("self_attn", jamba_attention)}
    inexact_cache = (
        "transformers' Jamba cache, extended by several tokens at once, restarts the Mamba layers' "
        "scan (5.24) or conv (5.10) from zeros: log-probs up to 0.36 (5.24) and 1.8 (5.10) off a full "
        "forward of the same tokens"
    )

    @property
    def router_class(self):
        return router_if_it_chooses("jamba", "JambaSparseMoeBlock", "JambaTopKRouter")

    def check_config(self, config):
        if config.hidden_act != "silu":
            raise ValueError(
                f"jamba: hidden_act={config.hidden_act!r} is not supported: the stock Mamba mixer gates "
                f"the scan output with silu in some transformers versions (and in the CUDA kernels) and "
                f"with hidden_act in others, so the model has no single reference; use silu"
            )

    def check_model(self, model):
        backbone = self.backbone(model)
        require("jamba", backbone, "embed_tokens", "layers", "final_layernorm")
        require("jamba", model.config, "layers_block_type")
        for i, layer in enumerate(backbone.layers[: model.config.num_hidden_layers]):
            require("jamba", layer, *_LAYER)
            if self.layer_type(model, i) == "linear_attention":
                require("jamba", layer, "mamba")
                require("jamba", layer.mamba, *_MAMBA)
            else:
                require("jamba", layer, "self_attn")
                require("jamba", layer.self_attn, *_ATTENTION)

    def final_norm(self, backbone):
        return backbone.final_layernorm

    def layer_type(self, model, index):
        # config.layer_types names Mamba layers "mamba" or "linear_attention" depending on the version
        kind = model.config.layers_block_type[index]
        return "linear_attention" if kind == "mamba" else "full_attention"

    def decoder_block(self, layer, hidden, mix, mlp):
        hidden = hidden + mix(layer.input_layernorm(hidden))
        return hidden + layer.feed_forward(layer.pre_ff_layernorm(hidden))

    def tiny_config(self, model_type, **overrides):
        from transformers import JambaConfig

        # layers: mamba, attention + MoE, mamba, mamba + MoE
        fields = dict(
            TINY_COMMON,
            intermediate_size=48,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_experts=4,
            num_experts_per_tok=2,
            expert_layer_period=2,
            expert_layer_offset=1,
            attn_layer_period=4,
            attn_layer_offset=1,
            mamba_d_state=8,
            mamba_d_conv=4,
            mamba_expand=2,
            mamba_dt_rank="auto",
            mamba_conv_bias=True,
            mamba_proj_bias=True,
            tie_word_embeddings=False,
        )
        return JambaConfig(**{**fields, **overrides})


register(JambaAdapter())
