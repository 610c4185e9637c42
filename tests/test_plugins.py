"""Other packages extend driftlab through entry points: a tiny plugin package, installed the way
pip leaves one (its module and a .dist-info with entry_points.txt on the path), gives a measure,
an intervention and a protocol, and each is used from the command line in a process of its own
(forked from a server that imported torch once and loaded no plugin: tests/conftest.py's
CommandServer), so each command finds the plugin through the entry points again."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import PROTOCOL_PRELOAD as PRELOAD
from conftest import CommandServer

PLUGIN = '''
"""driftlab-demo-plugin: one measure, one intervention, one protocol, from outside driftlab."""
import csv
import math
from pathlib import Path
from typing import ClassVar, Literal

from pydantic import BaseModel, Field, TypeAdapter

from driftlab.attention.config import BiasTerm
from driftlab.chat.base import ChatRequest, Sampling
from driftlab.protocol.runner import Protocol, ProtocolConfig
from driftlab.records.rundir import RunDir
from driftlab.steering.interventions import BaseIntervention, Hook


def shouty(text: str, min_share: float = 0.5) -> float:
    """Share of capital letters, reaching 1 at `min_share`."""
    letters = [c for c in text if c.isalpha()]
    share = sum(c.isupper() for c in letters) / len(letters) if letters else 0.0
    return min(1.0, share / min_share)


class SysBoost(BaseIntervention):
    """The system prompt's attention weights times `factor` (InstABoost under another name)."""

    kind: Literal["sysboost"] = "sysboost"
    factor: float = Field(gt=0)
    hook: ClassVar[Hook] = "attention"
    form: ClassVar[str] = "sysboost:factor=3"

    def attention_fields(self) -> dict:
        return {"biases": (BiasTerm(value=math.log(self.factor), span="system"),)}


class EchoConfig(ProtocolConfig):
    prompts: list[str] = Field(min_length=1)
    max_new_tokens: int = 6


class EchoRecord(BaseModel):
    index: int
    text: str

    @property
    def key(self):
        return ("echo", self.index)


class Echo(Protocol[EchoConfig]):
    """Greedy replies to a list of prompts; its report is a CSV of their lengths."""

    name = "echo-lengths"
    records = TypeAdapter(EchoRecord)

    @classmethod
    def expected(cls, manifest):
        return {"echo": len(manifest["config"]["prompts"])}

    def units(self, state):
        return [(i, p) for i, p in enumerate(self.config.prompts) if ("echo", i) not in state.done]

    def run_unit(self, unit):
        i, prompt = unit
        sampling = Sampling(max_new_tokens=self.config.max_new_tokens, greedy=True)
        reply = self.backend.generate(ChatRequest([[{"role": "user", "content": prompt}]], sampling))[0]
        return [EchoRecord(index=i, text=reply.text)]

    @classmethod
    def report(cls, run_dir):
        path = Path(run_dir) / "lengths.csv"
        with path.open("w", newline="") as fh:
            out = csv.writer(fh)
            out.writerow(["index", "characters"])
            for r in RunDir(run_dir).records():
                out.writerow([r["index"], len(r["text"])])
        return [path]
