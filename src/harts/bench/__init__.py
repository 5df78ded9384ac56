"""``harts bench``: tree vs flat vs stock per-trajectory training, and the per-part overhead.

- :mod:`harts.bench.cases`: the config, models, shapes and steps a run times;
- :mod:`harts.bench.run`: timing, the command line (``harts bench``);
- :mod:`harts.bench.flops`: the FLOP model behind the ideal speedup;
- :mod:`harts.bench.memory`: tensor and resident-set peaks in child processes;
- :mod:`harts.bench.peers`: PrefixGrouper and flash-pref on their one-prefix shape;
- :mod:`harts.bench.report`: Markdown, JSON and the plot;
- :mod:`harts.bench.overhead`: time outside model compute in a budgeted step on a large forest;
- :mod:`harts.bench.checkpointing`: saved activations, peak and time with gradient checkpointing.
"""
