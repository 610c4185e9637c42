"""The guard that keeps torch's config modules intact across tests (tests/config_guard.py, conftest)."""

from __future__ import annotations

import torch

import config_guard


def test_a_deleted_config_entry_is_found_and_shown_again() -> None:
    """What monkeypatch's undo did to torch._dynamo.config under pytest 9.2: the entry is hidden,
    every read raises; the guard finds it and shows it again at its default."""
    config = torch._dynamo.config
    before = config.recompile_limit  # maybe raised by driftlab earlier in this process
    try:
        delattr(config, "recompile_limit")
        try:
            config.recompile_limit  # noqa: B018
            raise AssertionError("a deleted config entry should be unreadable")
        except AttributeError:
            pass
        assert (config, "recompile_limit") in config_guard.hidden_entries()
        config_guard.unhide([(config, "recompile_limit")])
        # shown again at its default (the delete dropped any value set before)
        assert config.recompile_limit == config._config["recompile_limit"].default
        assert config_guard.hidden_entries() == []
    finally:
        config_guard.unhide([(config, "recompile_limit")])
        config.recompile_limit = before  # later tests in this process keep what they had


def test_torch_patch_api_restores_the_entry() -> None:
    """The way tests change a torch config: its own `patch`, which restores the value on exit."""
    config = torch._dynamo.config
    before = config.recompile_limit
    with config.patch(recompile_limit=before + 3):
        assert config.recompile_limit == before + 3
    assert config.recompile_limit == before and config_guard.hidden_entries() == []
    assert torch._dynamo.config in config_guard.config_modules()
