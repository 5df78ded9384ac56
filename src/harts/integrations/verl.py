"""verl: the actor's log-probs and entropies from harts, in the layout verl's engine hands its losses.

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

:func:`model_output` computes exactly that with one harts forward over the micro-batch's forest
(the prompt shared by a group's ``rollout.n`` responses runs once), with autograd, so verl's own
loss code (every registered policy loss, aggregation, KL and entropy term) runs unchanged on it.
:func:`register_engine` makes ``HartsFSDPEngine`` (verl's FSDP engine with this
``forward_step``) the engine verl's ``EngineRegistry`` gives the actor for its ``fsdp`` /
``fsdp2`` strategy.

What this leaves out: generation (verl's rollout workers), critics and value heads (the value
engine is verl's), distillation outputs, ``use_fused_kernels`` / Σπ² outputs, Ulysses sequence
parallelism, per-sequence temperatures that differ within a micro-batch (refused), and sharing
across micro-batches (keep a group's responses in one micro-batch: verl orders them together).
The engine runs its model through harts, which refuses, with an error naming the wrapper, a
model whose parameters FSDP keeps sharded during the forward (see ``harts.runtime.model_checks``).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from harts.integrations.batch import batch_logprobs
from harts.runtime.config import RunConfig

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


def model_output(
    model: nn.Module, data, *, run: RunConfig | None = None, share_prefixes: bool = True
) -> dict[str, Tensor]:
    """``{"log_probs": ..., "entropy": ...}`` (entropy when ``calculate_entropy`` is set) of a verl
    micro-batch, jagged [B, j] and predictor-indexed as verl's engine returns them (see the module
    docstring), computed by harts with autograd."""
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
    temperature = _temperature(_get(data, "temperature"), batch)
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
    if _get(data, "calculate_entropy", False):
        result["entropy"] = jagged(out.entropies)
    return result


_STOCK: dict[tuple[str, str], type] = {}  # (backend, device) -> the engine register_engine replaced
_ENGINE: list[type] = []


def _engine_class() -> type:
    if _ENGINE:
        return _ENGINE[0]
    try:
        from verl.utils.device import get_device_id
        from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead
    except ImportError as err:
        raise ImportError(f"the harts engine needs verl (0.9): {err}") from err

    class HartsFSDPEngine(FSDPEngineWithLMHead):
        """verl's FSDP actor engine with the micro-batch forward run by harts (shared prefixes once)."""

        harts_run: RunConfig | None = None

        def forward_step(self, micro_batch, loss_function, forward_only):
            micro_batch = micro_batch.to(get_device_id())
            output = model_output(self.module, micro_batch, run=self.harts_run)
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
