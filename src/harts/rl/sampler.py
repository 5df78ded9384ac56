"""Tree rollouts: the model samples its turns, branching at turn boundaries, with its own cache.

For a step's episodes the sampler runs the prompts once (prefill), then for each turn:

1. branch: each live row is repeated ``branching[turn]`` times, its cache with it
   (``Cache.reorder_cache`` with a repeated index: key/value tensors and the linear-attention
   conv and recurrent states are gathered along the batch), so the continuations of a shared
   prefix start from its one computed state;
2. sample the answer token of every row from ``softmax(logits / temperature)``;
3. run the answer and the environment's observation through the model in one call that extends
   the cache (not after the last turn: nothing reads it).

Every row of a step has the same length at every turn (the task's formats are of fixed length),
so the batch needs no padding and no attention mask, which linear-attention layers would have to
honour. The trajectories come out as :class:`harts.Rollout` s: the loss mask on the answer
tokens, the sampler's log-probs at the sampling temperature (``rollout_logprobs``), the reward,
the first wrong answer's position (for the ``pitfall`` estimator) and one ``group_id`` per
episode; their shared prefixes are what the tree layout computes once.

Sampling draws one uniform number per row and token from the caller's ``torch.Generator`` and
inverts the CDF (accumulated in fp64): the draw does not depend on anything but the generator,
and a parameter change of fp32 noise size moves a sampled token only when a draw falls within
that distance of a CDF boundary. Two runs with the same parameters and generator sample the
same rollouts.

What this leaves out: padding (rows of different lengths), stop tokens, top-k/top-p, and
sampling from a different engine than the model being trained.
"""

from __future__ import annotations

import inspect
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from harts.adapters.base import registered_adapter
from harts.objectives.rollout import Rollout
from harts.rl.task import Episode, RunningSum

__all__ = ["SamplingConfig", "TreeSample", "sample_tree"]

Tensor = torch.Tensor


@dataclass(frozen=True)
class SamplingConfig:
    """``[sampling]``: how many episodes a step samples and how the rollouts branch.

    ``branching[t]`` continuations start at the boundary before turn ``t``; an episode yields
    ``prod(branching)`` trajectories, its GRPO group.
    """

    prompts_per_step: int = 8
    branching: tuple[int, ...] = (2, 2, 2)
    temperature: float = 1.0

    def __post_init__(self):
        if not self.prompts_per_step >= 1:
            raise ValueError(
                f"sampling.prompts_per_step: expected a positive integer, got {self.prompts_per_step}"
            )
        for i, b in enumerate(self.branching):
            if isinstance(b, bool) or not isinstance(b, int) or b < 1:
                raise ValueError(f"sampling.branching[{i}]: expected a positive integer, got {b!r}")
        if not 0 < self.temperature < float("inf"):
            raise ValueError(f"sampling.temperature: expected a positive number, got {self.temperature}")

    def leaves(self) -> int:
        out = 1
        for b in self.branching:
            out *= b
        return out


@dataclass
class TreeSample:
    """A step's rollouts and what the sampler did."""

    rollouts: list[Rollout]
    rewards: torch.Tensor  # [N] float64, one per trajectory
    episode: torch.Tensor  # [N] index of each trajectory's episode
    model_tokens: int  # tokens the sampler ran through the model (prefill + extensions)
    model_calls: int


def _call(model: nn.Module, ids: torch.Tensor, cache):
    """``model(ids)`` extending ``cache`` (None: a fresh one); the logits of the last position and
    the cache. The cache keyword is ``cache`` in newer transformers, ``past_key_values`` before."""
    params = inspect.signature(model.forward).parameters
    key = "cache" if "cache" in params else "past_key_values"
    kwargs = {key: cache} if cache is not None else {}
    out = model(input_ids=ids, use_cache=True, logits_to_keep=1, **kwargs)
    new = out["cache"] if "cache" in out else out["past_key_values"]
    if new is None:
        raise ValueError(f"{type(model).__name__} returned no cache with use_cache=True: cannot sample turns")
    return out.logits[:, -1].float(), new


