"""Nothing in the benchmark touches the network: import and score every persona with sockets blocked."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SCRIPT = textwrap.dedent(
    """
    import socket, sys

    def refuse(*args, **kwargs):
        raise RuntimeError("network access attempted")

    socket.socket.connect = refuse
    socket.socket.connect_ex = refuse
    socket.create_connection = refuse
    socket.getaddrinfo = refuse

    sys.path.insert(0, sys.argv[1])
    from bench_cases import CASES
    from driftlab.bench import load_personas

    assert not any(m in sys.modules for m in ("langdetect", "textblob", "wordfreq", "vaderSentiment", "pronouncing"))
    for p in load_personas():
        for text in CASES[p.id].compliant + CASES[p.id].violating:
            p.score(text)
    for m in ("langdetect", "textblob", "wordfreq", "vaderSentiment", "pronouncing"):
        assert m in sys.modules, m
    print("scored offline")
    """
)


@pytest.mark.process
def test_import_and_scoring_need_no_network() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(Path(__file__).parent)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "scored offline" in proc.stdout
