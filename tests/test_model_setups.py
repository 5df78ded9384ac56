"""Models as users hold them, each against the stock Hugging Face (and stock peft) computation of
every trajectory alone, in fp64 with the exact linear-attention kernels (``tests/reference.py``).

- LoRA on the head and on every projection (peft ``PeftModel``): SFT loss and the LoRA gradients,
  without and with a token budget; a forward hook on the head; a head with a bias.
- Sampling temperature: log-probs and entropies of ``softmax(logits / T)``, and the step's loss
  and gradients.
- Frozen parameters (a frozen layer, head-only training) with and without a budget.
- Activation checkpointing: honoured per layer (fewer saved bytes), the same gradients.
- Padded (left and right) and packed batches: the same forest, annotations carried, results
  back in the caller's layout.
- Refused before any compute, with one line naming what: dropout in train mode, hooks harts would
  skip, a DDP-wrapped model, peft prompt tuning, meta parameters, length-dependent RoPE.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch
from peft import LoraConfig, PromptTuningConfig, get_peft_model

import harts
from harts.bench.checkpointing import saved_bytes
from harts.runtime.distributed import close_process_group
from harts.tiny import tiny_model
from tests.reference import (
    GRAD_RTOL,
    LOGIT_ATOL,
    exact_linear_kernels,
    fp64_copy,
    grad_relative_errors,
    param_grads,
)

VOCAB = 128
LOSS_RTOL = 1e-5
SUM = harts.Normalizers(torch.tensor(1.0), torch.tensor(1.0))  # token mean over 1 token: the sum
SFT = harts.PolicyLossConfig(kind="sft")
LORA_TARGETS = [
    "lm_head", "q_proj", "k_proj", "v_proj", "o_proj", "b_proj", "g_proj", "kv_a_proj_with_mqa", "kv_b_proj",
    "in_proj_qkvz", "in_proj_ba", "out_proj", "gate_proj", "up_proj", "down_proj",
]  # fmt: skip


def _trajectories() -> list[list[int]]:
    rng = random.Random(3)
    p = [rng.randrange(3, VOCAB) for _ in range(9)]
    return [p + [rng.randrange(3, VOCAB) for _ in range(n)] for n in (5, 8, 3)] + [p[:6] + [40, 41, 42]]


TRAJS = _trajectories()


def reference_sft(model64, trajectories, temperature=1.0, base=None):
    """fp64 SFT sum over next tokens of each trajectory alone, its gradients, and the log-probs."""
    model64.zero_grad(set_to_none=True)
    total, logprobs = 0.0, []
    with exact_linear_kernels(base if base is not None else model64):
        for t in trajectories:
            ids = torch.tensor([t])
            logits = model64(input_ids=ids).logits[0, :-1] / temperature
            logp = torch.log_softmax(logits, -1)
            lp = logp.gather(1, ids[0, 1:, None])[:, 0]
            (-lp.sum()).backward()
            total += float(-lp.sum().detach())
            logprobs.append((lp.detach(), -(logp.exp() * logp).sum(-1).detach()))
    return total, param_grads(model64), logprobs


def assert_step_matches(result, grads, ref_loss, ref_grads):
    loss = float(result.loss)
    assert abs(loss - ref_loss) <= LOSS_RTOL * max(1.0, abs(ref_loss)), (loss, ref_loss)
    errors = grad_relative_errors(grads, ref_grads)
    worst = max(errors, key=errors.get)
    assert errors[worst] <= GRAD_RTOL, f"gradient of {worst}: relative error {errors[worst]:.3g}"


def _step(model, trajectories=TRAJS, **kwargs):
    model.zero_grad(set_to_none=True)
    rollouts = [harts.Rollout(t) for t in trajectories]
    result = harts.rollout_step(model, rollouts, SFT, normalizers=SUM, **kwargs)
    return result, param_grads(model)


# ---- LoRA and the head as a module ---------------------------------------------------------------
def _lora_pair(family):
    """(peft fp32 model, peft fp64 model with the same weights, fp64 base) with random LoRA weights."""
    base = tiny_model(family, seed=5)
    base64 = fp64_copy(base, cache=False)

    def config():  # random A and B (peft's default B = 0 would give A no gradient)
        return LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS, init_lora_weights=False)

    torch.manual_seed(0)
    peft32 = get_peft_model(base, config())
    peft64 = get_peft_model(base64, config())
    peft64.load_state_dict({k: v.double() for k, v in peft32.state_dict().items()})
    return peft32, peft64, base64


@pytest.mark.parametrize("budget", [None, 5], ids=["whole", "budget5"])
@pytest.mark.parametrize("family", ["bailing_hybrid", "qwen3_next", "kimi_linear", "llama"])
def test_lora_everywhere_matches_stock_peft(family, budget):
    peft32, peft64, base64 = _lora_pair(family)
    trainable = [n for n, p in peft32.named_parameters() if p.requires_grad]
    assert any("lm_head" in n for n in trainable) and all("lora" in n for n in trainable)
    ref_loss, ref_grads, _ = reference_sft(peft64, TRAJS, base=base64)
    result, grads = _step(peft32, budget_tokens=budget)
    if budget is not None:
        assert result.num_micro_batches > 2
    assert_step_matches(result, grads, ref_loss, ref_grads)
    head_grads = [g for n, g in grads.items() if "lm_head" in n]
    assert head_grads and all(g.norm() > 0 for g in head_grads), "LoRA on the head gets a gradient"


def test_hooked_head_and_head_bias_match_stock():
    model = tiny_model("qwen3_next", seed=2)
    model64 = fp64_copy(model, cache=False)
    with torch.no_grad():  # a head with a bias, in place of the bias-free stock head
        head = torch.nn.Linear(model.config.hidden_size, VOCAB, bias=True)
        head.weight.copy_(model.lm_head.weight)
        head.bias.normal_(0, 0.5)
    model.lm_head, model64.lm_head = head, copy.deepcopy(head).double()
    for m in (model, model64):
        m.lm_head.register_forward_hook(lambda mod, args, out: 0.7 * out + 0.3)
    ref_loss, ref_grads, _ = reference_sft(model64, TRAJS)
    for budget in (None, 4):
        result, grads = _step(model, budget_tokens=budget)
        assert_step_matches(result, grads, ref_loss, ref_grads)
    assert grads["lm_head.bias"].norm() > 0


# ---- temperature ---------------------------------------------------------------------------------
@pytest.mark.parametrize("head", ["linear", "module"])
@pytest.mark.parametrize("family", ["bailing_hybrid", "llama"])
def test_temperature_is_stock_log_softmax_of_scaled_logits(family, head):
    model = tiny_model(family, seed=4)
    handle = model.lm_head.register_forward_hook(lambda m, a, out: out) if head == "module" else None
    try:
        model64 = fp64_copy(model, cache=False)
        ref_loss, ref_grads, ref_lp = reference_sft(model64, TRAJS, temperature=0.6)
        result, grads = _step(model, temperature=0.6, budget_tokens=6)
        assert_step_matches(result, grads, ref_loss, ref_grads)
        with torch.no_grad():
            out = harts.forward(model, harts.build_forest(TRAJS))
            for i, (lp, _) in enumerate(ref_lp):
                got = out.trajectory_logprobs(i, temperature=0.6)
                assert torch.allclose(got, lp.float(), atol=LOGIT_ATOL)
            idx = out.forest.trajectory_token_indices(0)
            _, got_ent = out.logprobs(idx[:-1], out.forest.tokens[idx[1:]], temperature=0.6)
            assert torch.allclose(got_ent, ref_lp[0][1].float(), atol=LOGIT_ATOL)
            plain = out.trajectory_logprobs(0)
            assert (plain - ref_lp[0][0].float()).abs().max() > 1e-2, "the temperature changes the log-probs"
    finally:
        if handle is not None:
            handle.remove()


def test_temperature_given_twice_must_agree():
    model = tiny_model("llama", seed=0)
    config = harts.PolicyLossConfig(kind="sft", temperature=0.7)
    with pytest.raises(ValueError, match="disagrees"):
        harts.rollout_step(model, [harts.Rollout([3, 4, 5])], config, temperature=0.9)
    for bad in (0.0, -1.0, float("inf")):
        with pytest.raises(ValueError, match="temperature"):
            harts.PolicyLossConfig(temperature=bad)


# ---- frozen parameters ---------------------------------------------------------------------------
@pytest.mark.parametrize("frozen", ["layer0-and-embeddings", "head-only"])
@pytest.mark.parametrize("family", ["bailing_hybrid", "qwen3_next"])
def test_frozen_parameters_with_and_without_budget(family, frozen):
    model = tiny_model(family, seed=6)
    for name, p in model.named_parameters():
        keep = (
            name.startswith("lm_head")
            if frozen == "head-only"
            else not (name.startswith("model.layers.0.") or "embed_tokens" in name)
        )
        p.requires_grad_(keep)
    model64 = fp64_copy(model, cache=False)
    for name, p in model64.named_parameters():
        p.requires_grad_(dict(model.named_parameters())[name].requires_grad)
    ref_loss, ref_grads, _ = reference_sft(model64, TRAJS)
    for budget in (None, 1, 5):
        result, grads = _step(model, budget_tokens=budget)
        assert set(grads) == set(ref_grads)
        assert_step_matches(result, grads, ref_loss, ref_grads)


# ---- activation checkpointing --------------------------------------------------------------------
@pytest.mark.parametrize("family", ["bailing_hybrid", "qwen3_next", "llama"])
def test_gradient_checkpointing_is_honoured_per_layer(family):
    model = tiny_model(family, seed=8).train()
    forest = harts.build_forest(TRAJS)

    def forward_only():
        return harts.forward(model, forest).hidden_states.sum()

    plain = saved_bytes(forward_only)
    ref_grads = [_step(model, budget_tokens=b)[1] for b in (None, 4)]
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    try:
        checkpointed = saved_bytes(forward_only)
        for ref, budget in zip(ref_grads, (None, 4), strict=True):
            _, grads = _step(model, budget_tokens=budget)
            errors = grad_relative_errors(grads, ref)
            assert max(errors.values()) <= 1e-6, max(errors.items(), key=lambda kv: kv[1])
    finally:
        model.gradient_checkpointing_disable()
    # only each layer's input stays saved: several times fewer bytes than the whole graph
    assert checkpointed * 3 < plain, (checkpointed, plain)


# ---- padded and packed batches -------------------------------------------------------------------
def _padded(trajectories, left: bool):
    width = max(map(len, trajectories))
    ids = torch.zeros(len(trajectories), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, t in enumerate(trajectories):
        cols = slice(width - len(t), width) if left else slice(0, len(t))
        ids[b, cols], mask[b, cols] = torch.tensor(t), 1
    return ids, mask


@pytest.mark.parametrize("padding", ["left", "right"])
def test_padded_batch_equals_its_trajectories(padding):
    ids, mask = _padded(TRAJS, left=padding == "left")
    forest = harts.build_forest(ids, attention_mask=mask)
    reference = harts.build_forest(TRAJS)
    assert forest.num_tokens == reference.num_tokens and forest.redundancy == reference.redundancy
    for i, t in enumerate(TRAJS):
        assert forest.trajectory(i).tolist() == t
    # annotations in the caller's layout, results back in it
    model = tiny_model("bailing_hybrid", seed=1)
    gen = torch.Generator().manual_seed(0)
    old = -torch.rand(ids.shape, generator=gen)
    adv = torch.randn(ids.shape, generator=gen)
    response = mask.clone()
    response[:, :] = 0
    for b in range(len(TRAJS)):  # the last four tokens of each trajectory are the response
        cols = (mask[b] > 0).nonzero()[:, 0]
        response[b, cols[-4:]] = 1
    rollouts = harts.rollouts_from_batch(ids, mask, loss_mask=response, rollout_logprobs=old, advantages=adv)
    config = harts.PolicyLossConfig(kind="ppo")
    model.zero_grad(set_to_none=True)
    result = harts.rollout_step(model, rollouts, config, budget_tokens=5)
    grads = param_grads(model)
    lists = [
        harts.Rollout(t, loss_mask=r.loss_mask, rollout_logprobs=r.rollout_logprobs, advantages=r.advantages)
        for t, r in zip(TRAJS, rollouts, strict=True)
    ]
    model.zero_grad(set_to_none=True)
    expected = harts.rollout_step(model, lists, config, budget_tokens=5)  # the same forest, the same plan
    assert float(result.loss) == float(expected.loss)
    errors = grad_relative_errors(grads, param_grads(model))
    assert max(errors.values()) <= 1e-6
    per_token = result.to_batch()
    assert per_token.shape == ids.shape
    assert torch.equal(per_token != 0, response.bool()), "values exactly at the response tokens"
    with torch.no_grad():
        out = harts.forward(model, harts.build_forest(TRAJS))
        for b in range(len(TRAJS)):
            lp = out.trajectory_logprobs(b)[-4:]
            assert torch.allclose(per_token[b][response[b].bool()], lp, atol=1e-5)


def test_packed_batch_with_cu_seqlens_or_position_ids():
    flat = torch.tensor([tok for t in TRAJS for tok in t])
    lengths = [len(t) for t in TRAJS]
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)))
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    for forest in (
        harts.build_forest(flat, cu_seqlens=cu),
        harts.build_forest(flat[None], position_ids=positions),
    ):
        assert [forest.trajectory(i).tolist() for i in range(len(TRAJS))] == TRAJS
    rollouts = harts.rollouts_from_batch(flat, cu_seqlens=cu)
    model = tiny_model("llama", seed=1)
    result = harts.rollout_step(model, rollouts, SFT)
    packed = result.to_batch()
    assert packed.shape == flat.shape and torch.all(packed[cu[:-1]] == 0)  # first tokens have no row


def test_batch_layouts_refuse_what_they_cannot_tell():
    ids, mask = _padded(TRAJS, left=False)
    with pytest.raises(ValueError, match="pass attention_mask"):
        harts.build_forest(ids)
    holed = mask.clone()
    holed[0, 2] = 0
    with pytest.raises(ValueError, match="trajectory 0, position 2: padding inside the sequence"):
        harts.build_forest(ids, attention_mask=holed)
    with pytest.raises(ValueError, match="cu_seqlens must rise"):
        harts.build_forest(torch.tensor([1, 2, 3]), cu_seqlens=[0, 2, 2, 3])
    with pytest.raises(ValueError, match="position_ids at 2"):
        harts.build_forest(torch.tensor([1, 2, 3]), position_ids=torch.tensor([0, 1, 3]))
    with pytest.raises(ValueError, match="advantages has shape"):
        harts.rollouts_from_batch(ids, mask, advantages=torch.zeros(2, 2))


# ---- refused before compute ----------------------------------------------------------------------
def _refused(model, match, error=ValueError, **step):
    calls = []
    target = model.get_base_model() if hasattr(model, "get_base_model") else getattr(model, "module", model)
    handle = target.model.embed_tokens.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        with pytest.raises(error, match=match):
            harts.rollout_step(model, [harts.Rollout(t) for t in TRAJS], SFT, **step)
        with pytest.raises(error, match=match):
            harts.forward(model, harts.build_forest(TRAJS))
    finally:
        handle.remove()
    assert calls == [], "no model compute may run before the setup is checked"


def test_dropout_in_train_mode_is_refused():
    model = tiny_model("qwen3_next", seed=0, attention_dropout=0.1)
    _refused(model.train(), r"dropout is active in train mode \(config.attention_dropout=0.1\)")
    result, _ = _step(model.eval())  # eval mode: no dropout, runs
    assert torch.isfinite(result.loss)


def test_hooks_harts_would_skip_are_refused():
    model = tiny_model("bailing_hybrid", seed=0)
    with torch.no_grad():  # transformers leaves inert output-capturing hooks on the layers: accepted
        model(input_ids=torch.tensor([TRAJS[0]]), output_hidden_states=True, output_router_logits=True)
        harts.forward(model, harts.build_forest(TRAJS))
    hooked = [
        (model.model.layers[1], "model.layers.1"),
        (model.model.layers[0].self_attn, "model.layers.0.self_attn"),
    ]
    for module, name in hooked:
        handle = module.register_forward_hook(lambda *a: None)
        try:
            _refused(model, f"a hook on {name} .* would not run")
        finally:
            handle.remove()
    qwen = tiny_model("qwen3_next", seed=0)
    conv = qwen.model.layers[0].linear_attn.conv1d
    handle = conv.register_forward_hook(lambda *a: None)
    try:
        _refused(qwen, "layers.0.linear_attn.conv1d is a Conv1d with hooks: harts reads the short conv")
    finally:
        handle.remove()

    class AdaptedConv(torch.nn.Conv1d):  # e.g. an adapter library's wrapper
        pass

    adapted = AdaptedConv(conv.in_channels, conv.out_channels, conv.kernel_size, groups=conv.groups)
    qwen.model.layers[0].linear_attn.conv1d = adapted
    _refused(qwen, "conv1d is a AdaptedConv: harts reads the short convolution's weight directly")


def test_wrapped_models(tmp_path):
    model = tiny_model("llama", seed=0)
    compiled = torch.compile(model)
    forest = harts.build_forest(TRAJS)
    with torch.no_grad():
        assert torch.equal(
            harts.forward(compiled, forest).hidden_states, harts.forward(model, forest).hidden_states
        )
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        with pytest.raises(ValueError, match="wrapped in DistributedDataParallel.*rollout_step"):
            harts.forward(ddp, forest)  # no gradient synchronisation there: refused
        rollouts = [harts.Rollout(t) for t in TRAJS]
        stepped = harts.rollout_step(ddp, rollouts, SFT)  # the step synchronises (one rank here)
        grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        plain = harts.rollout_step(model, rollouts, SFT)
        assert torch.equal(stepped.loss, plain.loss)
        assert all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters(), strict=True))
    finally:
        close_process_group(wait=False)
    prompt = get_peft_model(
        tiny_model("llama", seed=0), PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=2)
    )
    _refused(prompt, "PromptTuningConfig adds virtual tokens")


def test_meta_parameters_and_length_dependent_rope_are_refused():
    with torch.device("meta"):
        meta = tiny_model("llama", seed=0)
    with pytest.raises(ValueError, match="on the meta device"):
        harts.forward(meta, harts.build_forest(TRAJS))
    dynamic = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    longrope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8,
                "long_factor": [1.0] * 8, "original_max_position_embeddings": 64}  # fmt: skip
    for rope in (dynamic, longrope):  # both ends of the supported transformers build these configs
        _refused(tiny_model("llama", seed=0, rope_parameters=rope), "rescales by sequence length")
