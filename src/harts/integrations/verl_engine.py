"""What verl's actor and critic engines from harts share: the micro-batch, its rows, the FSDP2 step.

verl (0.9) runs its actor (``FSDPEngineWithLMHead``) and its critic (``FSDPEngineWithValueHead``,
the same engine with another ``prepare_model_outputs``) through one frame: ``forward_backward_batch``
cuts a ``TensorDict`` into micro-batches and ``forward_step`` turns each into ``model_output``
for the loss function. Both harts engines (:mod:`harts.integrations.verl` for the actor,
:mod:`harts.integrations.verl_critic` for the critic) replace the model's forward there and
nothing else; what differs is which rows of the micro-batch's forest they read and with which
head (``_Rows`` and its subclasses). This module holds the rest, written once:

- the checks of verl's no-padding micro-batch (jagged ``input_ids``, positions counting from 0);
- ``_Rows``: the micro-batch's prefix-merged forest, the rows read over it and where each row's
  value sits in verl's flat jagged layout;
- ``_HartsEngine``: the engine methods. Under FSDP2 (``strategy: fsdp2``, parameters sharded)
  harts runs the model's parts, not its forward, so FSDP2's hooks never fire and a plain
  ``loss.backward()`` on harts' output could not reach the sharded layers (harts' graph is cut
  at every layer). So its ``forward_backward_batch`` keeps verl's frame (the global loss-token
  count summed over the ranks, ``dp_size``, verl's micro-batches, its output post-processing)
  and runs every micro-batch inside one harts sharded step
  (:func:`harts.runtime.distributed.data_parallel_step`): :func:`harts.forest_backward`
  gathers one decoder layer's unit at a time, in forward and again in backward, with verl's
  loss function wrapped as the loss of harts' rows (converted to verl's layout), and adds each
  rank's shard of the summed gradient into the sharded ``.grad``. verl's losses are scaled for
  FSDP2's mean over the ranks; harts sums, so the loss it differentiates is verl's divided by
  FSDP2's divide factor (the mesh size). verl's optimizer step, clipping and checkpoints then
  run on those gradients unchanged. Forward-only passes (``compute_log_prob``, the critic's
  ``compute_values``) gather the layers the same way without a graph. The units go on the
  decoder layers and the model: verl also gives an untied embedding and head units of their own,
  which harts calls itself; their parameters stay in the model's unit, which harts gathers for
  the whole step (the same shards and state dict). On a model that is not sharded (an engine of
  one's own), ``forward_step`` builds the output with autograd and verl's backward runs on it.
- the registry: verl's ``EngineRegistry.register`` refuses a key that is taken, so the harts
  engines are set in its table directly and :func:`unregister_engine` puts verl's back.

Refused with a ValueError when an engine is built or run: FSDP1 (``strategy: fsdp``), Ulysses
sequence parallelism, hybrid sharding (``fsdp_size`` below the world size: a 2-D mesh), fp16
mixed precision (verl's gradient scaler wraps its own backward), LoRA, and training with FSDP2
CPU offload (``offload_policy``; harts writes gradient shards on the compute device). A
forward-only engine with CPU offload (verl always offloads the reference policy's) runs verl's
own forward.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from harts.forest import build_forest
from harts.runtime.backward import forest_backward
from harts.runtime.config import RunConfig
from harts.runtime.executor import check_inputs, layout_for, model_device, resolve_model, run_layout
from harts.runtime.readout import Readout, readout_for

__all__ = ["unregister_engine"]

Tensor = torch.Tensor


# ---- verl's no-padding micro-batch -------------------------------------------------------------
def field(data, key: str, default=None):
    """A field of verl's TensorDict (non-tensor fields come back as their value) or of a mapping."""
    try:
        value = data[key]
    except KeyError:
        return default
    return getattr(value, "data", value) if type(value).__name__ == "NonTensorData" else value


