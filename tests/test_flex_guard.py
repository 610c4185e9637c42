"""Flex is imported lazily and guarded: a torch that cannot run flex.py still loads and steers.

Why: flex.py needs torch.nn.attention.flex_attention with `AuxRequest` (flex_attention's
`return_aux`, torch >= 2.9; torch 2.5-2.8 have FlexAttention with only `return_lse`, older
ones none). Imported with the engine, it made every HF backend fail to import there. Each mode
runs in a process that has never imported driftlab (forked from one fresh interpreter that
imported only torch and transformers, once for both modes: seconds of a CPU), in which the real
import machinery runs but FlexAttention is made unusable for driftlab's own imports first
(transformers keys its imports off torch's version, so it keeps the real module):
torch.nn.attention.flex_attention comes without `AuxRequest` (torch 2.5-2.8), or does not
import at all (torch < 2.5). In it, driftlab's
HF backend loads a tiny random model and generates with split-softmax on the SDPA path, with
`auto` saying once why it is not on flex, and an explicit `flex` is a one-line DriftlabError.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from conftest import CommandServer
from driftlab.attention import engine
from driftlab.chat import ChatRequest, Sampling
from driftlab.chat.hf import HFChatBackend
from driftlab.steering import Interventions
from tiny_models import make_tiny_model

CONVERSATION = [
    {"role": "system", "content": "You are a pirate. Always answer like a pirate, arr, and never stop."},
    {"role": "user", "content": "Hello! Could you tell me how to bake a loaf of bread at home?"},
]
STEER = ["trace", "split-softmax:k=0.3"]
NEW_TOKENS = 8

# Runs in a child: argv = mode (no-aux | no-flex), model directory, conversation, new tokens, steering.
CHILD = r"""
import builtins, json, sys

mode, model_dir = sys.argv[1:3]
assert not [m for m in sys.modules if m.split(".")[0] == "driftlab"], "driftlab was imported before the guard"
import types

import torch
import torch.nn.attention.flex_attention as real_flex

FLEX = real_flex.__name__


class WithoutAuxRequest(types.ModuleType):  # torch 2.5-2.8's flex_attention module
    def __getattr__(self, attr):
        if attr == "AuxRequest":
            raise AttributeError(attr)
        return getattr(real_flex, attr)


real_import = builtins.__import__


def guarded(name, globals=None, locals=None, fromlist=(), level=0):
    # What driftlab's own imports of torch's flex_attention meet (transformers keys its own
    # imports off torch's version, so it keeps the real module).
    if name == FLEX and (globals or {}).get("__name__", "").startswith("driftlab"):
        if mode == "no-flex":  # torch < 2.5
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return WithoutAuxRequest(name)
    return real_import(name, globals, locals, fromlist, level)


builtins.__import__ = guarded

import os
from driftlab.attention import engine
from driftlab.chat import ChatRequest, Sampling
from driftlab.chat.hf import HFChatBackend
from driftlab.errors import DriftlabError
from driftlab.steering import Interventions

torch.set_num_threads(1)
backend = HFChatBackend(model_dir, dtype="float32", device="cpu", prefix_cache_bytes=0)
conv, steer = json.loads(sys.argv[3]), Interventions.parse(json.loads(sys.argv[5]))
sampling = Sampling(greedy=True, max_new_tokens=int(sys.argv[4]), ignore_eos=True)
out = {}

# auto: flex on CUDA only, so let the CPU follow the CUDA rule to reach the fallback here.
os.environ["DRIFTLAB_ATTENTION_KERNEL"] = "auto"
engine._AUTO_FLEX_DEVICES = ("cuda", "cpu")
(plain,) = backend.generate(ChatRequest([conv], sampling))
steered = [backend.generate(ChatRequest([conv], sampling, interventions=steer))[0] for _ in range(2)]
out["auto"] = {"plain": plain.token_ids, "steered": [r.token_ids for r in steered],
               "traced": all(r.trace is not None for r in steered),
               "cuda_kernel": engine.kernel_for(torch.device("cuda"))}
print("END OF AUTO", file=sys.stderr, flush=True)

# flex asked for explicitly.
os.environ["DRIFTLAB_ATTENTION_KERNEL"] = "flex"
(plain,) = backend.generate(ChatRequest([conv], sampling))
out["flex"] = {"plain": plain.token_ids}
try:
    backend.generate(ChatRequest([conv], sampling, interventions=steer))
except DriftlabError as err:
    out["flex"]["error"] = {"message": err.message, "hint": err.hint}
