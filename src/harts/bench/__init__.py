"""``harts bench``: tree vs flat vs stock per-trajectory training, and the per-part overhead.

- :mod:`harts.bench.cases`: the config, models, shapes and steps a run times;
- :mod:`harts.bench.run`: timing, the command line (``harts bench``);
- the FLOP model behind the ideal speedup is :mod:`harts.runtime.flops` (the trainer reads it too);
- :mod:`harts.bench.memory`: tensor and resident-set peaks in child processes;
- :mod:`harts.bench.peers`: PrefixGrouper and flash-pref on their one-prefix shape;
- :mod:`harts.bench.report`: Markdown, JSON and the plot;
- :mod:`harts.bench.overhead`: time outside model compute in a budgeted step on a large forest;
- :mod:`harts.bench.checkpointing`: saved activations, peak and time with gradient checkpointing.

The measurements the docs quote, each run on its own (``python -m harts.bench.<name> --help``):

- :mod:`harts.bench.three_passes`: the three passes of a PPO/GRPO step, tree against flat;
- :mod:`harts.bench.critic_step`: a critic's value step, tree against flat;
- :mod:`harts.bench.integrations_grpo`: stock vs harts on one shared-prompt GRPO batch;
- :mod:`harts.bench.distributed_step`: one step on N ranks (``torchrun -m``) against one process;
- :mod:`harts.bench.fsdp_memory`: per-rank tensor peak of an FSDP2 / DDP step against stock FSDP2;
- :mod:`harts.bench.recipe_memory`: per-rank memory of the whole RL recipe's phases under FSDP2;
- :mod:`harts.bench.master_weights`: bf16 training with and without fp32 master weights;
- :mod:`harts.bench.fit_linear_cost`: the linear-attention kernels timed, the cost model fitted;
- :mod:`harts.bench.delta_rule_kernel`: the gated delta rule's chunked op against stock and naive;
- :mod:`harts.bench.gpu_precision_table`: the table of a GPU precision report.
"""
