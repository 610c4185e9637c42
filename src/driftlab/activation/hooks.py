"""The residual stream's one hook: a forward hook on every decoder layer of a model.

Why forward hooks rather than a wrapped layer: they leave the model's modules as they are
(a model the user holds gets them back untouched), every architecture whose decoder layers
sit in one list gets them the same way, and torch.compile traces them inside the layer's call.
A hook does nothing unless the forward call carries a `ResidualState` (keyword `KWARG`,
which transformers hands every decoder layer with the other attention keywords).
"""

from __future__ import annotations

from typing import Any

from driftlab.activation.state import KWARG
from driftlab.errors import DriftlabError

_HANDLES = "_driftlab_residual_hooks"


def _base(model: Any) -> Any:
    """The model itself, or a PEFT wrapper's base model."""
    get = getattr(model, "get_base_model", None)
    return get() if callable(get) and hasattr(model, "peft_config") else model


def decoder_layers(model: Any) -> list[Any]:
    """The model's decoder layers, in order (a PEFT wrapper's base model's)."""
    base = _base(model)
    decoder = base.get_decoder() if hasattr(base, "get_decoder") else getattr(base, "model", None)
    layers = getattr(decoder, "layers", None)
    if layers is None:
        raise DriftlabError(f"{type(base).__name__} keeps no list of decoder layers where driftlab looks "
                            "(model.get_decoder().layers), so its residual stream cannot be read or steered.",
                            hint="Run this model without --directions and activation steers (vector, cap).")
    return list(layers)


class _Hook:
    """Layer `index`'s hook: hands the layer's output to the call's state, if it has one."""

    def __init__(self, index: int) -> None:
        self.index = index

    def __call__(self, module, args, kwargs, output):
        state = kwargs.get(KWARG)
        if state is None:
            return None
        if isinstance(output, tuple):  # older decoder layers return (hidden, ...)
            return (state.apply(self.index, output[0]), *output[1:])
        return state.apply(self.index, output)


def install(model: Any) -> bool:
    """Hook every decoder layer of `model`; False where they were hooked already (nothing changes).

    transformers adds its own output-capturing hooks to the same layers the first time a call asks
    for hidden states or attentions (pastalib's generate, an eager trace). A compiled decode step
    guards on each layer's hook count, so that late addition would compile every graph again: they
    go on here, first, and the layers' hooks never change after this."""
    layers = decoder_layers(model)
    if getattr(layers[0], _HANDLES, None) is not None:
        return False
    _capturing_hooks(model)
    for i, layer in enumerate(layers):
        setattr(layer, _HANDLES, layer.register_forward_hook(_Hook(i), with_kwargs=True))
    return True


def _capturing_hooks(model: Any) -> None:
    """transformers' output-capturing hooks, installed now rather than at the first call that asks."""
    try:
        from transformers import PreTrainedModel
        from transformers.utils.output_capturing import maybe_install_capturing_hooks
    except ImportError:  # a transformers without them adds none later either
        return
    base = _base(model)
    if isinstance(base, PreTrainedModel):
        maybe_install_capturing_hooks(base)


def remove(model: Any) -> None:
    """Take driftlab's hooks off again (a borrowed model goes back as it came, but for transformers'
    own capturing hooks, which it would have put on at its first call asking for hidden states)."""
    for layer in decoder_layers(model):
        handle = getattr(layer, _HANDLES, None)
        if handle is not None:
            handle.remove()
            delattr(layer, _HANDLES)
