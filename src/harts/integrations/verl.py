"""verl: the actor's log-probs, entropies and gradients, and the critic's values, from harts.

verl (0.9) runs its actor and its critic through engines (``verl.workers.engine.base.BaseEngine``):
``forward_backward_batch`` cuts a ``TensorDict`` into micro-batches and calls ``forward_step``
on each, which runs the model and turns the output into ``model_output`` for the loss function.
This module is the actor's side; the critic's (values for verl's ``value_loss``) is
:mod:`harts.integrations.verl_critic`, re-exported here, and what both engines share (the
micro-batch checks, the FSDP2 sharded step, the registry) is :mod:`harts.integrations.verl_engine`.

The actor's loss is ``verl.workers.utils.losses.ppo_loss`` (its policy term is whatever
``register_policy_loss`` registered under ``policy_loss.loss_mode``). The fields, as verl's
``FSDPEngineWithLMHead.prepare_model_inputs`` / ``prepare_model_outputs`` define them in the
no-padding mode (``DatasetPadMode.NO_PADDING``, the engine's default):

- ``input_ids``: a jagged nested tensor [B, j], each row a whole sequence (prompt + response),
  no padding; ``input_ids.offsets()`` are the sequences' ``cu_seqlens``.
- ``temperature``: a number (non-tensor field) or a per-sequence tensor [B].
- ``calculate_entropy``: a non-tensor flag.
- ``model_output["log_probs"]`` / ``["entropy"]``: jagged [B, j] like ``input_ids``, and
  *predictor-indexed*: the value at position j of a sequence is that of token j + 1 given tokens
  <= j (verl scores ``input_ids`` rolled by one). The last position of each sequence has no next
  token of its own; verl's ``no_padding_2_padding`` never reads it (it slices
  ``[offset - response_len - 1, offset - 1)``), and here it holds 0.
- ``position_ids``: jagged like ``input_ids``, each sequence counting from 0 (anything else,
  such as the multi-dimensional positions of vision-language models, is refused).

:func:`model_output` computes exactly that with one harts forward over the micro-batch's forest
(the prompt shared by a group's ``rollout.n`` responses runs once), with autograd, so verl's own
loss code (every registered policy loss, aggregation, KL and entropy term) runs unchanged on it.
:func:`register_engine` makes ``HartsFSDPEngine`` the engine verl's ``EngineRegistry`` gives the
actor for its ``fsdp`` / ``fsdp2`` strategy (:func:`register_critic_engine` does the same for
the critic). Under FSDP2 (``strategy: fsdp2``, parameters sharded over the ranks) the whole of
``forward_backward_batch`` runs inside one harts sharded step, each micro-batch's forward and
backward through :func:`harts.forest_backward` with verl's loss as the loss of harts' rows, and
forward-only passes (``compute_log_prob``) gather the layers the same way without a graph
(:mod:`harts.integrations.verl_engine`).

What this leaves out: generation (verl's rollout workers), distillation outputs,
``use_fused_kernels`` / Σπ² outputs, per-sequence temperatures that differ within a
micro-batch, and sharing across micro-batches (keep a group's responses in one micro-batch:
verl orders them together). Refused with a ValueError when the engine is built or run: FSDP1
(``strategy: fsdp``), Ulysses sequence parallelism, hybrid sharding (``fsdp_size`` below the
world size: a 2-D mesh), fp16 mixed precision (verl's gradient scaler wraps its own backward),
LoRA, and training with FSDP2 CPU offload (``offload_policy``; harts writes gradient shards on
the compute device). A forward-only engine with CPU offload (verl always offloads the reference
policy's) runs verl's own forward. The comparison with verl's engine is in fp32
(``mixed_precision`` fp32); verl's default mixed precision computes in bf16, where harts runs
the unsharded bf16 parameters and verl's forward runs under autocast, so the two can agree only
to bf16 rounding (not measured here).
"""

from __future__ import annotations

import torch
from torch import nn

from harts.integrations.batch import batch_logprobs
from harts.integrations.verl_critic import register_critic_engine, value_output
from harts.integrations.verl_engine import (
    HartsEngine,
    Rows,
    field,
    micro_batch_ids,
    register,
    unregister_engine,
)
from harts.runtime.backward import next_token_rows
from harts.runtime.config import RunConfig

__all__ = ["model_output", "register_engine", "unregister_engine", "value_output", "register_critic_engine"]

Tensor = torch.Tensor


def _temperature(value, batch: int) -> float:
    if value is None:
        return 1.0
    if isinstance(value, Tensor):
        flat = value.detach().reshape(-1).double()
        if flat.numel() not in (1, batch):
            raise ValueError(f"temperature has {flat.numel()} values for {batch} sequences")
        if not bool((flat == flat[0]).all()):
            i = int((flat != flat[0]).nonzero()[0, 0])
            raise ValueError(
                f"sequence {i}: temperature {float(flat[i])} differs from sequence 0's {float(flat[0])}; "
                f"harts runs one temperature per micro-batch"
            )
        return float(flat[0])
    return float(value)


