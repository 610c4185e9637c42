"""driftlab's attention on a model the user already holds: checked, installed, given back.

Why a module of its own: `HFChatBackend.from_model` (chat/hf.py) and `steer()` (chat/steer.py)
both borrow a transformers model that somebody else loaded, placed, quantised or wrapped
with PEFT. Both must leave it as they found it, refuse a model driftlab's attention cannot
steer before it silently runs unsteered (a one-line error naming what is missing), and not
hand one model to two borrowers at once (whoever gave it back first would restore the
model's own attention under the other).

Installing goes through transformers' own switch, `set_attn_implementation("driftlab")`,
which reaches every sub-model sharing the attention interface, and the model's previous
implementation (`config._attn_implementation` of the model and its sub-configs) is restored
the same way. A model is accepted when one short probe pass (two tokens, pi tracing on every
layer) reaches driftlab's attention function in every layer: that covers architectures whose
attention ignores the AttentionInterface, modules without `layer_idx`, hybrid layouts whose
layers are not all attention, and attention arguments the engine does not implement
(softcapping, sinks, non-causal attention), whatever the architecture is called.
"""

from __future__ import annotations

import threading
import traceback
import weakref
from pathlib import Path
from typing import Any

import torch

from driftlab.attention.config import AttentionConfig
from driftlab.attention.engine import ATTENTION_NAME, register
from driftlab.attention.state import AttentionState
from driftlab.errors import DriftlabError

_HOLDERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # base model -> who holds it
_LOCK = threading.Lock()


def base_model(model: Any) -> Any:
    """The transformers model under `model`: a PEFT wrapper's base model, else `model` itself.

    Config, generation config and the attention switch live there; forward and generate go
    through the wrapper (its adapters)."""
    get = getattr(model, "get_base_model", None)
    return get() if callable(get) and _is_peft(model) else model


def _is_peft(model: Any) -> bool:
    return any(c.__module__.startswith("peft.") and c.__name__ == "PeftModel" for c in type(model).__mro__)


def adapters(model: Any) -> dict[str, Any] | None:
    """Which PEFT adapters `model` carries and whether they act (None: no adapters): what a
    manifest records of a model that did not come from a name."""
    holder = model if getattr(model, "peft_config", None) else base_model(model)
    config = getattr(holder, "peft_config", None)
    if not config:
        return None
    active = getattr(holder, "active_adapters", None)
    try:
        active = active() if callable(active) else active
    except Exception:  # noqa: BLE001 - transformers' method raises when no adapter is loaded
        active = None
    # Adapter layers (peft's BaseTunerLayer) say whether they are switched off (`disable_adapter()`).
    tuner_layers = [m for m in holder.modules() if type(m).__module__.startswith("peft.tuners")
                    and isinstance(getattr(type(m), "disable_adapters", None), property)]
    enabled = not all(bool(m.disable_adapters) for m in tuner_layers) if tuner_layers else True
    return {
        "adapters": sorted(config),
        "active": sorted(active) if isinstance(active, list | tuple) else ([active] if active else []),
        "types": {name: str(getattr(c, "peft_type", "") or "").replace("PeftType.", "") for name, c in config.items()},
        "enabled": enabled,
    }


def describe_name(model: Any, name: str | None) -> str:
    """What to call a model in messages and manifests: `name`, else its `name_or_path`, else its class."""
    base = base_model(model)
    return name or getattr(base, "name_or_path", "") or type(base).__name__


class Attachment:
    """driftlab's attention installed on one borrowed model, until `restore()`.

    `holder` says who borrows it (shown when a second borrower is refused). Raises a
    DriftlabError naming the model when driftlab cannot steer it, and then leaves it as it was.
    """

    def __init__(self, model: Any, holder: str, name: str | None = None) -> None:
        self.model = model
        self.base = base_model(model)
        self.name = describe_name(model, name)
        self.previous: dict[str, Any] | None = None
        self._held = False
        _check_kind(self.model, self.base, self.name)
        _claim(self.base, holder, self.name)
        self._held = True
        try:
            self.previous = _implementations(self.base)
            _install(self.base, self.name)
            _probe(self.model, self.base, self.name)
        except BaseException:
            self.restore()
            raise

    def placement(self) -> dict[str, Any]:
        """Where the held model lives, as a backend built by name records it: its local directory
        (`path`, None unless `name_or_path` is one), `device_map` ("hf_device_map" where accelerate
        placed it) and `quantize` (its quantisation method, None if none)."""
        base = self.base
        quant = getattr(base.config, "quantization_config", None)
        method = quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", None)
        where = getattr(base, "name_or_path", "") or ""
        return {"path": Path(where) if where and Path(where).is_dir() else None,
                "device_map": "hf_device_map" if getattr(base, "hf_device_map", None) else None,
                "quantize": str(method) if method else None}

    def restore(self) -> None:
        """Give the model back: its own attention implementation, and no holder. Idempotent."""
        if self.previous is not None:
            previous, self.previous = self.previous, None
            if _implementations(self.base) != previous:
                self.base.set_attn_implementation(previous if len(previous) > 1 else previous[""])
        if self._held:  # (only once: by then the model may have another holder)
            self._held = False
            with _LOCK:
                _HOLDERS.pop(self.base, None)


