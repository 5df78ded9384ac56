"""One rank of the sharded verl engine test, started by ``torchrun`` (gloo, CPU): see
test_integrations_verl_sharded.py.

``torchrun --nproc_per_node=2 tests/verl_worker.py MODEL_DIR OUT``

Each rank builds verl's own FSDP2 actor engine (``FSDPEngineWithLMHead``) and ``HartsFSDPEngine``
from the same checkpoint with the same configuration (parameters sharded over the ranks,
``reshard_after_forward`` as verl sets it), then runs each :data:`VARIANTS` entry on both: a
forward-only pass (``infer_batch``, verl's ``compute_log_prob``) and one
``forward_backward_batch`` of verl's ``ppo_loss`` over this rank's batch (its own sequences,
different on each rank), with the full gradients. After the last variant's gradients both
engines take verl's optimizer step. The critic goes the same way: verl's
``FSDPEngineWithValueHead`` and ``HartsFSDPCriticEngine`` built from one ``*ForTokenClassification``
checkpoint (``num_labels=1``), each :data:`CRITIC_VARIANTS` entry run on both (``infer_batch``,
verl's ``compute_values``, then ``forward_backward_batch`` of verl's ``value_loss``), the last
one followed by the optimizer step. Then the configurations the harts engines refuse are built,
and their messages kept. Rank 0 writes every rank's results to ``OUT`` (``torch.save``, a list by rank).

What verl needs to run on CPU processes, and nothing else: a platform plugin for the CPU
(verl 0.9 registers CUDA, NPU and ROCm only; :class:`CPUPlatform` through verl's own
``set_platform``), eager attention (verl defaults to flash-attention), no ``torch.compile`` of
the entropy, fp32 mixed precision (so both sides run fp32), no tokenizer, ``trl`` hidden
from verl's model patching, which imports a value-head class that trl >= 1 no longer has (the
critic is a ``*ForTokenClassification`` and needs none), and verl's critic loader
(``load_valuehead_model``) with eager attention: it asks transformers for flash-attention
outright, not through the model config's override.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

sys.modules["trl"] = None  # see the module docstring: verl's monkey patch probes trl for a value head

from tensordict import TensorDict  # noqa: E402
from verl.plugin.platform.platform_base import PlatformBase  # noqa: E402
from verl.plugin.platform.platform_manager import set_platform  # noqa: E402
from verl.utils import model as verl_model  # noqa: E402

from harts.runtime.distributed import close_process_group  # noqa: E402
from harts.tiny import tiny_model  # noqa: E402
from tests.critic_models import critic as tiny_critic  # noqa: E402
from tests.helpers import prompt_response_batch  # noqa: E402

TEMPERATURE = 0.7
# (name, loss_agg_mode, verl's dynamic micro-batching, harts' token budget per micro-batch)
VARIANTS = [
    ("token-mean", "token-mean", True, None),
    ("seq-mean-token-mean", "seq-mean-token-mean", False, None),
    # a budget cuts each micro-batch's forest: verl's loss takes harts' three passes
    ("seq-mean-token-sum-norm-budget", "seq-mean-token-sum-norm", False, 12),
]
CRITIC_VARIANTS = [
    ("critic-token-mean", "token-mean", True, None),
    # a budget cuts each micro-batch's forest: verl's value loss takes harts' three passes
    ("critic-seq-mean-token-sum-norm-budget", "seq-mean-token-sum-norm", False, 12),
]
CLIPRANGE_VALUE = 0.2


class CPUPlatform(PlatformBase):
    """verl's platform interface for CPU processes: devices are "cpu", collectives gloo."""

    device_name = "cpu"
    vendor_name = "cpu"
    device_module = torch.cpu

    def is_available(self):
        return True

    def current_device(self):
        return "cpu"

    def device_count(self):
        return 1

    def set_device(self, device_index):
        pass

    def synchronize(self, device_index=None):
        pass

    def manual_seed(self, seed):
        torch.manual_seed(seed)

    def manual_seed_all(self, seed):
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings):
        pass

    def empty_cache(self):
        pass

    def get_device_capability(self, device_index=0):
        return None, None

    def communication_backend_name(self):
        return "gloo"

    def visible_devices_envvar(self):
        return "CPU_VISIBLE_DEVICES"

    @contextlib.contextmanager
    def nvtx_range(self, msg):
        yield

    def profiler_start(self):
        pass

    def profiler_stop(self):
        pass

    def ray_resource_name(self):
        return "CPU"

    def ray_noset_envvars(self):
        return []

    def is_ipc_supported(self):
        return False

    def cudart(self):
        return None


