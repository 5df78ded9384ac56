"""verl: the actor's log-probs, entropies and gradients from harts, in the layout verl's engine uses.

verl (0.9) runs the actor through an engine (``verl.workers.engine.base.BaseEngine``): its
``forward_backward_batch`` cuts a ``TensorDict`` into micro-batches and calls ``forward_step``
on each, which runs the model and turns the output into ``model_output`` for the loss function
(``verl.workers.utils.losses.ppo_loss``, whose policy term is whatever
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
actor for its ``fsdp`` / ``fsdp2`` strategy.

``HartsFSDPEngine`` runs verl's FSDP2 engine (``strategy: fsdp2``) with its parameters sharded
over the ranks. harts runs the model's parts, not its forward, so FSDP2's hooks never fire and
a plain ``loss.backward()`` on harts' output could not reach the sharded layers (harts' graph is
cut at every layer). So its ``forward_backward_batch`` keeps verl's frame (the global loss-token
count summed over the ranks, ``dp_size``, verl's micro-batches, its output post-processing) and
runs every micro-batch inside one harts sharded step
(:func:`harts.runtime.distributed.data_parallel_step`): :func:`harts.forest_backward` gathers one
decoder layer's unit at a time, in forward and again in backward, with verl's loss function
wrapped as the loss of harts' rows (converted to the layout above), and adds each rank's shard of
the summed gradient into the sharded ``.grad``. verl's losses are scaled for FSDP2's mean over
the ranks; harts sums, so the loss it differentiates is verl's divided by FSDP2's divide factor
(the mesh size). verl's optimizer step, clipping and checkpoints then run on those gradients
unchanged. Forward-only passes (``compute_log_prob``) gather the layers the same way without a
graph. The units go on the decoder layers and the model: verl also gives an untied embedding and
head units of their own, which harts calls itself; their parameters stay in the model's unit,
which harts gathers for the whole step (the same shards and state dict).

What this leaves out: generation (verl's rollout workers), critics and value heads (the value
engine is verl's), distillation outputs, ``use_fused_kernels`` / Σπ² outputs, per-sequence
temperatures that differ within a micro-batch, and sharing across micro-batches (keep a group's
responses in one micro-batch: verl orders them together). Refused with a ValueError when the
engine is built or run: FSDP1 (``strategy: fsdp``), Ulysses sequence parallelism, hybrid sharding
(``fsdp_size`` below the world size: a 2-D mesh), fp16 mixed precision (verl's gradient scaler
wraps its own backward), LoRA, and training with FSDP2 CPU offload (``offload_policy``; harts
writes gradient shards on the compute device). A forward-only engine with CPU offload (verl
always offloads the reference policy's) runs verl's own forward. The comparison with verl's
engine is in fp32 (``mixed_precision`` fp32); verl's default mixed precision computes in bf16,
where harts runs the unsharded bf16 parameters and verl's forward runs under autocast, so the
two can agree only to bf16 rounding (not measured here).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from harts.adapters.base import logit_softcap
from harts.forest import build_forest
from harts.integrations.batch import batch_logprobs
from harts.runtime.config import RunConfig
from harts.runtime.executor import (
    check_inputs,
    layout_for,
    model_device,
    resolve_model,
    row_logprobs,
    run_layout,
)
from harts.runtime.step import forest_backward, next_token_rows

__all__ = ["model_output", "register_engine", "unregister_engine"]

Tensor = torch.Tensor


def _get(data, key: str, default=None):
    """A field of verl's TensorDict (non-tensor fields come back as their value) or of a mapping."""
    try:
        value = data[key]
    except KeyError:
        return default
    return getattr(value, "data", value) if type(value).__name__ == "NonTensorData" else value


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
    if not isinstance(data, Mapping) and not hasattr(data, "batch_size"):
        raise TypeError(f"expected verl's TensorDict or a mapping of its fields, got {type(data).__name__}")
    input_ids = _get(data, "input_ids")
    if not isinstance(input_ids, Tensor) or not input_ids.is_nested:
        raise TypeError(
            "input_ids must be a jagged nested tensor (verl's no-padding layout, DatasetPadMode.NO_PADDING); "
            f"got {type(input_ids).__name__}"
            + ("" if not isinstance(input_ids, Tensor) else f" of shape {tuple(input_ids.shape)}")
        )
    pad_mode = _get(data, "pad_mode")
    if pad_mode is not None and str(getattr(pad_mode, "value", pad_mode)).lower() not in ("no_padding",):
        raise ValueError(f"pad_mode {pad_mode!r}: harts reads verl's no-padding layout only")
    for flag in ("use_fused_kernels", "calculate_sum_pi_squared", "distillation_use_topk"):
        if _get(data, flag, False):
            raise ValueError(f"{flag}=True: verl's engine output for it is not computed by harts")
    offsets = input_ids.offsets()
    batch = offsets.numel() - 1
    _check_positions(_get(data, "position_ids"), offsets)
    temperature = _temperature(_get(data, "temperature"), batch)
    return input_ids, temperature, bool(_get(data, "calculate_entropy", False))


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
        model, input_ids.values(), cu_seqlens=offsets.cpu(), temperature=temperature,
        share_prefixes=share_prefixes, run=run,
    )  # fmt: skip

    def jagged(values: Tensor) -> Tensor:
        rolled = torch.roll(values, -1)
        return torch.nested.nested_tensor_from_jagged(rolled, offsets.to(rolled.device))

    result = {"log_probs": jagged(out.logprobs)}
    if entropy:
        result["entropy"] = jagged(out.entropies)
    return result