def _draw(logits: Tensor, temperature: float, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """[N] tokens from ``softmax(logits / T)`` by inverting the CDF at a uniform draw; their log-probs."""
    logprobs = torch.log_softmax(logits / temperature, dim=-1)
    cdf = logprobs.double().exp().cumsum(-1)
    u = torch.rand(logits.shape[0], 1, generator=generator, dtype=torch.float64, device=generator.device)
    token = torch.searchsorted(cdf, u.to(cdf.device) * cdf[:, -1:], right=True)
    token = token.clamp(max=logits.shape[-1] - 1)  # u * total can round onto the last boundary
    return token[:, 0], logprobs.gather(-1, token)[:, 0]


def _checked(model, task: RunningSum, episodes, config: SamplingConfig, group_ids) -> list:
    """The episodes' group ids, once the model, the task and the sampling config are known to fit
    (ValueError naming what does not)."""
    if len(config.branching) != task.turns:
        raise ValueError(
            f"sampling.branching has {len(config.branching)} entries but the task has "
            f"{task.turns} turns: give one per turn"
        )
    if not episodes:
        raise ValueError("no episodes to sample")
    family = getattr(model.config, "model_type", None)
    why = cache_not_exact(family)
    if why is not None:
        raise ValueError(f"harts rl cannot sample {family}: {why}")
    vocab = model.config.get_text_config().vocab_size
    if vocab != task.vocab_size:
        raise ValueError(
            f"the model's vocab_size is {vocab}, the task's vocabulary has {task.vocab_size} "
            f"tokens: build the model with vocab_size={task.vocab_size}"
        )
    group_ids = list(range(len(episodes))) if group_ids is None else list(group_ids)
    if len(group_ids) != len(episodes):
        raise ValueError(f"{len(group_ids)} group ids for {len(episodes)} episodes")
    return group_ids


def sample_tree(
    model: nn.Module,
    task: RunningSum,
    episodes: Sequence[Episode],
    config: SamplingConfig,
    generator: torch.Generator,
    group_ids: Sequence[Hashable] | None = None,
) -> TreeSample:
    """Sample ``config.leaves()`` trajectories per episode, branching at turn boundaries.

    ``group_ids[g]`` is episode g's group (default: g). The model runs without gradients and in
    its current mode; the rollouts' ``rollout_logprobs`` are ``log_softmax(logits / T)`` of each
    sampled token, computed with the cache (the tests check them against a fresh full forward).
    """
    group_ids = _checked(model, task, episodes, config, group_ids)
    device = next(model.parameters()).device
    seq = torch.tensor([task.prompt(e) for e in episodes], device=device)  # [N, L]
    episode = torch.arange(len(episodes), device=device)  # [N]
    logp = torch.zeros(seq.shape, dtype=torch.float64, device=device)
    mask = torch.zeros(seq.shape, dtype=torch.bool, device=device)
    answers: list[list[int]] = [[] for _ in episodes]  # per row: its answer tokens so far
    calls, tokens = 1, seq.numel()
    with torch.no_grad():
        last, cache = _call(model, seq, None)
        for turn, branches in enumerate(config.branching):
            if branches > 1:
                index = torch.arange(seq.shape[0], device=device).repeat_interleave(branches)
                _branch(cache, index)
                last, seq, episode = last[index], seq[index], episode[index]
                logp, mask = logp[index], mask[index]
                answers = [list(answers[i]) for i in index.tolist()]
            token, token_logp = _draw(last, config.temperature, generator)
            seq = torch.cat([seq, token[:, None]], dim=1)
            logp = torch.cat([logp, token_logp.double()[:, None]], dim=1)
            mask = torch.cat([mask, torch.ones_like(token, dtype=torch.bool)[:, None]], dim=1)
            for row, t in enumerate(token.tolist()):
                answers[row].append(t)
            if turn == task.turns - 1:
                break
            rows = zip(episode.tolist(), answers, strict=True)
            obs = torch.tensor([task.observation(episodes[e], turn, [a[-1]]) for e, a in rows], device=device)
            feed = torch.cat([token[:, None], obs], dim=1)
            last, cache = _call(model, feed, cache)
            calls, tokens = calls + 1, tokens + feed.numel()
            seq = torch.cat([seq, obs], dim=1)
            logp = torch.cat([logp, torch.zeros(obs.shape, dtype=torch.float64, device=device)], dim=1)
            mask = torch.cat([mask, torch.zeros(obs.shape, dtype=torch.bool, device=device)], dim=1)
    rollouts, rewards = [], []
    answer_positions = mask[0].nonzero()[:, 0].tolist()  # the same in every row (fixed formats)
    for row, (e, a) in enumerate(zip(episode.tolist(), answers, strict=True)):
        ep = episodes[e]
        verdicts = [task.check(ep, t, [tok]) for t, tok in enumerate(a)]
        reward = sum(verdicts) / task.turns
        first_error = next((answer_positions[t] for t, ok in enumerate(verdicts) if not ok), None)
        rollouts.append(
            Rollout(
                tokens=seq[row].cpu(),
                loss_mask=mask[row].cpu(),
                rollout_logprobs=logp[row].cpu(),
                reward=reward,
                group_id=group_ids[e],
                first_error_position=first_error,
            )
        )
        rewards.append(reward)
    return TreeSample(rollouts, torch.tensor(rewards, dtype=torch.float64), episode.cpu(), tokens, calls)


def cache_not_exact(family: str | None) -> str | None:
    """Why sampling ``family`` through its stock cache would record wrong log-probs, or None (what its
    adapter declares: ``inexact_cache``, ``exact_cache_from``)."""
    adapter = registered_adapter(family)
    if adapter is None:
        return None
    if adapter.inexact_cache is not None:
        return adapter.inexact_cache
    if adapter.exact_cache_from is not None:
        import transformers
        from packaging.version import Version

        if Version(transformers.__version__) < Version(adapter.exact_cache_from):
            return (
                f"its cache in transformers {transformers.__version__} does not give the log-probs of a "
                f"full forward after a branch point (exact from {adapter.exact_cache_from})"
            )
    return None


def _branch(cache, index: torch.Tensor) -> None:
    """Repeat the cache's rows by ``index``. A cache class that keeps state outside its layers
    reorders it in its own ``batch_select_indices`` (MiniMax's lightning-attention states), which
    ``reorder_cache`` would leave as they are; the others reorder every layer in ``reorder_cache``."""
    if "batch_select_indices" in type(cache).__dict__:
        cache.batch_select_indices(index)
    else:
        cache.reorder_cache(index)
