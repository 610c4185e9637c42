"""User emphasis: `*marked*` spans in messages, and where they land among the prompt's tokens.

PASTA (Zhang et al., ICLR 2024) steers attention towards text the user underlined. A user marks spans in
system and user messages with a marker (default `*...*`; several spans per message; `\\*` is a literal
`*`), or passes explicit character spans on a message (`{"role": ..., "content": ...,
"emphasis": [[start, end], ...]}`, offsets into that content, taken as given). The markers
are removed before the model sees the text: what PASTA emphasises is the plain text, and
the emphasis reaches the model only through attention. (Leaving the markers in is the
paper's "marked prompting" baseline, a different thing.)

Character spans become token positions through the rendered chat template: each message's
content is located in the rendered text in order, and a token is emphasised when its
characters overlap an emphasised character range (so a span that starts or ends inside a
token takes the whole token).
"""

from __future__ import annotations

from collections.abc import Sequence

from driftlab.errors import DriftlabError

CharSpan = tuple[int, int]
DEFAULT_MARKER = "*"
ESCAPE = "\\"


def parse_marked(text: str, marker: str = DEFAULT_MARKER) -> tuple[str, list[CharSpan]]:
    """Remove emphasis markers from `text`: (plain text, [start, end) spans in it).

    `marker` opens and closes a span. A backslash right before a marker makes it literal
    (`\\*` gives `*`); any other backslash is kept. An unclosed or empty span is an error,
    since guessing would silently emphasise the wrong text.
    """
    if not marker or marker[0] == ESCAPE or any(c.isspace() for c in marker):
        raise DriftlabError(
            f"Emphasis marker {marker!r} is not usable.",
            hint="Use a non-empty marker without spaces that does not start with a backslash, e.g. '*' or '=='.",
        )
    out: list[str] = []
    spans: list[CharSpan] = []
    n = 0  # length of the plain text so far
    open_at: int | None = None
    opened_char = 0
    i = 0
    while i < len(text):
        if text.startswith(ESCAPE + marker, i):
            out.append(marker)
            n += len(marker)
            i += len(ESCAPE) + len(marker)
        elif text.startswith(marker, i):
            if open_at is None:
                open_at, opened_char = n, i
            else:
                if n == open_at:
                    raise DriftlabError(
                        f"Empty emphasis {marker}{marker} at character {opened_char} of {_clip(text)!r}.",
                        hint=f"Put text between the markers, or write a literal marker as {ESCAPE}{marker}.",
                    )
                spans.append((open_at, n))
                open_at = None
            i += len(marker)
        else:
            out.append(text[i])
            n += 1
            i += 1
    if open_at is not None:
        raise DriftlabError(
            f"Emphasis opened with {marker!r} at character {opened_char} of {_clip(text)!r} is never closed.",
            hint=f"Close it with another {marker!r}, or write a literal marker as {ESCAPE}{marker}.",
        )
    return "".join(out), spans


def strip_emphasis(
    conversation: Sequence[dict], marker: str = DEFAULT_MARKER
) -> tuple[list[dict], list[list[CharSpan]]]:
    """A conversation without markers, and each message's emphasised character spans.

    A message that carries explicit `emphasis` spans is taken literally (no marker parsing);
    its spans are checked against its content. Assistant messages are taken literally too:
    a model's own markdown (`**bold**`) is not the user's emphasis.
    """
    clean: list[dict] = []
    spans: list[list[CharSpan]] = []
    for j, msg in enumerate(conversation):
        content = msg["content"]
        if "emphasis" in msg:
            own = _explicit_spans(msg["emphasis"], content, j)
        elif msg["role"] == "assistant":
            own = []
        else:
            content, own = parse_marked(content, marker)
        clean.append({"role": msg["role"], "content": content})
        spans.append(own)
    return clean, spans


def token_spans(
    text: str,
    contents: Sequence[str],
    char_spans: Sequence[Sequence[CharSpan]],
    offsets: Sequence[tuple[int, int]],
    shift: int = 0,
) -> list[tuple[int, int]]:
    """Token ranges [start, end) covering each emphasised character span of each message.

    `text` is the rendered prompt, `contents` the messages' contents in order, `offsets`
    the tokenizer's character offsets of `text`'s tokens, `shift` tokens prepended to them
    (a BOS the renderer adds). Messages are located in order, so repeated text in two
    messages maps to the right one.
    """
    out: list[tuple[int, int]] = []
    pos = 0
    for j, (content, spans) in enumerate(zip(contents, char_spans, strict=True)):
        at = text.find(content, pos) if content else pos
        if at < 0:
            raise DriftlabError(
                f"Message {j} does not appear verbatim in the rendered chat template, so its emphasis "
                "cannot be located.",
                hint="This template rewrites message text (e.g. strips it); emphasise text without leading or "
                "trailing whitespace.",
            )
        pos = at + len(content)
        for s, e in spans:
            lo, hi = at + s, at + e
            inside = [i for i, (a, b) in enumerate(offsets) if b > lo and a < hi]
            if inside:
                out.append((inside[0] + shift, inside[-1] + 1 + shift))
    return _merge(out)


def _explicit_spans(raw, content: str, index: int) -> list[CharSpan]:
    try:
        spans = [(int(s), int(e)) for s, e in raw]
    except (TypeError, ValueError):
        raise DriftlabError(
            f"Message {index}: emphasis must be a list of [start, end] character offsets, got {raw!r}.",
            hint='Write e.g. {"role": "user", "content": "...", "emphasis": [[0, 12]]}.',
        ) from None
    for s, e in spans:
        if not 0 <= s < e <= len(content):
            raise DriftlabError(
                f"Message {index}: emphasis span [{s}, {e}) is outside its {len(content)}-character content "
                "or empty.",
                hint="Offsets are 0-based character positions into the message content, end exclusive.",
            )
    return spans


def _merge(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted, with overlapping or touching ranges joined (the engine needs no duplicates)."""
    merged: list[tuple[int, int]] = []
    for s, e in sorted(spans):
        if merged and s <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], e))
        else:
            merged.append((s, e))
    return merged


def _clip(text: str, n: int = 60) -> str:
    return text if len(text) <= n else text[: n - 3] + "..."
