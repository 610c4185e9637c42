"""User turns to replay, from data: real conversations in OpenAI's chat format.

Why one format: a user's own logs (`--conversations FILE`, one conversation per JSONL line as
`{"messages": [{"role": ..., "content": ...}, ...]}`, OpenAI's chat fine-tuning format) and the data
sets driftlab provisions (`driftlab data pull sharegpt | mtbench`, cleaned into the same format) go
through one reader. Only the user turns are kept: a replay never shows the model the file's
assistant turns (it writes its own) nor its system messages (the agent's system prompt is the run's).

Four sources of a dialog's user turns (`draw_dialogs`):

    sharegpt-chain   standalone turns chained (default): the first user turns of distinct ShareGPT
                     conversations, one per round. A first turn refers to no earlier answer, so a
                     dialog of any length never asks about an answer the model did not give (about
                     a third of real later turns refer back; Persistent Personas chains PRISM turns
                     for the same reason).
    sharegpt         whole ShareGPT dialogs, their user turns in order.
    mtbench          MT-Bench's 80 two-turn questions.
    file             the conversations of a JSONL file, in file order.
"""

from __future__ import annotations

import functools
import json
import random
from pathlib import Path
from typing import Any, Literal

from driftlab.errors import DriftlabError

Source = Literal["sharegpt-chain", "sharegpt", "mtbench", "file"]
SOURCES: tuple[str, ...] = ("sharegpt-chain", "sharegpt", "mtbench", "file")
ROLES = ("system", "user", "assistant", "tool")


def read_conversations(path: str | Path) -> list[dict[str, Any]]:
    """The conversations of a JSONL file ({"id": line's id or "line-N", "turns": its user turns}),
    every line checked before any is used: a bad line is a one-line error naming its number."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").split("\n")  # not splitlines: JSON text may hold U+2028
    except (OSError, UnicodeDecodeError) as err:
        raise DriftlabError(f"--conversations {path}: cannot read it ({getattr(err, 'strerror', None) or err}).",
                            hint="Give a UTF-8 JSONL file, one conversation per line.") from None
    out = [_conversation(path, n, line) for n, line in enumerate(lines, 1) if line.strip()]
    if not out:
        raise DriftlabError(f"--conversations {path} holds no conversation.",
                            hint='One per line: {"messages": [{"role": "user", "content": "..."}, ...]}')
    return out


def _conversation(path: Path, n: int, line: str) -> dict[str, Any]:
    where = f"--conversations {path}, line {n}"
    try:
        row = json.loads(line)
    except json.JSONDecodeError as err:
        raise DriftlabError(f"{where}: not JSON ({err.msg}, column {err.colno}).",
                            hint='One conversation per line: {"messages": [{"role": "user", "content": "..."}]}') from None
    messages = row.get("messages") if isinstance(row, dict) else None
    if not isinstance(messages, list):
        raise DriftlabError(f'{where}: no "messages" list.',
                            hint="OpenAI's chat format: {\"messages\": [{\"role\": ..., \"content\": ...}, ...]}")
    for k, m in enumerate(messages, 1):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise DriftlabError(f"{where}: message {k} has no role of {', '.join(ROLES)}.",
                                hint='Each message is {"role": "user", "content": "..."}.')
        if m["role"] == "user" and not (isinstance(m.get("content"), str) and m["content"].strip()):
            raise DriftlabError(f"{where}: user message {k} has no text content.",
                                hint="A user turn's content is a non-empty string (parts and images are not replayed).")
    turns = [m["content"] for m in messages if m["role"] == "user"]
    if not turns:
        raise DriftlabError(f"{where}: no user message.", hint="A conversation to replay needs a user turn.")
    return {"id": str(row.get("id", f"line-{n}")), "turns": turns}


def _dataset(name: str) -> list[dict[str, Any]]:
    """A pulled data set's conversations, as `read_conversations` gives them (same format, no checks
    needed: its file's sha256 was verified when pulled). Read once per process and file: a run draws
    its plan more than once (the checks before any work, the context check, the plan)."""
    from driftlab.assets.datasets import dataset_file

    return _read_dataset(str(dataset_file(name)))


@functools.lru_cache(maxsize=4)
def _read_dataset(path: str) -> list[dict[str, Any]]:
    out = []
    for line in Path(path).read_text(encoding="utf-8").split("\n"):  # U+2028 sits inside turns
        if not line:
            continue
        row = json.loads(line)
        messages = row["messages"]
        turns = [m["content"] for m in messages if m["role"] == "user"]
        if turns:
            out.append({"id": row["id"], "turns": turns, "opens": messages[0]["role"] == "user"})
    return out


def _short(text: str, max_words: int) -> bool:
    return bool(text.strip()) and len(text.split()) <= max_words and text.isascii()


def standalone_turns(conversations: list[dict[str, Any]], max_words: int) -> list[str]:
    """The chain's pool: first user turns of conversations that open with one (a later split of a
    long conversation opens with an answer), at most `max_words` words of plain ASCII (small models'
    context; mostly English), each once, in data order."""
    pool = [c["turns"][0] for c in conversations if c.get("opens", True) and _short(c["turns"][0], max_words)]
    return list(dict.fromkeys(pool))


def draw_dialogs(source: str, n: int, rounds: int, seed: int, path: str | Path | None = None,
                 max_words: int = 60) -> list[dict[str, Any]]:
    """`n` dialogs' user turns ({"id", "turns"}, at most `rounds` turns each), drawn with `seed`."""
    rng = random.Random(seed)
    if source == "file":
        if path is None:
            raise DriftlabError("--source file needs --conversations FILE.", hint="Or leave --source out.")
        found = read_conversations(path)
        return [{"id": c["id"], "turns": c["turns"][:rounds]} for c in found[:n]]
    if source == "sharegpt-chain":
        pool = standalone_turns(_dataset("sharegpt"), max_words)
        if len(pool) < rounds:
            raise DriftlabError(f"{len(pool)} standalone ShareGPT turns of at most {max_words} words, fewer than "
                                f"--rounds {rounds}.", hint="Allow longer turns (--max-words) or fewer rounds.")
        return [{"id": f"chain-{k}", "turns": rng.sample(pool, rounds)} for k in range(n)]
    if source == "sharegpt":
        whole = [c for c in _dataset("sharegpt") if c["opens"] and len(c["turns"]) >= rounds
                 and all(_short(t, max_words) for t in c["turns"][:rounds])]
    elif source == "mtbench":
        whole = _dataset("mtbench")
    else:
        raise DriftlabError(f"unknown --source {source!r}.", hint=f"Use one of {', '.join(SOURCES)}.")
    if len(whole) < n:
        raise DriftlabError(f"--source {source} has {len(whole)} conversations that fit (at least --rounds {rounds} "
                            f"user turns of at most {max_words} words), fewer than the {n} dialogs asked for.",
                            hint="Ask for fewer dialogs or rounds, or allow longer turns (--max-words).")
    return [{"id": c["id"], "turns": c["turns"][:rounds]} for c in rng.sample(whole, n)]
