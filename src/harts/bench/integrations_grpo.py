"""Stock vs harts on one shared-prompt GRPO batch: the log-prob forward and backward an RL stack runs.

The batch is what TRL's GRPOTrainer (and verl's actor with ``rollout.n``) trains on: P prompts,
each sampled G times, as one padded [B, L] batch (left-padded prompts, right-padded completions).
Stock: the HF backbone over the padded batch, the head on the completion positions only (as
TRL's fused LM head), log-softmax of the completion tokens and their entropies, a loss of them,
backward (what TRL's ``_get_per_token_logps_and_entropies`` and its loss do). harts:
:func:`harts.integrations.batch_logprobs` on the same tensors, the same loss, backward. Prints
the flat and unique token counts, the median seconds of each and the speedup, and checks that
both give the same log-probs.

    python -m harts.bench.integrations_grpo [--family qwen3] [--prompts 2] [--generations 8]
        [--prompt-len 512] [--completion-len 64] [--repeats 3] [--threads 2]

What this leaves out: generation, rewards and the optimizer (unchanged by harts), and GPUs (the
figures are CPU ones; the model is a small random one, see ``--hidden``).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from harts.integrations import batch_logprobs
from harts.tiny import tiny_config, tiny_model


def make_batch(args, vocab: int):
    gen = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(args.prompts):
        prompt = torch.randint(3, vocab, (args.prompt_len,), generator=gen)
        for _ in range(args.generations):
            length = int(
                torch.randint(args.completion_len // 2, args.completion_len + 1, (1,), generator=gen)
            )
            rows.append((prompt, torch.randint(3, vocab, (length,), generator=gen)))
    width_p, width_c = max(len(p) for p, _ in rows), max(len(c) for _, c in rows)
    ids = torch.zeros(len(rows), width_p + width_c, dtype=torch.long)
    mask = torch.zeros_like(ids)
    completion = torch.zeros_like(ids, dtype=torch.bool)
    for b, (p, c) in enumerate(rows):
        ids[b, width_p - len(p) : width_p + len(c)] = torch.cat([p, c])
        mask[b, width_p - len(p) : width_p + len(c)] = 1
        completion[b, width_p : width_p + len(c)] = True
    return ids, mask, completion


def stock(model, ids, mask, completion):
    # as TRL's fused head: the backbone over every padded row, the head only where a completion token is
    hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state[:, :-1]
    target = completion[:, 1:]
    logp = torch.log_softmax(model.lm_head(hidden[target]).float(), -1)
    lp = torch.zeros(target.shape).masked_scatter(target, logp.gather(1, ids[:, 1:][target][:, None])[:, 0])
    ent = torch.zeros(target.shape).masked_scatter(target, -(logp.exp() * logp).sum(-1))
    return torch.nn.functional.pad(lp, (1, 0)), torch.nn.functional.pad(ent, (1, 0))


def tree(model, ids, mask, completion):
    out = batch_logprobs(model, ids, mask, score_mask=completion)
    return out.logprobs, out.entropies


def timed(fn, model, batch, weight, repeats):
    seconds = []
    for _ in range(repeats + 1):  # the first run warms up
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        lp, ent = fn(model, *batch)
        ((lp + 0.01 * ent) * weight).sum().backward()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds[1:]), lp.detach()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--family", default="qwen3")
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--completion-len", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    overrides = dict(
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        vocab_size=args.vocab,
        num_hidden_layers=args.layers,
    )
    config = tiny_config(args.family)
    grouped = hasattr(config, "num_key_value_heads") and hasattr(config, "head_dim")
    if grouped and not hasattr(config, "kv_lora_rank"):
        # grouped-query attention at the chosen width: 4 heads sharing 2 key-value heads
        overrides |= dict(num_attention_heads=4, num_key_value_heads=2, head_dim=args.hidden // 4)
    model = tiny_model(args.family, seed=0, **overrides)
    batch = make_batch(args, args.vocab)
    ids, mask, completion = batch
    weight = torch.randn(ids.shape, generator=torch.Generator().manual_seed(1))
    forest_stats = batch_logprobs(model, *batch[:2], score_mask=completion).forest
    flat, unique = int(mask.sum()), forest_stats.num_tokens
    t_stock, lp_stock = timed(stock, model, batch, weight, args.repeats)
    t_tree, lp_tree = timed(tree, model, batch, weight, args.repeats)
    diff = float((lp_stock - lp_tree)[completion].abs().max())
    print(
        f"{args.family} hidden {args.hidden} x {args.layers} layers, vocab {args.vocab}, "
        f"{args.threads} threads"
    )
    print(
        f"batch: {args.prompts} prompts x {args.generations} generations, prompt {args.prompt_len}, "
        f"completion <= {args.completion_len}: padded {ids.numel()} slots, {flat} tokens, "
        f"{unique} unique (flat / unique {flat / unique:.2f})"
    )
    print(
        f"stock forward+backward: {t_stock:.3f} s   harts: {t_tree:.3f} s   "
        f"speedup {t_stock / t_tree:.2f}x   max |log-prob diff| {diff:.2e}"
    )


if __name__ == "__main__":
    main()