def micro_batch_ids(data) -> Tensor:
    """The micro-batch's jagged ``input_ids`` [B, j], after the checks of the layout (no padding,
    each sequence's positions from 0) that every harts engine reads."""
    if not isinstance(data, Mapping) and not hasattr(data, "batch_size"):
        raise TypeError(f"expected verl's TensorDict or a mapping of its fields, got {type(data).__name__}")
    input_ids = field(data, "input_ids")
    if not isinstance(input_ids, Tensor) or not input_ids.is_nested:
        raise TypeError(
            "input_ids must be a jagged nested tensor (verl's no-padding layout, DatasetPadMode.NO_PADDING); "
            f"got {type(input_ids).__name__}"
            + ("" if not isinstance(input_ids, Tensor) else f" of shape {tuple(input_ids.shape)}")
        )
    pad_mode = field(data, "pad_mode")
    if pad_mode is not None and str(getattr(pad_mode, "value", pad_mode)).lower() not in ("no_padding",):
        raise ValueError(f"pad_mode {pad_mode!r}: harts reads verl's no-padding layout only")
    _check_positions(field(data, "position_ids"), input_ids.offsets())
    return input_ids


def _check_positions(position_ids, offsets: Tensor) -> None:
    """harts places each sequence's tokens at 0, 1, ... (a sequence starts at its root): the
    micro-batch's ``position_ids``, where given, must say the same."""
    if position_ids is None:
        return
    if not isinstance(position_ids, Tensor) or not position_ids.is_nested or position_ids.dim() != 2:
        raise ValueError(
            "position_ids must be jagged [B, j] like input_ids (multi-dimensional rotary positions, as "
            "vision-language models use, are not computed by harts)"
        )
    values = position_ids.values().cpu()
    starts = offsets[:-1].cpu()
    expected = torch.arange(values.numel()) - torch.repeat_interleave(starts, offsets.diff().cpu())
    if values.shape != expected.shape or not torch.equal(values.long(), expected):
        at = int((values.long() != expected).nonzero()[0, 0]) if values.shape == expected.shape else 0
        raise ValueError(
            f"position_ids at packed index {at} is {int(values.reshape(-1)[at])}, not {int(expected[at])}: "
            f"harts counts each sequence's positions from 0"
        )


class Rows:
    """A micro-batch's prefix-merged forest, the rows read over it, and where each row's value sits
    in verl's layout: row i fills flat position ``slot[i]`` of the packed ``input_ids``; positions
    without a row hold 0. Subclasses set ``predictor`` / ``target`` / ``slot`` and say what the
    rows read (:meth:`readout`, ``temperature``) and which output fields they make (:meth:`output`).
    """

    temperature: float = 1.0
    predictor: Tensor
    target: Tensor
    slot: Tensor

    def __init__(self, input_ids: Tensor, share_prefixes: bool):
        self.offsets = input_ids.offsets()
        self.lengths = self.offsets.diff().cpu().tolist()
        self.starts = self.offsets[:-1].cpu().tolist()
        self.forest = build_forest(
            list(torch.split(input_ids.values().cpu(), self.lengths)), share_prefixes=share_prefixes
        )
        self.total = int(self.offsets[-1])

    def readout(self, model: nn.Module) -> Readout | None:
        """What the rows read from their predictor's final hidden state (None: the causal LM's
        log-prob and entropy at ``temperature``)."""
        return None

    def output(self, first: Tensor, second: Tensor) -> dict[str, Tensor]:
        """verl's ``model_output`` from the readout's two row quantities."""
        raise NotImplementedError

    def jagged(self, values: Tensor) -> Tensor:
        """Row values [R] as verl's jagged [B, j] (differentiable in ``values``)."""
        flat = values.new_zeros(self.total).index_put((self.slot.to(values.device),), values)
        return torch.nested.nested_tensor_from_jagged(flat, self.offsets.to(values.device))


