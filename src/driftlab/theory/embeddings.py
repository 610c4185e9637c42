"""Figure 7 (persona-drift paper, App. A): histogram of the norms of a model's input embeddings.

The simplified model of Sec. 5 puts every token on the unit sphere. The paper justifies this
by showing that LLaMA2-7B-chat's embedding rows have norms concentrated around 1. Whether a
given model has *concentrated* norms (small coefficient of variation) is the property that
matters: a common scale can be absorbed into W_ov, a wide spread cannot.

We read only the embedding tensor from the safetensors file(s), never the model: through
`safetensors.safe_open(framework="pt")` and its lazy `get_slice`, a block of rows at a time.
The torch framework because numpy has no bfloat16 (`framework="np"` refuses bf16 tensors);
each block is upcast to float64 before the norm. safetensors validates the header (and that
it covers the whole file) on open; its errors become DriftlabErrors naming the file.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from driftlab.errors import DriftlabError
from driftlab.theory.checks import Check, fmt

# Suffixes of input-embedding tensors in common Hugging Face architectures, most specific first.
EMBED_SUFFIXES = (
    "embed_tokens.weight",  # Llama, Mistral, Qwen2, Gemma, SmolLM, ...
    "wte.weight",  # GPT-2, GPT-J
    "word_embeddings.weight",  # BLOOM, Falcon, BERT
    "embed_in.weight",  # GPT-NeoX / Pythia
    "tok_embeddings.weight",  # original LLaMA checkpoints
    "embedding.weight",
)

_DTYPES = ("F32", "F64", "F16", "BF16")  # the float types we read (safetensors dtype names)


def resolve_model_dir(name_or_path: str) -> Path:
    """A local model directory (or a single .safetensors file) for --model.

    Preset names (e.g. "smollm2-135m") and model directories go through
    driftlab.assets.resolve_model, which validates directories and pulls the default preset
    if needed; a bare .safetensors file is accepted as is, since Figure 7 needs nothing else.
    """
    path = Path(name_or_path).expanduser()
    if path.is_file() and path.suffix == ".safetensors":
        return path
    from driftlab.assets import resolve_model

    return Path(resolve_model(name_or_path))


def _safetensors_files(path: Path) -> list[Path]:
    if not path.exists():
        raise DriftlabError(f"{path} does not exist.", hint="Check the --model path.")
    if path.is_file():
        return [path]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise DriftlabError(
            f"No *.safetensors file in {path}.",
            hint="Figure 7 reads the embedding matrix from safetensors; convert the model first "
            "(e.g. with save_pretrained) or pass another directory.",
        )
    return files


@contextmanager
def _open(file: Path):
    """safe_open(file) whose failures (missing, truncated, not safetensors) are DriftlabErrors."""
    from safetensors import SafetensorError, safe_open

    try:
        handle = safe_open(str(file), framework="pt")
    except FileNotFoundError as exc:
        raise DriftlabError(f"{file} does not exist.", hint="Check the --model path.") from exc
    except (SafetensorError, OSError) as exc:
        raise DriftlabError(
            f"{file} is not a readable safetensors file ({exc}).",
            hint="The file may be truncated (an interrupted download) or in another format; "
            "download or convert it again.",
        ) from exc
    with handle as st:
        yield st


def find_embedding(path: Path) -> tuple[Path, str]:
    """(file, key) of the input-embedding matrix: by suffix, in shard order."""
    keys: dict[str, Path] = {}
    for f in _safetensors_files(path):
        with _open(f) as st:
            for k in st.keys():
                keys[k] = f
    for suffix in EMBED_SUFFIXES:
        hits = sorted(k for k in keys if k.endswith(suffix))
        if hits:
            key = min(hits, key=len)  # e.g. prefer model.embed_tokens over vision towers' copies
            return keys[key], key
    sample = ", ".join(sorted(keys)[:8])
    raise DriftlabError(
        f"No input-embedding tensor found in {path} (looked for *{'/*'.join(EMBED_SUFFIXES)}).",
        hint=f"Keys start with: {sample}",
    )


def _tensor_slice(st: Any, file: Path, key: str) -> tuple[Any, str, list[int]]:
    """The lazy slice of `key` in an open file, its dtype name and shape (DriftlabError if absent)."""
    if key not in st.keys():
        sample = ", ".join(sorted(st.keys())[:8])
        raise DriftlabError(f"No tensor {key!r} in {file.name}.", hint=f"Keys start with: {sample}")
    sl = st.get_slice(key)
    dtype = sl.get_dtype()
    if dtype not in _DTYPES:
        raise DriftlabError(
            f"Unsupported embedding dtype {dtype} in {file.name}.",
            hint="Use a float32/float16/bfloat16 checkpoint.",
        )
    return sl, dtype, list(sl.get_shape())


def embedding_norms(path: Path, chunk: int = 8192, key: str | None = None) -> tuple[np.ndarray, str, str]:
    """L2 norms of all embedding rows (float64), the tensor key and its dtype.

    `key` names the tensor (in a single file, or the first shard holding it); by default
    it is found by suffix (`find_embedding`).
    """
    if key is None:
        file, key = find_embedding(path)
    else:
        files = _safetensors_files(path)
        file = next((f for f in files if _has_key(f, key)), files[0])  # absent: error names files[0]
    with _open(file) as st:
        sl, dtype, shape = _tensor_slice(st, file, key)
        if len(shape) != 2:
            raise DriftlabError(f"Embedding tensor {key} has shape {tuple(shape)}, expected 2-D.")
        norms = np.empty(shape[0])
        for start in range(0, shape[0], chunk):
            block = sl[start : start + chunk].double().numpy()  # bf16/f16/f32 -> f64 exactly
            norms[start : start + chunk] = np.linalg.norm(block, axis=1)
    return norms, key, dtype


def _has_key(file: Path, key: str) -> bool:
    with _open(file) as st:
        return key in st.keys()


@dataclass
class EmbeddingResult:
    model: str
    key: str
    dtype: str
    norms: np.ndarray

    @property
    def stats(self) -> dict[str, float]:
        n = self.norms
        med = float(np.median(n))
        return {
            "rows": float(len(n)),
            "mean": float(n.mean()),
            "std": float(n.std()),
            "cv": float(n.std() / n.mean()),
            "median": med,
            "p01": float(np.quantile(n, 0.01)),
            "p99": float(np.quantile(n, 0.99)),
            "within_20pct_of_median": float(np.mean(np.abs(n / med - 1) <= 0.2)),
        }


def run(model: str) -> EmbeddingResult:
    path = resolve_model_dir(model)
    norms, key, dtype = embedding_norms(path)
    return EmbeddingResult(model=model, key=key, dtype=dtype, norms=norms)


def checks(res: EmbeddingResult) -> list[Check]:
    s = res.stats
    return [
        Check(
            "fig7.norms",
            f"Fig 7: embedding norms of {Path(res.model).name or res.model} are concentrated",
            f"mean {fmt(s['mean'], 3)} ± {fmt(s['std'], 3)} (CV {fmt(s['cv'], 2)}); "
            f"{100 * s['within_20pct_of_median']:.0f}% within ±20% of median",
            "paper (LLaMA2-7B-chat): concentrated around 1",
            "info",
            f"{int(s['rows'])} rows of {res.key} ({res.dtype}); 1-99% range [{fmt(s['p01'], 3)}, {fmt(s['p99'], 3)}]",
            s,
        )
    ]
