"""TRL's GRPO loop on a tiny model, stock and through harts' drop-in: the pieces both runs share
(tokenizer, reward, snapshots, config) and the entry point of the multi-process test.

Launched by ``accelerate launch --multi_gpu --num_processes 2`` on a CPU (``use_cpu=True``: gloo),
each process is one of accelerate's ``MULTI_CPU`` ranks and the Trainer wraps the model in DDP. Every
rank runs each variant twice, once with ``trl.GRPOTrainer`` and once with
``harts.integrations.trl.GRPOTrainer``, from the same saved model (the dense one, or the MoE one
for the variants with TRL's load-balancing loss) and seed, and writes ``rank{r}.pt`` to the output
folder: per variant and trainer, the parameters at the start and after every optimizer step, the
completions its reward function saw, TRL's logs, and what ran (the distributed type, the wrapper,
harts' micro-batches); and the error a DDP communication hook gets from harts' drop-in.

Usage: ``accelerate launch --multi_gpu --num_processes 2 tests/trl_worker.py MODEL_DIR MOE_MODEL_DIR OUT_DIR``
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import trl
from datasets import Dataset  # a TRL dependency
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, TrainerCallback

PROMPTS = ["t10 t11 t12 t13 t14 t15 t16", "t20 t21 t22", "t30 t31 t32 t33", "t40 t41"]
# the two processes' runs: a step of two accumulated micro-batches on each of 2 ranks takes
# 2 x 2 x 8 completions, 8 prompts' groups of 4
MORE_PROMPTS = [*PROMPTS, "t50 t51 t52 t53 t54", "t60", "t70 t71 t72 t73 t74 t75", "t80 t81"]

# the weight of TRL's MoE load-balancing loss in the MoE runs: large enough that the aux term
# dominates the routers' gradients, so that a wrong weight or a wrong routing fraction shows
AUX_COEF = 0.1

# the variants of the multi-process test: TRL's config overrides, harts' token budget, and whether
# the model is the MoE one. "dapo" normalises by the completion tokens of every process
# (num_items_in_batch), over two accumulated micro-batches; "grpo" by each sequence's own length;
# the budget cuts each group's tree into parts (the three passes). The MoE variants add TRL's
# load-balancing loss, each micro-batch's on each process divided by the accumulation steps. No
# clipping: a wrong scale of the gradient shows.
VARIANTS = {
    "dapo": ({"loss_type": "dapo", "gradient_accumulation_steps": 2, "max_grad_norm": 0.0}, None, False),
    "grpo_budget": ({"loss_type": "grpo", "max_grad_norm": 0.0}, 8, False),
    "moe_aux_dapo": ({"loss_type": "dapo", "gradient_accumulation_steps": 2, "max_grad_norm": 0.0,
                      "router_aux_loss_coef": AUX_COEF}, None, True),
    "moe_aux_grpo_budget": ({"loss_type": "grpo", "max_grad_norm": 0.0, "router_aux_loss_coef": AUX_COEF},
                            8, True),
}  # fmt: skip


def tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer over the tiny models' 128 ids ("t0" .. "t127"): nothing to download."""
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(128)}, unk_token="t2"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", eos_token="t1", unk_token="t2")


class Recorder:
    """A reward function (share of even token ids) that records the completions it scores."""

    __name__ = "even_tokens"

    def __init__(self):
        self.completions: list[list[list[int]]] = []

    def __call__(self, prompts, completions, completion_ids, **kwargs):
        self.completions.append([list(c) for c in completion_ids])
        return [sum(t % 2 == 0 for t in c) / max(1, len(c)) for c in completion_ids]


class Snapshots(TrainerCallback):
    """The parameters at the start and after every optimizer step."""

    def __init__(self):
        self.params: list[dict[str, torch.Tensor]] = []

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.params.append({n: p.detach().clone() for n, p in model.named_parameters()})

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.params.append({n: p.detach().clone() for n, p in model.named_parameters()})