def batch(rank: int, dynamic: bool, critic: bool = False) -> TensorDict:
    """This rank's mini-batch as verl's trainer hands the actor one: two prompts of three responses
    (lengths differ by rank), left/right padded, converted by verl's own ``left_right_2_no_padding``,
    with the global batch size of both ranks. The critic's (``critic``) also has the rollout-time
    ``values`` and the ``returns``, response-aligned [B, R]: the values spread so that some of
    the new ones fall outside ``CLIPRANGE_VALUE`` of them and some inside (both branches of the
    clipped loss)."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    gen = torch.Generator().manual_seed(10 + rank)
    prompts, responses = [], []
    for _ in range(2):
        width = int(torch.randint(3, 9, (1,), generator=gen))
        prompt = torch.randint(3, 128, (width,), generator=gen).tolist()
        for _ in range(3):
            length = int(torch.randint(2, 7 + 3 * rank, (1,), generator=gen))
            prompts.append(prompt)
            responses.append(torch.randint(3, 128, (length,), generator=gen).tolist())
    size, width_r = len(prompts), max(map(len, responses))
    fields = prompt_response_batch(prompts, responses)
    loss_mask = fields["response_mask"]
    loss_mask[1, 1] = 0  # a tool-output token inside a response
    data = TensorDict(
        {
            **fields,
            "old_log_probs": -torch.rand(size, width_r, generator=gen) * 3 - 3,
            "advantages": torch.randn(size, generator=gen)[:, None].expand(size, width_r).clone(),
        },
        batch_size=[size],
    )  # fmt: skip
    if critic:
        data["values"] = torch.randn(size, width_r, generator=gen) * 0.3
        data["returns"] = torch.randn(size, width_r, generator=gen)
    data = left_right_2_no_padding(data)
    tu.assign_non_tensor(
        data, temperature=TEMPERATURE, calculate_entropy=True, global_batch_size=2 * size,
        use_remove_padding=True, use_fused_kernels=False, return_model_output=True,
        use_dynamic_bsz=dynamic, max_token_len_per_gpu=40, micro_batch_size_per_gpu=3,
    )  # fmt: skip
    return data


def model_config(model_dir: str, model_type: str = "language_model"):
    from verl.workers.config import HFModelConfig

    eager = {"attn_implementation": "eager"}
    return HFModelConfig(path=model_dir, load_tokenizer=False, override_config=eager, model_type=model_type)


def load_value_model_eager(local_path, torch_dtype, model_config, trust_remote_code):
    """verl's ``load_valuehead_model`` for a ``*ForTokenClassification`` checkpoint, with eager
    attention in place of the flash-attention it asks for (module docstring)."""
    from transformers import AutoModelForTokenClassification

    return AutoModelForTokenClassification.from_pretrained(
        local_path, dtype=torch_dtype, config=model_config, attn_implementation="eager",
        trust_remote_code=trust_remote_code,
    )  # fmt: skip


def engine_classes(model_type: str) -> tuple[type, type]:
    """verl's own engine for ``model_type`` and the harts one."""
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead, FSDPEngineWithValueHead

    from harts.integrations.verl import register_critic_engine, register_engine, unregister_engine

    if model_type == "value_model":
        pair = FSDPEngineWithValueHead, register_critic_engine()
    else:
        pair = FSDPEngineWithLMHead, register_engine()
    unregister_engine()
    return pair