def row_values(model: nn.Module, rows: Rows, run: RunConfig, sharded=None) -> tuple[Tensor, Tensor]:
    """The rows' two readout quantities from one pass over the whole forest (no token budget), with
    autograd when it is on; inside a sharded step (``sharded``) each decoder layer's unit is
    gathered around its forward (verl's forward-only passes)."""
    model = resolve_model(model)
    check_inputs(model, rows.forest)
    readout = readout_for(model, rows.readout(model), rows.temperature)
    layout = layout_for(rows.forest, model_device(model), run)
    if sharded is not None:
        sharded.enter_forward()
    hidden, _ = run_layout(model, layout, None, run.recompute_linear, sharded, None)
    device = hidden.device
    return readout(hidden, rows.predictor.to(device), rows.target.to(device), run.chunk_rows)


def _fsdp_divide_factor(module: nn.Module, world: int) -> float:
    """What FSDP2 divides each summed gradient by: the mesh size (its mean) unless a unit sets
    ``set_gradient_divide_factor``; one factor for the whole model, or harts cannot match it by
    scaling the loss."""
    factors = set()
    for m in module.modules():
        state = getattr(m, "_get_fsdp_state", None)
        if state is None:
            continue
        for group in getattr(state(), "_fsdp_param_groups", []):
            factor = getattr(group, "gradient_divide_factor", None)
            factors.add(float(world) if factor is None else float(factor))
    if len(factors) > 1:
        raise ValueError(
            f"the FSDP2 units divide their gradients by different factors {sorted(factors)}: harts sums "
            f"every unit's gradient over the ranks and can scale the loss by one factor only"
        )
    return factors.pop() if factors else float(world)


