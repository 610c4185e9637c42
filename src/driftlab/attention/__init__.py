"""The single attention function every local model runs through (see engine.py).

Imports of torch happen on first use of the engine, so `driftlab.attention.config` (what
`--steer` parsing needs) stays cheap.
"""

__all__ = ["ATTENTION_NAME", "register"]


def __getattr__(name: str):
    if name in __all__:
        from driftlab.attention import engine

        return getattr(engine, name)
    raise AttributeError(name)