def engines(model_dir: str, model_type: str = "language_model"):
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig

    built = []
    for cls in engine_classes(model_type):
        model = model_config(model_dir, model_type)
        fp32 = {"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"}
        engine_config = FSDPEngineConfig(strategy="fsdp2", use_torch_compile=False, mixed_precision=fp32)
        engine = cls(model, engine_config, FSDPOptimizerConfig(lr=1e-3), CheckpointConfig())
        engine.initialize()
        built.append(engine)
    return built


def full_grads(module) -> dict[str, torch.Tensor]:
    return {n: p.grad.full_tensor().clone() for n, p in module.named_parameters() if p.grad is not None}


def full_params(module) -> dict[str, torch.Tensor]:
    return {n: p.full_tensor().detach().clone() for n, p in module.named_parameters()}


def metric_values(metrics: dict) -> dict[str, list[float]]:
    out = {}
    for name, values in metrics.items():
        values = values if isinstance(values, list) else [values]
        flat = []
        for v in values:
            flat += [float(x) for x in v.values] if hasattr(v, "values") else [float(v)]  # verl's Metric
        out[name] = flat
    return out


def run(engine, loss_fn, dynamic: bool, budget, rank: int, step: bool, critic: bool = False) -> dict:
    """One variant on one engine: its forward-only pass, then one ``forward_backward_batch`` of
    ``loss_fn`` (and verl's optimizer step with ``step``); the model output's fields (the actor's
    log-probs and entropies, the critic's values), flat, as ``KEY`` and ``infer_KEY``."""
    import harts

    engine.harts_run = harts.RunConfig(budget_tokens=budget) if budget is not None else None
    with engine.eval_mode():  # first: the step below changes the parameters
        inferred = engine.infer_batch(batch(rank, dynamic, critic), loss_function=None)
    with engine.train_mode():
        engine.optimizer_zero_grad()
        out = engine.forward_backward_batch(batch(rank, dynamic, critic), loss_fn, forward_only=False)
        result = {"grads": full_grads(engine.module)}
        if step:  # verl's clipping and AdamW on these gradients
            result["grad_norm"] = engine.optimizer_step()
            result["params"] = full_params(engine.module)
    keys = ("values",) if critic else ("log_probs", "entropy")
    for key in keys:
        result[key] = out["model_output"][key].values().detach().clone()
        result[f"infer_{key}"] = inferred["model_output"][key].values().clone()
    offsets = out["model_output"][keys[0]].offsets().clone()
    return {**result, "loss": out["loss"], "metrics": metric_values(out["metrics"]), "offsets": offsets}


def cuts(rank: int, budget: int) -> list[int]:
    """Cut trees per micro-batch under ``budget`` (fixed micro-batches of 3: one group each)."""
    import harts
    from harts.plan.micro_batches import plan_micro_batches

    data = batch(rank, dynamic=False)
    ids = data["input_ids"]
    seqs = list(torch.split(ids.values(), ids.offsets().diff().tolist()))
    return [plan_micro_batches(harts.build_forest(seqs[i : i + 3]), budget).num_cuts for i in (0, 3)]


def refusals(model_dir: str) -> dict[str, str]:
    """The message each configuration the harts engine cannot run exactly is refused with."""
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig

    fp32 = {"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"}
    cases = {  # name: (model type, engine config)
        "fsdp1": ("language_model", dict(strategy="fsdp", mixed_precision=fp32)),
        "ulysses": (
            "language_model",
            dict(strategy="fsdp2", mixed_precision=fp32, ulysses_sequence_parallel_size=2),
        ),
        "hsdp": ("language_model", dict(strategy="fsdp2", mixed_precision=fp32, fsdp_size=1)),
        "fp16": ("language_model", dict(strategy="fsdp2", mixed_precision={**fp32, "param_dtype": "fp16"})),
        "critic-fsdp1": ("value_model", dict(strategy="fsdp", mixed_precision=fp32)),
    }
    messages = {}
    for name, (model_type, fields) in cases.items():
        path = critic_dir(model_dir) if model_type == "value_model" else model_dir
        model = model_config(path, model_type)
        config = FSDPEngineConfig(use_torch_compile=False, **fields)
        engine_class = engine_classes(model_type)[1]
        try:
            engine_class(model, config, FSDPOptimizerConfig(lr=1e-3), CheckpointConfig()).initialize()
        except ValueError as err:
            messages[name] = str(err)
        else:
            messages[name] = "not refused"
    return messages