def config(out_dir, **overrides) -> trl.GRPOConfig:
    """Plain SGD (each update is the learning rate times the gradient, so the updates' relative
    error is the gradients'), fp32, two iterations per generation (old log-probs, ratios away
    from 1 on the second step) and beta > 0 (the reference model's pass and the KL term)."""
    args = dict(
        output_dir=str(Path(out_dir) / "out"), per_device_train_batch_size=8, num_generations=4,
        max_completion_length=5, max_steps=2, num_iterations=2, learning_rate=0.5, optim="sgd",
        beta=0.04, bf16=False, report_to="none", use_cpu=True, seed=0, save_strategy="no", disable_tqdm=True,
        logging_steps=1, model_init_kwargs={"dtype": torch.float32},
    )  # fmt: skip
    args.update(overrides)
    return trl.GRPOConfig(**args)


def train(trainer_class, model_dir, out_dir, args: dict | None = None, prompts=PROMPTS, **kwargs):
    """(trainer, completions its reward saw, parameter snapshots) of one seeded GRPO run."""
    reward, snaps = Recorder(), Snapshots()
    trainer = trainer_class(
        model=str(model_dir), reward_funcs=reward, args=config(out_dir, **(args or {})),
        processing_class=tokenizer(), train_dataset=Dataset.from_dict({"prompt": prompts}), callbacks=[snaps],
        **kwargs,
    )  # fmt: skip
    torch.manual_seed(0)
    trainer.train()
    return trainer, reward.completions, snaps.params


def main(model_dir: str, moe_dir: str, out_dir: str) -> None:
    import torch.distributed as dist

    from harts import RunConfig
    from harts.integrations.trl import GRPOTrainer

    torch.set_num_threads(1)
    results = {}
    for name, (overrides, budget, moe) in VARIANTS.items():
        for label, cls, kwargs in (
            ("stock", trl.GRPOTrainer, {}),
            ("harts", GRPOTrainer, {"harts_run": RunConfig(budget_tokens=budget)}),
        ):
            run_dir = Path(out_dir) / name / label
            model = moe_dir if moe else model_dir
            trainer, completions, params = train(cls, model, run_dir, overrides, MORE_PROMPTS, **kwargs)
            step = getattr(trainer, "_harts_result", None)
            results[f"{name}/{label}"] = {
                "params": params,
                "completions": completions,
                "logs": [entry for entry in trainer.state.log_history if "loss" in entry],
                "distributed_type": str(trainer.accelerator.distributed_type),
                "wrapper": type(trainer.model_wrapped).__name__,
                "num_processes": trainer.accelerator.num_processes,
                "micro_batches": step.num_micro_batches if step is not None else 0,
            }
    results["comm_hook"] = _refused_with_comm_hook(model_dir, Path(out_dir) / "comm_hook")
    torch.save(results, Path(out_dir) / f"rank{dist.get_rank()}.pt")


class _CommHook(TrainerCallback):
    """Registers DDP's plain all-reduce hook on the wrapped model once training begins."""

    def __init__(self):
        self.trainer = None

    def on_train_begin(self, args, state, control, **kwargs):
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        self.trainer.model_wrapped.register_comm_hook(None, default_hooks.allreduce_hook)


def _refused_with_comm_hook(model_dir, out_dir) -> str:
    """The error harts' drop-in raises at the first step of a DDP model with a communication hook
    (whose compression harts' own sum would skip), or "" when it ran."""
    from harts.integrations.trl import GRPOTrainer

    hook = _CommHook()
    trainer = GRPOTrainer(
        model=str(model_dir), reward_funcs=Recorder(), args=config(out_dir, max_steps=1), callbacks=[hook],
        processing_class=tokenizer(), train_dataset=Dataset.from_dict({"prompt": MORE_PROMPTS}),
    )  # fmt: skip
    hook.trainer = trainer
    try:
        trainer.train()
    except ValueError as err:
        return str(err)
    return ""


if __name__ == "__main__":
    main(*sys.argv[1:])
