"""PASTA (Zhang et al., ICLR 2024): its four tasks and the protocols that run them.

* `datasets`, `metrics`, `tasks` — the paper's four tasks, bundled data and loaders;
* `evaluate`, `profile`, `tune` — `driftlab pasta eval | profile | tune`, protocols on the
  shared runner (`driftlab.protocol.runner`), their figures in `driftlab.report.pasta`.

Steering itself is the `pasta` intervention (`--steer pasta:...`) on the attention engine;
emphasis markup and head sets live beside it, in `driftlab.steering.emphasis` and `.heads`.
"""