def critic_dir(model_dir: str) -> str:
    return f"{model_dir}-critic"


def units(module) -> list[str]:
    from torch.distributed.fsdp import FSDPModule

    return [name for name, m in module.named_modules() if isinstance(m, FSDPModule)]


def main() -> None:
    model_dir, out = sys.argv[1:]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    set_platform(CPUPlatform())
    verl_model.load_valuehead_model = load_value_model_eager
    rank = dist.get_rank()
    try:
        if rank == 0:
            model = tiny_model("qwen3", seed=3)
            model.config.architectures = ["Qwen3ForCausalLM"]
            model.save_pretrained(model_dir)
            value_model = tiny_critic("qwen3", seed=4)  # a score head with a bias, as verl's critic has
            value_model.config.architectures = ["Qwen3ForTokenClassification"]
            value_model.save_pretrained(critic_dir(model_dir))
        dist.barrier()
        from verl.workers.config import ActorConfig, CriticConfig
        from verl.workers.utils.losses import ppo_loss, value_loss

        stock, harts_engine = engines(model_dir)
        matrices = [p for p in harts_engine.module.parameters() if p.dim() == 2]
        sharded = all(type(p).__name__ == "DTensor" and p.to_local().numel() < p.numel() for p in matrices)
        mine: dict = {
            "units": {"stock": units(stock.module), "harts": units(harts_engine.module)},
            "reshard_after_forward": harts_engine.engine_config.reshard_after_forward,
            "sharded": sharded,
        }
        for i, (name, agg, dynamic, budget) in enumerate(VARIANTS):
            config = ActorConfig(strategy="fsdp2", ppo_micro_batch_size_per_gpu=3, rollout_n=3,
                                 loss_agg_mode=agg, entropy_coeff=0.01, use_dynamic_bsz=dynamic,
                                 ppo_mini_batch_size=4, loss_scale_factor=16)  # fmt: skip
            loss_fn = functools.partial(ppo_loss, config)
            last = i == len(VARIANTS) - 1
            mine[name] = {label: run(engine, loss_fn, dynamic, budget, rank, step=last)
                          for label, engine in (("stock", stock), ("harts", harts_engine))}  # fmt: skip
            if budget is not None:
                mine[name]["cuts"] = cuts(rank, budget)
        del stock, harts_engine
        stock, harts_engine = engines(critic_dir(model_dir), "value_model")
        mine["critic_units"] = {"stock": units(stock.module), "harts": units(harts_engine.module)}
        for i, (name, agg, dynamic, budget) in enumerate(CRITIC_VARIANTS):
            config = CriticConfig(strategy="fsdp2", ppo_micro_batch_size_per_gpu=3, rollout_n=3,
                                  loss_agg_mode=agg, cliprange_value=CLIPRANGE_VALUE, use_dynamic_bsz=dynamic,
                                  ppo_mini_batch_size=4, loss_scale_factor=16)  # fmt: skip
            loss_fn = functools.partial(value_loss, config)
            last = i == len(CRITIC_VARIANTS) - 1
            mine[name] = {label: run(engine, loss_fn, dynamic, budget, rank, step=last, critic=True)
                          for label, engine in (("stock", stock), ("harts", harts_engine))}  # fmt: skip
            if budget is not None:
                mine[name]["cuts"] = cuts(rank, budget)
        mine["refusals"] = refusals(model_dir)
        results = [None] * dist.get_world_size()
        dist.all_gather_object(results, mine)
        if rank == 0:
            torch.save(results, out)
        dist.barrier()  # no rank closes its gloo connections while a peer may still be reading from them
    finally:
        close_process_group(wait=False)  # the barrier above ran when every rank finished


if __name__ == "__main__":
    main()
