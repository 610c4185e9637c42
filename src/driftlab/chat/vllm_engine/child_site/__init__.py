"""A folder put on PYTHONPATH for vLLM's child processes: its `sitecustomize` (see there)."""