def _check_kind(model: Any, base: Any, name: str) -> None:
    """Refuse what is not a decoder-only transformers language model, before touching it."""
    from transformers import PreTrainedModel

    if not isinstance(base, PreTrainedModel):
        raise DriftlabError(f"{_what(name, base)} is not a transformers PreTrainedModel, so driftlab "
                            "cannot install its attention in it.",
                            hint="Pass a model loaded with transformers (e.g. AutoModelForCausalLM.from_pretrained).")
    config = base.config
    if getattr(config, "is_encoder_decoder", False) or not base.can_generate():
        raise DriftlabError(f"{_what(name, base)} is not a decoder-only causal language model; "
                            "driftlab steers and traces decoder-only chat models.",
                            hint="Load it with AutoModelForCausalLM (a model with a language-modelling head).")
    if _is_peft(model):
        peft_config = getattr(model, "active_peft_config", None)
        if getattr(peft_config, "is_prompt_learning", False):
            raise DriftlabError(f"{name} carries a prompt-learning adapter ({peft_config.peft_type}), whose virtual "
                                "tokens driftlab's token layout does not see.",
                                hint="Merge or use a weight adapter (LoRA and the like), or run the model without it.")


def _claim(base: Any, holder: str, name: str) -> None:
    with _LOCK:
        other = _HOLDERS.get(base)
        if other is not None:
            raise DriftlabError(f"{name} is already held by {other}; one model takes one driftlab borrower at a time "
                                "(the first to finish would restore the model's own attention under the other).",
                                hint="Leave that block or close() that backend first, or steer through it.")
        _HOLDERS[base] = holder


def _implementations(base: Any) -> dict[str, Any]:
    """The attention implementation of the model ("") and of each sub-config, as
    `set_attn_implementation` takes them back."""
    config = base.config
    out = {"": config._attn_implementation}
    for key in getattr(config, "sub_configs", {}) or {}:
        sub = getattr(config, key, None)
        if sub is not None and hasattr(sub, "_attn_implementation"):
            out[key] = sub._attn_implementation
    return out


def _install(base: Any, name: str) -> None:
    register()
    if not type(base)._can_set_attn_implementation():
        # transformers would only warn, and the model would run unsteered.
        raise DriftlabError(f"{_what(name, base)} computes attention itself instead of through "
                            "transformers' AttentionInterface, so driftlab's attention cannot be installed in it.",
                            hint="Use a Llama/Qwen2/Mistral/Gemma-style model (any architecture on the interface).")
    try:
        base.set_attn_implementation(ATTENTION_NAME)
    except (ValueError, ImportError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise DriftlabError(f"{_what(name, base)} refused driftlab's attention: {first}") from err
    if base.config._attn_implementation != ATTENTION_NAME:
        raise DriftlabError(f"{_what(name, base)} kept its attention "
                            f"{base.config._attn_implementation!r} when asked for driftlab's.")


def _probe(model: Any, base: Any, name: str) -> None:
    """One two-token pass with pi traced on every layer: every layer must reach driftlab's attention."""
    from driftlab.chat.loading import input_device

    text = base.config.get_text_config()
    layers = text.num_hidden_layers
    heads = text.num_attention_heads
    device = input_device(model)
    state = AttentionState(AttentionConfig(trace=True), [{"system": [(0, 1)]}], layers, heads, device)
    state.on_layout([0], 2, 2)
    ids = torch.zeros((1, 2), dtype=torch.long, device=device)  # token 0: in every vocabulary
    what = _what(name, base)
    try:
        with torch.inference_mode():
            model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False, **state.forward_kwargs(2))
    except DriftlabError as err:
        raise DriftlabError(f"{what} cannot be steered by driftlab: {err.message}", hint=_UNSUPPORTED) from err
    except IndexError as err:
        if "driftlab" in traceback.extract_tb(err.__traceback__)[-1].filename:  # a layer_idx past the layer count
            raise DriftlabError(f"{what} has attention layers that its config's {layers} layers do not number.",
                                hint=_UNSUPPORTED) from err
        raise _refused(what, err) from err
    except Exception as err:  # noqa: BLE001 - its forward refused the state, or broke on it
        raise _refused(what, err) from err
    silent = [i for i, rec in enumerate(state.records) if not rec]
    if silent:
        shown = ", ".join(map(str, silent[:6])) + (", ..." if len(silent) > 6 else "")
        raise DriftlabError(f"{what}: layer(s) {shown} of {layers} never reached driftlab's attention (attention "
                            "outside transformers' AttentionInterface, or layers that are not attention).",
                            hint=_UNSUPPORTED)


_UNSUPPORTED = ("driftlab steers decoders whose attention is scaled dot-product attention through transformers' "
                "AttentionInterface (Llama, Qwen2, Mistral, Gemma 3, ...).")


def _what(name: str, base: Any) -> str:
    kind = type(base).__name__
    return name if name == kind else f"{name} ({kind})"


def _refused(what: str, err: Exception) -> DriftlabError:
    first = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return DriftlabError(f"{what} could not run with driftlab's attention state ({type(err).__name__}: {first}).",
                         hint="Its forward must pass keyword arguments on to attention, as transformers' decoders do.")
