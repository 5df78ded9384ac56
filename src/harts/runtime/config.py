"""The execution knobs of a run, in one typed config.

:class:`RunConfig` is accepted by :func:`harts.forward`, :func:`harts.forest_backward`,
:func:`harts.rollout_step` and the benchmark. It says *how* a forest is computed, never *what*:
every setting gives the same loss and gradients (up to floating-point summation order), only time
and memory change.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from harts.ops.backends import available_backends
from harts.ops.logprobs import DEFAULT_CHUNK_ROWS
from harts.plan.linear_cost import LinearCostModel, PlanMode
from harts.plan.micro_batches import DEFAULT_CONTEXT_WEIGHT

__all__ = ["RunConfig", "HoldTokens", "HOLD_AUTO", "BackendName"]


class HoldTokens(StrEnum):
    """The named settings of ``RunConfig.hold_tokens`` (otherwise an int, the bound itself); a
    member equals its string, so ``"auto"`` (a caller's, a TOML file's) is the same setting."""

    AUTO = "auto"  # follow the budget: one micro-batch's tokens of held graphs


#: ``RunConfig.hold_tokens`` that follows the budget: one micro-batch's tokens of held graphs
HOLD_AUTO = HoldTokens.AUTO


class BackendName(StrEnum):
    """``RunConfig.backend``: ``auto`` and the built-in kernel backends (:mod:`harts.ops.backends`);
    a member equals its string. A backend registered under another name is selected by that name."""

    AUTO = "auto"  # an enclosing use_backend's, else fla on CUDA with the gpu extra, else torch
    TORCH = "torch"  # plain PyTorch, any device
    FLA = "fla"  # flash-linear-attention and FlexAttention, CUDA


@dataclass(frozen=True)
class RunConfig:
    """How a forest is run.

    - ``budget_tokens``: unique tokens per micro-batch (None: the whole forest at once). Trees that
      fit are packed whole; larger trees are cut at node boundaries into balanced parts.
    - ``context_weight``: what one context token (an ancestor read from an earlier part) counts
      against the budget of a cut part, in [0, 1]; 0.25 by default (measured: a context row costs
      about a fifth of a token's activations).
    - ``linear_plan``: how linear-attention layers are cut into calls: ``auto`` (the cheapest under
      ``cost_model``), ``depth`` (one call per depth level), ``chain`` (fewest calls), ``tree``
      (one call per layer over a chunk tree, :mod:`harts.plan.chunk_tree`; the plain-PyTorch kernels
      on every backend, so ``auto`` considers it only under the default backend) or ``packed`` (one
      call per layer over chunks that span nodes, :mod:`harts.plan.packed_chunks`; plain PyTorch
      too, and never chosen by ``auto``).
    - ``cost_model``: the linear-plan cost model, :mod:`harts.plan.linear_cost` (fitted on a 2-core
      CPU by default; refit on a GPU).
    - ``chunk_rows``: loss rows per chunk of the output head, bounding the [rows, vocab] logits.
    - ``recompute_linear``: linear-attention calls keep only their inputs for backward and run
      again there (about 30% less activation memory, 7-28% more time on the hybrid configs).
    - ``hold_tokens``: under a loss that is a sum of per-row terms, a cut tree's parts run depth
      first: a part no later part reads runs forward and backward once; a part that later parts
      read either keeps its graph until they have sent their gradients back, or runs without
      autograd first and again in backward. ``hold_tokens`` bounds the tokens of such held graphs
      beyond the running part (:attr:`hold_limit`), so the step's graphs stay within
      ``budget_tokens + hold_tokens``. ``auto`` (default): ``budget_tokens``, so they stay within
      two micro-batches' tokens, and a cut tree whose parts read by later parts fit one budget
      together along any path from its root runs each part forward once (without a budget there
      is one part and nothing to hold). An int >= 0 is the bound itself: 0 holds no graph, so
      peak memory stays that of one micro-batch and every part that later parts read runs
      forward twice. ``StepResult.recomputed_parts`` names the parts that ran twice. Measured
      trade-off: docs/benchmarks.md.
    - ``fsdp_overlap``: under FSDP2, communication overlaps compute as FSDP2's own prefetch does:
      the next decoder layer's gather starts while one computes (forward and backward), and a
      layer's gradient sum runs during the next layer's backward. Costs one more layer unit whole
      (and one unit's gradient in flight). False: each collective completes before compute goes
      on, one unit whole at a time. The result is the same bits either way.
    - ``backend``: the kernels (:mod:`harts.ops.backends`): ``torch`` (plain PyTorch, any device),
      ``fla`` (flash-linear-attention and FlexAttention, CUDA, the ``gpu`` extra), or ``auto``
      (default): the backend of an enclosing ``use_backend`` context, else ``fla`` on a CUDA device
      where the ``gpu`` extra is installed and ``torch`` elsewhere. Backends agree to floating-point
      rounding (each is tested against the same references), not bit for bit.
    - ``verify``: before computing, check the call on a sample of its trajectories against the
      model's own stock forward on the same device and dtype (:mod:`harts.runtime.verify`), and
      raise :class:`harts.VerificationError`, its gradients left out of ``.grad``, when harts is
      off. A passing check changes nothing the call computes. One process and DDP (each rank
      checks its own trees); refused on an FSDP2-sharded model.
    """

    budget_tokens: int | None = None
    context_weight: float = DEFAULT_CONTEXT_WEIGHT
    linear_plan: PlanMode = PlanMode.AUTO
    cost_model: LinearCostModel = field(default_factory=LinearCostModel)
    chunk_rows: int = DEFAULT_CHUNK_ROWS
    recompute_linear: bool = False
    hold_tokens: int | HoldTokens = HOLD_AUTO
    fsdp_overlap: bool = True
    backend: BackendName | str = BackendName.AUTO
    verify: bool = False

    def __post_init__(self):
        if self.budget_tokens is not None and (
            isinstance(self.budget_tokens, bool)
            or not isinstance(self.budget_tokens, int)
            or self.budget_tokens < 1
        ):
            raise ValueError(f"budget_tokens must be a positive int or None, got {self.budget_tokens!r}")
        if not 0.0 <= self.context_weight <= 1.0:
            raise ValueError(f"context_weight must lie in [0, 1], got {self.context_weight}")
        try:
            object.__setattr__(self, "linear_plan", PlanMode(self.linear_plan))
        except ValueError:
            raise ValueError(
                f"unknown linear_plan {self.linear_plan!r}; expected one of {[m.value for m in PlanMode]}"
            ) from None
        if not isinstance(self.cost_model, LinearCostModel):
            raise TypeError(f"cost_model must be a LinearCostModel, got {type(self.cost_model).__name__}")
        if isinstance(self.chunk_rows, bool) or not isinstance(self.chunk_rows, int) or self.chunk_rows < 1:
            raise ValueError(f"chunk_rows must be a positive int, got {self.chunk_rows!r}")
        hold = self.hold_tokens
        if isinstance(hold, str) and hold in HoldTokens.__members__.values():
            object.__setattr__(self, "hold_tokens", HoldTokens(hold))
        elif isinstance(hold, bool) or not isinstance(hold, int) or hold < 0:
            raise ValueError(f"hold_tokens must be {HOLD_AUTO.value!r} or an int >= 0, got {hold!r}")
        if not isinstance(self.fsdp_overlap, bool):
            raise ValueError(f"fsdp_overlap must be True or False, got {self.fsdp_overlap!r}")
        if not isinstance(self.verify, bool):
            raise ValueError(f"verify must be True or False, got {self.verify!r}")
        if isinstance(self.backend, str) and self.backend in BackendName.__members__.values():
            object.__setattr__(self, "backend", BackendName(self.backend))
        if self.backend != BackendName.AUTO and self.backend not in available_backends():
            raise ValueError(
                f"unknown backend {self.backend!r}; expected auto or one of {', '.join(available_backends())}"
            )

    @property
    def unverified(self) -> RunConfig:
        """This config without ``verify``: what a verified call runs once its check has passed."""
        return RunConfig(**{**self.__dict__, "verify": False}) if self.verify else self

    @property
    def hold_limit(self) -> int:
        """The tokens of held graphs a step may keep beyond its running part: ``hold_tokens``, with
        ``auto`` read as ``budget_tokens`` (0 without a budget: the forest runs as one part, which
        no other part reads). Resolved here, from the config a step runs under, so a budget
        applied later (:meth:`resolve`, ``dataclasses.replace``) carries the bound with it."""
        if self.hold_tokens == HoldTokens.AUTO:
            return self.budget_tokens or 0
        return self.hold_tokens

    @staticmethod
    def resolve(run: RunConfig | None, budget_tokens: int | None = None) -> RunConfig:
        """``run`` (default: ``RunConfig()``) with ``budget_tokens`` applied when given.

        A budget given both ways must agree: two different budgets for one step are refused.
        """
        if run is None:
            run = RunConfig()
        elif not isinstance(run, RunConfig):
            raise TypeError(f"run must be a harts.RunConfig, got {type(run).__name__}")
        if budget_tokens is None:
            return run
        if run.budget_tokens is not None and run.budget_tokens != budget_tokens:
            raise ValueError(
                f"budget_tokens={budget_tokens} disagrees with "
                f"run.budget_tokens={run.budget_tokens}: give one"
            )
        return RunConfig(**{**run.__dict__, "budget_tokens": budget_tokens})
