"""PASTA (seed 002): user-emphasised spans, attention steering on profiled heads, its tasks.

* `emphasis` — `*marked*` spans and explicit character spans, mapped to tokens;
* `heads` — head sets: pastalib's JSON format, profiles (rankings) and their selection;
* `datasets`, `metrics`, `tasks` — the paper's four tasks, bundled data and loaders;
* `profile`, `evaluate` — `driftlab pasta profile` and `driftlab pasta eval`.

Steering itself is the `pasta` intervention (`--steer pasta:...`) on the attention engine.
"""
