"""Tiny randomly initialised chat models of several families, for attention tests.

Why: the attention engine must be right for every decoder transformers hands it, not only
for Llama. Grouped-query attention, sliding-window layers (Gemma3 keeps fewer keys than the
absolute length) and non-default scaling (`query_pre_attn_scalar`) are the places where a
custom attention function goes wrong. Real checkpoints of those families are far too big
for CI, so we build tiny ones from configs and reuse the pulled SmolLM2 tokenizer and chat
template (vocab 49152), which makes `HFChatBackend.chat()` work on them unchanged.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
VOCAB = 49152  # SmolLM2's tokenizer
SPECIAL = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}  # SmolLM2's ids


def tokenizer_dir() -> Path:
    """The tokenizer source for tiny models: the pulled default model's directory, or, where none
    can be pulled (a lent GPU machine has no network), SmolLM2's tokenizer files in the directory
    GPUBENCH_TOKENIZER names, as benchmarks/gpu.py takes them (docs/performance.md)."""
    if carried := os.environ.get("GPUBENCH_TOKENIZER"):
        missing = [name for name in TOKENIZER_FILES if not (Path(carried) / name).is_file()]
        if missing:
            raise RuntimeError(f"GPUBENCH_TOKENIZER={carried!r} lacks {', '.join(missing)}: give the folder of "
                               "SmolLM2's tokenizer files (docs/performance.md).")
        return Path(carried)
    from driftlab.assets import resolve_model

    return Path(resolve_model("smollm2-135m", auto_pull_default=False))


def tiny_config(family: str, sliding_window: int = 8):
    """A small config of `family` with grouped-query attention: 'qwen2', 'llama' and 'gemma3'
    (4 q / 2 kv heads), or 'qwen2-gqa7' (14 q / 2 kv heads: a group of 7, Qwen2.5-7B's, which is
    not a power of two)."""
    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        **SPECIAL,
    )
    if family == "qwen2":
        from transformers import Qwen2Config

        return Qwen2Config(num_hidden_layers=3, **common)
    if family == "qwen2-gqa7":
        from transformers import Qwen2Config

        return Qwen2Config(num_hidden_layers=3, **{**common, "num_attention_heads": 14})
    if family == "llama":
        from transformers import LlamaConfig

        return LlamaConfig(num_hidden_layers=3, **common)
    if family == "gemma3":
        from transformers import Gemma3TextConfig

        # Layers 0-2 slide over `sliding_window` keys, layer 3 sees everything; a query
        # scalar that is not head_dim makes a wrong default scale visible.
        return Gemma3TextConfig(
            num_hidden_layers=4,
            layer_types=["sliding_attention"] * 3 + ["full_attention"],
            sliding_window=sliding_window,
            query_pre_attn_scalar=40,
            **common,
        )
    raise ValueError(f"unknown family {family!r}")


def make_tiny_model(family: str, directory: Path, seed: int = 0, sliding_window: int = 8) -> Path:
    """Save a randomly initialised `family` model plus SmolLM2's tokenizer into `directory`.

    The random init is scaled up a little (std 0.1 instead of 0.02) so attention is far
    from uniform and the interventions change the greedy tokens, which keeps the tests
    that compare generations able to fail.
    """
    from transformers import AutoModelForCausalLM

    config = tiny_config(family, sliding_window)
    config.initializer_range = 0.1
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    src = tokenizer_dir()
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy(src / name, directory / name)
    return directory