'''

ENTRY_POINTS = """\
[driftlab.measures]
shouty = driftlab_demo_plugin:shouty

[driftlab.interventions]
sysboost = driftlab_demo_plugin:SysBoost

[driftlab.protocols]
echo-lengths = driftlab_demo_plugin:Echo
"""


def install(site: Path, entry_points: str = ENTRY_POINTS, code: str = PLUGIN) -> Path:
    """The plugin as pip installs a wheel: the module and its .dist-info (METADATA, entry_points.txt)."""
    site.mkdir(parents=True, exist_ok=True)
    (site / "driftlab_demo_plugin.py").write_text(textwrap.dedent(code), encoding="utf-8")
    info = site / "driftlab_demo_plugin-0.1.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: driftlab-demo-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(entry_points)
    (info / "RECORD").write_text("")
    return site


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    return install(tmp_path_factory.mktemp("site"))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    from tiny_models import make_tiny_model

    return make_tiny_model("qwen2", tmp_path_factory.mktemp("tiny") / "qwen2")


def _env(site: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}


def driftlab(site: Path, *args: str) -> subprocess.CompletedProcess:
    """`python -m driftlab ARGS`, a new interpreter: for the commands that import no torch."""
    return subprocess.run([sys.executable, "-m", "driftlab", *args], capture_output=True, text=True, env=_env(site))


@pytest.fixture(scope="module")
def commands(site, tmp_path_factory):
    """The model-backed commands, forked from one server (each saves the ~5 s of imports a new
    interpreter pays). The site is on the server's sys.path (PYTHONPATH, read when it starts): the
    entry points are read in each command (driftlab.plugins.load, at its first plugin name), never in
    the server, whose imports name no plugin, so each command loads the plugin itself."""
    server = CommandServer(tmp_path_factory.mktemp("commands"), PRELOAD, _env(site))
    yield server
    server.close()


def _probes(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "records.jsonl").read_text().splitlines()]
    return [r for r in rows if r["kind"] == "probe"]


@pytest.mark.process  # fresh interpreters
def test_the_plugins_measure_is_listed(site):
    done = driftlab(site, "personas", "measures")
    assert done.returncode == 0, done.stderr
    assert "shouty (plugin)" in done.stdout and "min_share" in done.stdout
    listed = driftlab(site, "protocol", "list")
    assert "echo-lengths" in listed.stdout and "plugin (driftlab_demo_plugin)" in listed.stdout


@pytest.mark.model  # a whole protocol on a tiny model, in driftlab processes (forked)
def test_the_plugins_measure_and_intervention_run_a_selfchat(site, tiny, tmp_path, commands):
    """The plugin's bias is InstABoost's under another name: its run equals instaboost:m=3 token for
    token, differs from the plain run, and every probe is scored by the plugin's measure."""
    sys.path.insert(0, str(site))
    try:
        from driftlab_demo_plugin import shouty
    finally:
        sys.path.remove(str(site))
    common = ["run", "--model", str(tiny), "--dtype", "float32", "--device", "cpu", "--system", "ANSWER IN CAPITALS.",
              "--probe", "How are you?", "--measure", "shouty", "--measure-params", '{"min_share": 0.8}',
              "--pairs", "2", "--rounds", "2", "--max-new-tokens", "6", "--probe-tokens", "6", "--greedy", "--no-report"]
    texts = {}
    for name, steer in (("plugin", ["--steer", "sysboost:factor=3"]), ("builtin", ["--steer", "instaboost:m=3"]),
                        ("plain", [])):
        done = commands.run([*common, *steer, "--out", str(tmp_path / name)])
        assert done.returncode == 0, done.stderr
        texts[name] = [r["text"] for r in _probes(tmp_path / name)]
    assert texts["plugin"] == texts["builtin"] != texts["plain"]
    probes = _probes(tmp_path / "plugin")
    assert [r["score"] for r in probes] == [shouty(r["text"], min_share=0.8) for r in probes]
    manifest = json.loads((tmp_path / "plugin" / "manifest.json").read_text())
    assert manifest["config"]["steer"] == ["sysboost:factor=3.0"]
    # a resume in a new process finds the plugin again from the manifest's names
    again = commands.run([*common, "--steer", "sysboost:factor=3", "--out", str(tmp_path / "plugin")])
    assert again.returncode == 0, again.stderr


@pytest.mark.model  # a whole protocol on a tiny model, in driftlab processes (forked)
def test_the_plugins_protocol_runs_from_a_config_file_and_reports(tiny, tmp_path, commands):
    config = tmp_path / "echo.toml"
    config.write_text(f'prompts = ["Hi!", "Name a colour."]\nmax_new_tokens = 5\n'
                      f'[backend]\nmodel = "{tiny.as_posix()}"\ndtype = "float32"\ndevice = "cpu"\n')
    out = tmp_path / "echo"
    done = commands.run(["protocol", "run", "echo-lengths", "--config", str(config), "--out", str(out),
                         "--no-progress"])
    assert done.returncode == 0, done.stderr
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    assert [r["index"] for r in records] == [0, 1]
    report = commands.run(["report", str(out)])
    assert report.returncode == 0, report.stderr
    assert "echo-lengths run: 2 of 2 records, complete" in report.stdout
    rows = (out / "lengths.csv").read_text().splitlines()
    assert rows[1:] == [f"{r['index']},{len(r['text'])}" for r in records]
    results = json.loads((out / "results.json").read_text())  # the one contract, for a plugin's run too
    assert results["protocol"] == "echo-lengths" and results["complete"] is True
    assert [(e["metric"], e["n"]) for e in results["estimates"]] == [("records", 2)]
    bad = tmp_path / "bad.json"
    bad.write_text('{"prompts": []}')
    refused = commands.run(["protocol", "run", "echo-lengths", "--config", str(bad), "--out", str(tmp_path / "x")])
    assert refused.returncode == 2 and "prompts" in refused.stderr and "Traceback" not in refused.stderr


def test_a_broken_plugin_is_named_in_one_line(tmp_path):
    site = install(tmp_path / "site", entry_points="[driftlab.measures]\nbroken = driftlab_missing_module:f\n")
    done = driftlab(site, "personas", "measures")
    assert done.returncode == 2
    assert "plugin 'broken'" in done.stderr and "driftlab-demo-plugin" in done.stderr
    assert "Traceback" not in done.stderr
