"""Torch's config modules (torch._dynamo.config, torch._inductor.config, ...) kept intact across tests.

A config module serves its entries through `__getattr__`, and deleting an entry *hides* it:
every later read raises AttributeError. `monkeypatch.setattr(config, name, value)` (pytest >= 9.2)
records the old value from the module's `__dict__`, finds none, and undoes by deleting, so one
test broke every compile after it in the same process. Tests change such a config through its
own API (`torch._dynamo.config.patch(name=value)`); conftest checks after every test that no
entry is hidden, repairs it, and fails the test that hid it.
"""

from __future__ import annotations

import sys


def config_modules() -> list:
    """Every torch config module imported so far (none if torch is not imported: nothing to check)."""
    mod = sys.modules.get("torch.utils._config_module")
    if mod is None:
        return []
    return [m for m in list(sys.modules.values()) if isinstance(m, mod.ConfigModule)]


def hidden_entries() -> list[tuple[object, str]]:
    """(module, entry name) for each hidden (deleted) entry of a torch config module."""
    return [(m, name) for m in config_modules() for name, entry in m._config.items() if entry.hide]


def unhide(entries: list[tuple[object, str]]) -> None:
    """Show the entries again at their defaults, so one faulty test does not fail every later one."""
    for module, name in entries:
        module._config[name].hide = False
