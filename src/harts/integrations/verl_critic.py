"""verl's critic: per-token values and the value loss's gradients from harts, in verl's layout.

verl (0.9) builds its critic's engine with ``EngineRegistry.new("value_model", backend=strategy)``:
``FSDPEngineWithValueHead``, its actor engine with one method changed, ``prepare_model_outputs``.
The model is a ``*ForTokenClassification`` with ``num_labels=1`` and no classifier dropout (verl's
``load_valuehead_model``), and its output is, in the no-padding layout:

- ``model_output["values"]``: jagged [B, j] like ``input_ids``, *token-indexed*: position j of a
  sequence holds ``score(h_j)``, the head at the state after token j (``logits[..., 0]`` of the
  packed forward). verl's ``value_loss`` reads a sequence's response values with
  ``no_padding_2_padding``, from ``[offset - response_len - 1, offset - 1)``: the value of
  response token t is the head at the state before it (:func:`harts.forward_values`' alignment,
  ``values[p] = V(h_{p-1})``). Every position has its value, the last one too (never read).
- The critic's micro-batch carries the actor's flags (``temperature``, ``calculate_entropy``,
  ``use_fused_kernels``, ...); the values depend on none of them, and they are not read.

:func:`value_output` computes those values with one harts forward over the micro-batch's forest
(the prompt shared by a group's responses runs once), reading the critic's ``score`` head at
every unique token (:class:`~harts.runtime.readout.ScalarReadout`), with autograd, so verl's own
``value_loss`` (``compute_value_loss``: clipped at ``cliprange_value`` around the rollout-time
values, ``agg_loss`` with ``loss_agg_mode``, verl's global normalisers) runs unchanged on it.
:func:`register_critic_engine` makes ``HartsFSDPCriticEngine`` the engine verl's
``EngineRegistry`` gives the critic for its ``fsdp`` / ``fsdp2`` strategy. It runs the critic
as ``HartsFSDPEngine`` runs the actor (:mod:`harts.integrations.verl_engine`): under FSDP2 the
whole of ``forward_backward_batch`` (``update_critic``) inside one harts sharded step, each
micro-batch through :func:`harts.forest_backward` with the score head as the rows' readout and
verl's ``value_loss`` as their loss; forward-only passes (``compute_values``) gather the layers
the same way without a graph.

Refused with a ValueError: a critic without a linear score head of one output (trl's
``AutoModelForCausalLMWithValueHead`` with its ``v_head``, which verl falls back to for a
checkpoint without a ``*ForTokenClassification`` class), a padded micro-batch, ``position_ids``
that do not count each sequence from 0, and every engine setup the actor's engine refuses
(FSDP1, Ulysses, hybrid sharding, fp16, LoRA, training with CPU offload). Left out: sharing
across micro-batches, as for the actor.
"""

from __future__ import annotations

import torch
from torch import nn

from harts.integrations.verl_engine import HartsEngine, Rows, micro_batch_ids, register, row_values
from harts.runtime.config import RunConfig
from harts.runtime.executor import resolve_model
from harts.runtime.forward_only import forest_row_readout
from harts.runtime.readout import Readout, ScalarReadout, scalar_head

__all__ = ["value_output", "register_critic_engine"]

Tensor = torch.Tensor
_WHAT = "the harts critic engine"


class _ValueRows(Rows):
    """One row at every position of every sequence, reading the score head at that token's state:
    verl's token-indexed values fill every slot of the packed ``input_ids``, in order."""

    def __init__(self, data, share_prefixes: bool):
        super().__init__(micro_batch_ids(data), share_prefixes)
        paths = [self.forest.trajectory_token_indices(i) for i in range(self.forest.num_trajectories)]
        self.predictor = torch.cat(paths)
        self.target = torch.zeros_like(self.predictor)  # a score head reads no target
        self.slot = torch.arange(self.total)

    def readout(self, model: nn.Module) -> Readout:
        return ScalarReadout(scalar_head(model, _WHAT))

    def output(self, value: Tensor, _unused: Tensor) -> dict[str, Tensor]:
        return {"values": self.jagged(value)}


def value_output(
    critic: nn.Module, data, *, run: RunConfig | None = None, share_prefixes: bool = True
) -> dict[str, Tensor]:
    """``{"values": ...}`` of a verl micro-batch, jagged [B, j] and token-indexed as verl's
    critic engine returns them (module docstring), computed by harts with autograd.

    ``critic``: a supported family's ``*ForTokenClassification`` with ``num_labels=1`` (or
    :class:`harts.ValueHead`). With autograd the micro-batch is one forward; under
    ``torch.no_grad()`` a token budget (``run.budget_tokens``) runs it in micro-batches
    (:func:`harts.forward_values`' pass), the values those of the whole at once.
    """
    rows = _ValueRows(data, share_prefixes)
    run = RunConfig.resolve(run)
    if run.budget_tokens is None:
        return rows.output(*row_values(critic, rows, run))
    if torch.is_grad_enabled():
        raise ValueError(
            "value_output with a token budget runs without autograd: call it under torch.no_grad() "
            "(the critic's compute_values), or train under a budget through the harts critic engine "
            "(harts.forest_backward)"
        )
    readout = rows.readout(resolve_model(critic))
    out = forest_row_readout(critic, rows.forest, rows.predictor, rows.target, readout, run=run)
    return rows.output(out.logprob, out.entropy)


_ENGINE: list[type] = []


def _engine_class() -> type:
    if _ENGINE:
        return _ENGINE[0]
    try:
        from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithValueHead
    except ImportError as err:
        raise ImportError(f"the harts critic engine needs verl (0.9): {err}") from err

    class HartsFSDPCriticEngine(HartsEngine, FSDPEngineWithValueHead):
        """verl's FSDP critic engine with the micro-batch's values run by harts (shared prefixes
        once); under FSDP2 its ``forward_backward_batch`` runs inside one harts sharded step, as
        ``HartsFSDPEngine``'s does (:mod:`harts.integrations.verl_engine`)."""

        def _harts_rows(self, micro_batch) -> Rows:
            return _ValueRows(micro_batch, self.harts_share_prefixes)

        def _harts_output(self, micro_batch) -> dict[str, Tensor]:
            return value_output(
                self.module, micro_batch, run=self.harts_run, share_prefixes=self.harts_share_prefixes
            )

        def _check_harts_module(self, module: nn.Module) -> None:
            scalar_head(resolve_model(module), _WHAT)

    _ENGINE.append(HartsFSDPCriticEngine)
    return HartsFSDPCriticEngine


def register_critic_engine(
    backends: tuple[str, ...] = ("fsdp", "fsdp2"), devices: tuple[str, ...] = ("cuda", "cpu")
):
    """Make verl's critic engine (model type ``value_model``) for ``backends`` (the critic's
    ``strategy``) ``HartsFSDPCriticEngine`` on ``devices``, and return the class.

    ``HartsFSDPCriticEngine`` is verl's ``FSDPEngineWithValueHead`` with its forward run by harts,
    as :func:`harts.integrations.verl.register_engine` makes the actor's; the actor's entries are
    left alone. :func:`harts.integrations.verl.unregister_engine` puts verl's engines back.
    """
    return register("value_model", _engine_class(), backends, devices)