# ---- a sharded (FSDP2) actor: the micro-batch's rows through harts' sharded step -----------------
class _Rows:
    """A micro-batch's next-token rows over its prefix-merged forest, and where each row's value
    sits in verl's predictor-indexed layout: row i (predicting token ``slot[i] + 1`` of the packed
    ``input_ids`` from position ``slot[i]``) fills flat position ``slot[i]``; the last position of
    each sequence has no row and holds 0, as :func:`model_output` leaves it."""

    def __init__(self, input_ids: Tensor, share_prefixes: bool):
        self.offsets = input_ids.offsets()
        lengths = self.offsets.diff().cpu().tolist()
        self.forest = build_forest(list(torch.split(input_ids.values().cpu(), lengths)),
                                   share_prefixes=share_prefixes)  # fmt: skip
        self.predictor, self.target = next_token_rows(self.forest)
        starts = self.offsets[:-1].cpu().tolist()
        self.slot = torch.cat([torch.arange(s, s + n - 1) for s, n in zip(starts, lengths, strict=True)])
        self.total = int(self.offsets[-1])

    def jagged(self, values: Tensor) -> Tensor:
        """Row values [R] as verl's jagged [B, j] (differentiable in ``values``)."""
        flat = values.new_zeros(self.total).index_put((self.slot.to(values.device),), values)
        return torch.nested.nested_tensor_from_jagged(flat, self.offsets.to(values.device))

    def output(self, logprob: Tensor, entropy: Tensor, with_entropy: bool) -> dict[str, Tensor]:
        out = {"log_probs": self.jagged(logprob)}
        if with_entropy:
            out["entropy"] = self.jagged(entropy)
        return out


def _sharded_logprobs(module: nn.Module, sharded, rows: _Rows, temperature: float, run: RunConfig):
    """Row log-probs and entropies without autograd, inside a sharded step (each decoder layer's
    unit gathered around its forward): verl's forward-only passes (``compute_log_prob``)."""
    model = resolve_model(module)
    check_inputs(model, rows.forest)
    layout = layout_for(rows.forest, model_device(model), run)
    with torch.no_grad():
        sharded.enter_forward()
        hidden, _ = run_layout(model, layout, None, run.recompute_linear, sharded, None)
        device = hidden.device
        return row_logprobs(model.lm_head, hidden, rows.predictor.to(device), rows.target.to(device),
                            run.chunk_rows, temperature, softcap=logit_softcap(model))  # fmt: skip


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


_STOCK: dict[tuple[str, str], type] = {}  # (backend, device) -> the engine register_engine replaced
_ENGINE: list[type] = []


