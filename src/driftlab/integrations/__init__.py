"""Adapters that let other evaluation tools drive a driftlab backend.

`driftlab.integrations.lm_eval`: `DriftlabLM`, an lm-evaluation-harness model (registered as
"driftlab") that scores and generates with a local driftlab model under `--steer` interventions.
Each adapter imports its tool itself; nothing here is imported by `import driftlab`.
"""
