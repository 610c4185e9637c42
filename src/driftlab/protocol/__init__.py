"""Protocols: units of work that write run directories, all run by `runner.run_protocol`.

* `runner` — the `Protocol` base, `ProtocolConfig` (the backend spec every config nests)
  and `run_protocol` (lock, plan, resume, progress, completion);
* `registry` — protocols by name, for readers of a manifest;
* `selfchat` (with `dialog`: typed records, dialogs rebuilt from records), `mmlu`,
  `calibrate`, `sweep`, `decay`.
"""