def _engine_class() -> type:
    if _ENGINE:
        return _ENGINE[0]
    try:
        from verl.utils import fsdp_utils
        from verl.utils import tensordict_utils as tu
        from verl.utils.device import get_device_id
        from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead
        from verl.workers.engine.utils import postprocess_batch_func, prepare_micro_batches
    except ImportError as err:
        raise ImportError(f"the harts engine needs verl (0.9): {err}") from err

    class HartsFSDPEngine(FSDPEngineWithLMHead):
        """verl's FSDP actor engine with the micro-batch forward run by harts (shared prefixes once).

        Under FSDP2 (``strategy: fsdp2``, parameters sharded) the whole of
        ``forward_backward_batch`` runs inside one harts sharded step: each micro-batch's forward
        and backward go through ``harts.forest_backward``, which gathers one decoder layer's unit
        at a time and adds each rank's shard of the summed gradient to the sharded ``.grad``, as
        FSDP2's own hooks would (harts runs the model's parts, so those hooks never fire).
        """

        harts_run: RunConfig | None = None
        harts_share_prefixes: bool = True

        # ---- building: units where harts gathers them --------------------------------------------
        def _build_fsdp_module(self, module):
            """verl's FSDP2 wrapping with units on the decoder layers and the model only.

            verl also gives an untied embedding and head units of their own; harts calls those
            modules itself, where FSDP2's hooks would reshard them mid-step, and gathers the
            model's unit (embedding, final norm, head) for the whole step anyway. So their
            parameters stay in the model's unit: the same parameters, shards and state dict.
            """
            self._check_harts_config()
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
            from harts.runtime.distributed import data_parallel_step

            group = self.get_data_parallel_group()
            tu.assign_non_tensor(data, sp_size=self.ulysses_sequence_parallel_size)
            keep_output = tu.get_non_tensor_data(data=data, key="return_model_output", default=False)
            tokens = data["loss_mask"].sum().to(get_device_id())
            torch.distributed.all_reduce(tokens, op=torch.distributed.ReduceOp.SUM, group=group)
            tu.assign_non_tensor(data, batch_num_tokens=tokens.item(), dp_size=self.get_data_parallel_size())
            micro_batches, indices = prepare_micro_batches(
                data=data, dp_group=group, same_micro_num_in_dp=True
            )
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

        def _harts_forward(self, module, sharded, micro_batch, loss_function):
            input_ids, temperature, with_entropy = _micro_batch_input(micro_batch)
            rows = _Rows(input_ids, self.harts_share_prefixes)
            logprob, entropy = _sharded_logprobs(module, sharded, rows, temperature,
                                                 RunConfig.resolve(self.harts_run))  # fmt: skip
            output = rows.output(logprob, entropy, with_entropy)
            if loss_function is not None:
                loss, metrics = loss_function(
                    model_output=output, data=micro_batch, dp_group=self.get_data_parallel_group()
                )
            else:
                loss, metrics = torch.tensor(1.0), {}
            return {"model_output": output, "loss": float(loss), "metrics": metrics}

        def _harts_train(self, module, sharded, micro_batch, loss_function, scale: float):
            if loss_function is None:
                raise ValueError("forward_only must be True when loss_function is None")
            input_ids, temperature, with_entropy = _micro_batch_input(micro_batch)
            rows = _Rows(input_ids, self.harts_share_prefixes)
            seen: dict = {}

            def loss_fn(logprob: Tensor, entropy: Tensor) -> Tensor:
                # verl's loss of the micro-batch, on its own layout; called once per micro-batch
                # (harts seeds each part's backward with this loss's gradient by the rows)
                loss, metrics = loss_function(
                    model_output=rows.output(logprob, entropy, with_entropy), data=micro_batch,
                    dp_group=self.get_data_parallel_group(),
                )  # fmt: skip
                seen["loss"], seen["metrics"] = loss.detach(), metrics
                return loss * scale

            result = forest_backward(
                module, rows.forest, rows.predictor, rows.target, loss_fn, run=self.harts_run,
                temperature=temperature, sharded=sharded,
            )  # fmt: skip
            output = rows.output(result.logprob, result.entropy, with_entropy)
            return {"model_output": output, "loss": float(seen["loss"]), "metrics": seen["metrics"]}

        def forward_step(self, micro_batch, loss_function, forward_only):
            if self._uses_fsdp2_cpu_offload_policy:  # see _harts_sharded
                return super().forward_step(micro_batch, loss_function, forward_only)
            micro_batch = micro_batch.to(get_device_id())
            output = model_output(self.module, micro_batch, run=self.harts_run,
                                  share_prefixes=self.harts_share_prefixes)  # fmt: skip
            if loss_function is not None:
                loss, metrics = loss_function(
                    model_output=output, data=micro_batch, dp_group=self.get_data_parallel_group()
                )
            else:
                if not forward_only:
                    raise ValueError("forward_only must be True when loss_function is None")
                loss, metrics = torch.tensor(1.0), {}
            detached = {k: v.detach() for k, v in output.items()}
            return loss, {"model_output": detached, "loss": loss.detach().item(), "metrics": metrics}

    _ENGINE.append(HartsFSDPEngine)
    return HartsFSDPEngine


def register_engine(
    backends: tuple[str, ...] = ("fsdp", "fsdp2"), devices: tuple[str, ...] = ("cuda", "cpu")
):
    """Make verl's actor engine for ``backends`` (the actor's ``strategy``; verl's FSDP engine
    config accepts ``fsdp`` and ``fsdp2``) ``HartsFSDPEngine`` on ``devices``, and return the class.

    ``HartsFSDPEngine`` is verl's ``FSDPEngineWithLMHead`` with one method replaced:
    ``forward_step`` builds the micro-batch's model output with :func:`model_output` and hands it
    to verl's loss function, as the stock one does with the HF forward's. Only model type
    ``language_model`` changes (critics keep verl's value engine). verl's
    ``EngineRegistry.register`` refuses a key that is taken, so the entries are set in its table
    directly; :func:`unregister_engine` puts the stock engines back.
    """
    engine = _engine_class()
    from verl.workers.engine.base import EngineRegistry

    table = EngineRegistry._engines.setdefault("language_model", {})
    for backend in backends:
        for device in devices:
            current = table.setdefault(backend, {}).get(device)
            if current is not engine:
                _STOCK[(backend, device)] = current
            table[backend][device] = engine
    return engine


def unregister_engine() -> None:
    """Put back the engines :func:`register_engine` replaced."""
    if not _STOCK:
        return
    from verl.workers.engine.base import EngineRegistry

    table = EngineRegistry._engines["language_model"]
    for (backend, device), stock in _STOCK.items():
        if stock is None:
            table[backend].pop(device, None)
        else:
            table[backend][device] = stock
    _STOCK.clear()