out["flex_imported"] = "driftlab.attention.flex" in sys.modules
print("RESULT " + json.dumps(out))
"""


# What the children share, imported once in their server: never driftlab (torch, transformers and the
# tiny Qwen2's modules).
SHARED = ["torch", "torch.nn.attention.flex_attention", "transformers", "transformers.masking_utils",
          "transformers.models.qwen2.modeling_qwen2"]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model("qwen2", tmp_path_factory.mktemp("flex_guard") / "qwen2")


@pytest.fixture(scope="module")
def sdpa_steered(tiny_dir: Path) -> list[int]:
    """The same steered reply from this process's (complete) torch, on the SDPA kernel."""
    import torch

    old_env, threads = os.environ.get(engine.KERNEL_ENV), torch.get_num_threads()
    os.environ[engine.KERNEL_ENV] = "sdpa"
    torch.set_num_threads(1)
    try:
        backend = HFChatBackend(str(tiny_dir), dtype="float32", device="cpu", prefix_cache_bytes=0)
        sampling = Sampling(greedy=True, max_new_tokens=NEW_TOKENS, ignore_eos=True)
        (reply,) = backend.generate(ChatRequest([CONVERSATION], sampling, interventions=Interventions.parse(STEER)))
    finally:
        torch.set_num_threads(threads)
        if old_env is None:
            os.environ.pop(engine.KERNEL_ENV, None)
        else:
            os.environ[engine.KERNEL_ENV] = old_env
    return reply.token_ids


MISSING = {"no-aux": "FlexAttention without AuxRequest", "no-flex": "has no FlexAttention"}


@pytest.fixture(scope="module")
def children(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, str]]:
    """Each mode's child run, forked from one server that imported SHARED (tests/conftest.py's
    CommandServer, without driftlab): mode -> (stdout, stderr)."""
    folder = tmp_path_factory.mktemp("flex_guard_children")
    script = folder / "child.py"
    script.write_text(CHILD, encoding="utf-8")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "COLUMNS": "400"}  # one note = one stderr line
    env.pop(engine.KERNEL_ENV, None)
    server = CommandServer(folder, SHARED, env, driftlab=False)
    try:
        runs = {mode: server.run([mode, str(tiny_dir), json.dumps(CONVERSATION), str(NEW_TOKENS), json.dumps(STEER)],
                                 script=script) for mode in MISSING}
    finally:
        server.close()
    assert {mode: run.returncode for mode, run in runs.items()} == dict.fromkeys(MISSING, 0), \
        {mode: run.stderr[-4000:] for mode, run in runs.items()}
    return {mode: (run.stdout, run.stderr) for mode, run in runs.items()}


@pytest.fixture(scope="module", params=list(MISSING))
def child(request: pytest.FixtureRequest, children: dict[str, tuple[str, str]]) -> tuple[str, dict, str, str]:
    """(mode, result, stderr of the auto part, stderr of the flex part) of one child run."""
    mode = request.param
    stdout, stderr = children[mode]
    line = next(ln for ln in stdout.splitlines() if ln.startswith("RESULT "))
    auto_err, _, flex_err = stderr.partition("END OF AUTO")
    return mode, json.loads(line[len("RESULT "):]), auto_err, flex_err


@pytest.mark.process
def test_auto_falls_back_to_sdpa_once_and_steers(child, sdpa_steered: list[int]) -> None:
    mode, out, stderr, _ = child
    auto = out["auto"]
    assert out["flex_imported"] is False
    # Two steered generations (every layer, prefill and decode): the SDPA path's tokens each time.
    assert auto["steered"] == [sdpa_steered, sdpa_steered] and auto["traced"]
    assert auto["plain"] != sdpa_steered  # the steering did something
    assert auto["cuda_kernel"] == "sdpa"
    notes = [ln for ln in stderr.splitlines() if "run on the SDPA path, not FlexAttention" in ln]
    assert len(notes) == 1, stderr
    assert notes[0].startswith("note: ") and MISSING[mode] in notes[0] and "torch >= 2.9" in notes[0]


@pytest.mark.process
def test_explicit_flex_is_a_one_line_error(child) -> None:
    mode, out, _, stderr = child
    flex = out["flex"]
    assert flex["plain"] == out["auto"]["plain"]  # without interventions nothing needs flex
    err = flex["error"]
    assert "\n" not in err["message"] and "\n" not in err["hint"]
    assert err["message"].startswith("DRIFTLAB_ATTENTION_KERNEL=flex asks for FlexAttention, but torch ")
    assert MISSING[mode] in err["message"]
    assert "torch 2.9 or later" in err["hint"] and "sdpa" in err["hint"]
    assert "note:" not in stderr  # said once, in the auto part


def test_flex_missing_reasons() -> None:
    """The reason names what is missing for each way the import fails."""
    no_module = ModuleNotFoundError("No module named 'torch.nn.attention.flex_attention'",
                                    name="torch.nn.attention.flex_attention")
    no_aux = ImportError("cannot import name 'AuxRequest' from 'torch.nn.attention.flex_attention'")
    assert "has no FlexAttention" in engine._why_no_flex(no_module)
    assert "FlexAttention without AuxRequest" in engine._why_no_flex(no_aux)
    assert "ImportError: boom" in engine._why_no_flex(ImportError("boom"))