# ---- the engine methods both harts engines share -----------------------------------------------
class HartsEngine:
    """Mixed in before verl's ``FSDPEngineWithLMHead`` (or a subclass): the methods that run the
    micro-batches through harts (module docstring). A subclass says which rows a micro-batch
    reads (:meth:`_harts_rows`, checks first) and what its output is with autograd on a model
    that is not sharded (:meth:`_harts_output`)."""

    harts_run: RunConfig | None = None
    harts_share_prefixes: bool = True

    def _harts_rows(self, micro_batch) -> Rows:
        raise NotImplementedError

    def _harts_output(self, micro_batch) -> dict[str, Tensor]:
        raise NotImplementedError

    def _check_harts_module(self, module: nn.Module) -> None:
        """Refuse, once the model is built, a model this engine does not read."""

    # ---- building: units where harts gathers them ------------------------------------------------
    def _build_fsdp_module(self, module):
        """verl's FSDP2 wrapping with units on the decoder layers and the model only.

        verl also gives an untied embedding and head units of their own; harts calls those
        modules itself, where FSDP2's hooks would reshard them mid-step, and gathers the
        model's unit (embedding, final norm, head) for the whole step anyway. So their
        parameters stay in the model's unit: the same parameters, shards and state dict.
        """
        self._check_harts_config()
        self._check_harts_module(module)
        from verl.utils import fsdp_utils

        from harts.adapters import adapter_for

        choose = fsdp_utils._select_fsdp2_wrap_targets
        layers = {id(layer) for layer in adapter_for(module).backbone(module).layers}

        def decoder_layers(model, class_names):
            return [m for m in choose(model, class_names) if id(m) in layers]

        fsdp_utils._select_fsdp2_wrap_targets = decoder_layers
        try:
            return super()._build_fsdp_module(module)
        finally:
            fsdp_utils._select_fsdp2_wrap_targets = choose

    def _check_harts_config(self):
        """Refuse, before the model is built, what the sharded step cannot run exactly."""
        config = self.engine_config
        if config.strategy != "fsdp2":
            raise ValueError(
                f"strategy {config.strategy!r}: harts runs verl's FSDP2 engine (strategy fsdp2); FSDP1's "
                f"flat parameters cannot be run part by part"
            )
        if config.ulysses_sequence_parallel_size > 1:
            raise ValueError(
                f"ulysses_sequence_parallel_size={config.ulysses_sequence_parallel_size}: harts keeps "
                f"each sequence on one rank (no sequence parallelism)"
            )
        if config.fsdp_size > 0 and config.fsdp_size < torch.distributed.get_world_size():
            raise ValueError(
                f"fsdp_size={config.fsdp_size} of {torch.distributed.get_world_size()} ranks (hybrid "
                f"sharding, a 2-D mesh): harts shards on one mesh dimension; set fsdp_size=-1"
            )
        precision = config.mixed_precision or {}
        if str(precision.get("param_dtype", "")).lower() in ("fp16", "float16", "half"):
            raise ValueError(
                "mixed_precision.param_dtype fp16: verl scales that loss with a gradient scaler "
                "around its own backward, which harts' backward does not run through"
            )
        if self.model_config.lora_rank > 0:
            raise ValueError("LoRA (lora_rank > 0) with the harts engine is not supported under FSDP2")

    # ---- running ---------------------------------------------------------------------------------
    def _harts_sharded(self) -> bool:
        """Whether the model is FSDP2-sharded and runs through harts' sharded step. With FSDP2's
        CPU offload (``offload_policy``, and always in verl's forward-only engines such as the
        reference policy's) it does not: harts' step writes each gradient shard on the device
        it computed on, not into the offloaded shards. A forward-only engine then runs verl's
        own forward; training is refused."""
        from harts.runtime.distributed import data_parallel

        dp = data_parallel(self.module)
        return dp is not None and dp.kind == "fsdp" and not self._uses_fsdp2_cpu_offload_policy

    def forward_backward_batch(self, data, loss_function, forward_only=False):
        """verl's ``forward_backward_batch`` with every micro-batch run by harts inside one
        sharded step. verl's normalisers are set as its engine sets them (the global loss
        tokens summed over the ranks, ``dp_size``) and its micro-batches cut as it cuts them;
        its loss runs on harts' rows, and the gradient is scaled as FSDP2's mean over the
        ranks would scale it (harts sums)."""
        if self._uses_fsdp2_cpu_offload_policy and not forward_only:
            raise ValueError(
                "offload_policy=True (FSDP2 CPU offload): harts' sharded step writes gradient shards "
                "on the compute device, not into the offloaded ones; train without offload_policy"
            )
        if not self._harts_sharded():
            return super().forward_backward_batch(data, loss_function, forward_only=forward_only)
        if getattr(self, "scaler", None) is not None:
            raise ValueError("a gradient scaler (fp16) runs around verl's backward; harts' does not")
        from verl.utils import tensordict_utils as tu
        from verl.utils.device import get_device_id
        from verl.workers.engine.utils import postprocess_batch_func, prepare_micro_batches

        from harts.runtime.distributed import data_parallel_step

        group = self.get_data_parallel_group()
        tu.assign_non_tensor(data, sp_size=self.ulysses_sequence_parallel_size)
        keep_output = tu.get_non_tensor_data(data=data, key="return_model_output", default=False)
        tokens = data["loss_mask"].sum().to(get_device_id())
        torch.distributed.all_reduce(tokens, op=torch.distributed.ReduceOp.SUM, group=group)
        tu.assign_non_tensor(data, batch_num_tokens=tokens.item(), dp_size=self.get_data_parallel_size())
        micro_batches, indices = prepare_micro_batches(data=data, dp_group=group, same_micro_num_in_dp=True)
        scale = 1.0 / _fsdp_divide_factor(self.module, torch.distributed.get_world_size(group))
        outputs = []
        with data_parallel_step(self.module) as (module, dp):
            for micro_batch in micro_batches:
                micro_batch = micro_batch.to(get_device_id())
                if forward_only:
                    meta = self._harts_forward(module, dp.sharded, micro_batch, loss_function)
                else:
                    meta = self._harts_train(module, dp.sharded, micro_batch, loss_function, scale)
                    if not keep_output:
                        meta.pop("model_output")
                outputs.append(meta)
        return postprocess_batch_func(output_lst=outputs, indices=indices, data=data)

    def _harts_loss(self, loss_function, output, micro_batch) -> tuple[Tensor, dict]:
        if loss_function is None:
            return torch.tensor(1.0), {}
        return loss_function(model_output=output, data=micro_batch, dp_group=self.get_data_parallel_group())

    def _harts_forward(self, module, sharded, micro_batch, loss_function):
        rows = self._harts_rows(micro_batch)
        with torch.no_grad():
            output = rows.output(*row_values(module, rows, RunConfig.resolve(self.harts_run), sharded))
        loss, metrics = self._harts_loss(loss_function, output, micro_batch)
        return {"model_output": output, "loss": float(loss), "metrics": metrics}

    def _harts_train(self, module, sharded, micro_batch, loss_function, scale: float):
        if loss_function is None:
            raise ValueError("forward_only must be True when loss_function is None")
        rows = self._harts_rows(micro_batch)
        seen: dict = {}

        def loss_fn(first: Tensor, second: Tensor) -> Tensor:
            # verl's loss of the micro-batch, on its own layout; called once per micro-batch
            # (harts seeds each part's backward with this loss's gradient by the rows)
            loss, seen["metrics"] = self._harts_loss(loss_function, rows.output(first, second), micro_batch)
            seen["loss"] = loss.detach()
            return loss * scale

        result = forest_backward(
            module,
            rows.forest,
            rows.predictor,
            rows.target,
            loss_fn,
            run=self.harts_run,
            temperature=rows.temperature,
            sharded=sharded,
            readout=rows.readout(resolve_model(module)),
        )
        output = rows.output(result.logprob, result.entropy)
        return {"model_output": output, "loss": float(seen["loss"]), "metrics": seen["metrics"]}

    def forward_step(self, micro_batch, loss_function, forward_only):
        if self._uses_fsdp2_cpu_offload_policy:  # see _harts_sharded
            return super().forward_step(micro_batch, loss_function, forward_only)
        from verl.utils.device import get_device_id

        micro_batch = micro_batch.to(get_device_id())
        output = self._harts_output(micro_batch)
        if loss_function is None and not forward_only:
            raise ValueError("forward_only must be True when loss_function is None")
        loss, metrics = self._harts_loss(loss_function, output, micro_batch)
        detached = {k: v.detach() for k, v in output.items()}
        return loss, {"model_output": detached, "loss": loss.detach().item(), "metrics": metrics}


# ---- verl's engine registry ----------------------------------------------------------------------
_STOCK: dict[tuple[str, str, str], type | None] = {}  # (model type, backend, device) -> verl's engine


def register(model_type: str, engine: type, backends: tuple[str, ...], devices: tuple[str, ...]) -> type:
    """Make ``engine`` verl's engine for ``model_type`` on ``backends`` x ``devices``, remembering
    what it replaced (verl's ``register`` refuses a taken key, so its table is set directly)."""
    from verl.workers.engine.base import EngineRegistry

    table = EngineRegistry._engines.setdefault(model_type, {})
    for backend in backends:
        for device in devices:
            current = table.setdefault(backend, {}).get(device)
            if current is not engine:
                _STOCK[(model_type, backend, device)] = current
            table[backend][device] = engine
    return engine


def unregister_engine() -> None:
    """Put back every engine ``register_engine`` and ``register_critic_engine`` replaced."""
    if not _STOCK:
        return
    from verl.workers.engine.base import EngineRegistry

    for (model_type, backend, device), stock in _STOCK.items():
        table = EngineRegistry._engines[model_type]
        if stock is None:
            table[backend].pop(device, None)
        else:
            table[backend][device] = stock
    _STOCK.clear()