def _micro_batch_input(data) -> tuple[Tensor, float, bool]:
    """The micro-batch's jagged ``input_ids``, its one temperature and its entropy flag, after the
    checks that refuse what harts does not compute (before any compute)."""
    input_ids = micro_batch_ids(data)
    for flag in ("use_fused_kernels", "calculate_sum_pi_squared", "distillation_use_topk"):
        if field(data, flag, False):
            raise ValueError(f"{flag}=True: verl's engine output for it is not computed by harts")
    temperature = _temperature(field(data, "temperature"), input_ids.offsets().numel() - 1)
    return input_ids, temperature, bool(field(data, "calculate_entropy", False))


def model_output(
    model: nn.Module, data, *, run: RunConfig | None = None, share_prefixes: bool = True
) -> dict[str, Tensor]:
    """``{"log_probs": ..., "entropy": ...}`` (entropy when ``calculate_entropy`` is set) of a verl
    micro-batch, jagged [B, j] and predictor-indexed as verl's engine returns them (see the module
    docstring), computed by harts with autograd."""
    input_ids, temperature, entropy = _micro_batch_input(data)
    offsets = input_ids.offsets()
    # every position but each sequence's first gets its (target-indexed) log-prob, then the roll by
    # one puts it on its predictor; the first token's 0 lands on the previous sequence's last slot
    out = batch_logprobs(
        model,
        input_ids.values(),
        cu_seqlens=offsets.cpu(),
        temperature=temperature,
        share_prefixes=share_prefixes,
        run=run,
    )

    def jagged(values: Tensor) -> Tensor:
        rolled = torch.roll(values, -1)
        return torch.nested.nested_tensor_from_jagged(rolled, offsets.to(rolled.device))

    result = {"log_probs": jagged(out.logprobs)}
    if entropy:
        result["entropy"] = jagged(out.entropies)
    return result


class _NextTokenRows(Rows):
    """The next-token rows of a micro-batch (the sharded actor's): row i predicts token
    ``slot[i] + 1`` of the packed ``input_ids`` from position ``slot[i]``, verl's predictor-indexed
    layout; the last position of each sequence has no row and holds 0, as :func:`model_output`
    leaves it."""

    def __init__(self, data, share_prefixes: bool):
        input_ids, self.temperature, self.with_entropy = _micro_batch_input(data)
        super().__init__(input_ids, share_prefixes)
        self.predictor, self.target = next_token_rows(self.forest)
        self.slot = torch.cat(
            [torch.arange(s, s + n - 1) for s, n in zip(self.starts, self.lengths, strict=True)]
        )

    def output(self, logprob: Tensor, entropy: Tensor) -> dict[str, Tensor]:
        out = {"log_probs": self.jagged(logprob)}
        if self.with_entropy:
            out["entropy"] = self.jagged(entropy)
        return out


_ENGINE: list[type] = []


def _engine_class() -> type:
    if _ENGINE:
        return _ENGINE[0]
    try:
        from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead
    except ImportError as err:
        raise ImportError(f"the harts engine needs verl (0.9): {err}") from err

    class HartsFSDPEngine(HartsEngine, FSDPEngineWithLMHead):
        """verl's FSDP actor engine with the micro-batch forward run by harts (shared prefixes once).

        Under FSDP2 (``strategy: fsdp2``, parameters sharded) the whole of
        ``forward_backward_batch`` runs inside one harts sharded step: each micro-batch's forward
        and backward go through ``harts.forest_backward``, which gathers one decoder layer's unit
        at a time and adds each rank's shard of the summed gradient to the sharded ``.grad``, as
        FSDP2's own hooks would (harts runs the model's parts, so those hooks never fire).
        """

        def _harts_rows(self, micro_batch) -> Rows:
            return _NextTokenRows(micro_batch, self.harts_share_prefixes)

        def _harts_output(self, micro_batch) -> dict[str, Tensor]:
            return model_output(
                self.module, micro_batch, run=self.harts_run, share_prefixes=self.harts_share_prefixes
            )

    _ENGINE.append(HartsFSDPEngine)
    return HartsFSDPEngine


def register_engine(
    backends: tuple[str, ...] = ("fsdp", "fsdp2"), devices: tuple[str, ...] = ("cuda", "cpu")
):
    """Make verl's actor engine for ``backends`` (the actor's ``strategy``; verl's FSDP engine
    config accepts ``fsdp`` and ``fsdp2``) ``HartsFSDPEngine`` on ``devices``, and return the class.

    ``HartsFSDPEngine`` is verl's ``FSDPEngineWithLMHead`` with its forward run by harts: under
    FSDP2 its ``forward_backward_batch`` (module docstring), on a model that is not sharded its
    ``forward_step``, which builds the micro-batch's model output with :func:`model_output` and
    hands it to verl's loss function, as the stock one does with the HF forward's. Only model type
    ``language_model`` changes (:func:`register_critic_engine` takes the critic's
    ``value_model``). verl's ``EngineRegistry.register`` refuses a key that is taken, so the
    entries are set in its table directly; :func:`unregister_engine` puts the stock engines back.
    """
    return register("language_model", _engine_class(), backends, devices)
