"""Loading a local model: device and dtype choice, offline load from a preset or directory.

Kept apart from the decode loop (hf.py) because it is about the environment (what the
machine has, what is on disk), not about generation.
"""

from __future__ import annotations

import gc
import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from driftlab.errors import DriftlabError

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _mps_available() -> bool:
    mps = getattr(torch.backends, "mps", None)
    return bool(mps is not None and mps.is_available())


def supported_devices() -> str:
    """The --device values this machine accepts, for hints."""
    return "auto, cpu, cuda, cuda:N or mps" if _mps_available() else "auto, cpu, cuda or cuda:N"


def pick_device(device: str) -> torch.device:
    """Resolve --device: auto, cpu, cuda, cuda:N (and mps where torch has it).

    Names torch accepts but a model cannot run on here (meta, xla, an absent mps, a GPU
    index past the last one) are refused up front with the list of usable values.
    """
    name = device.strip().lower()
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cpu":
        return torch.device("cpu")
    if re.fullmatch(r"cuda(:\d+)?", name):
        if not torch.cuda.is_available():
            raise DriftlabError(
                f"Device '{device}' was asked for but this torch build sees no CUDA GPU.",
                hint="Use --device cpu, or install a CUDA build of torch (see README).",
            )
        index = int(name.partition(":")[2] or 0)
        count = torch.cuda.device_count()
        if index >= count:
            raise DriftlabError(
                f"Device '{device}' does not exist: this machine has {count} CUDA GPU(s).",
                hint=f"Use cuda:0 to cuda:{count - 1}, or --device auto.",
            )
        return torch.device(name)
    if name == "mps":
        if _mps_available():
            return torch.device("mps")
        raise DriftlabError(
            "Device 'mps' (Apple GPU) is not available on this machine or torch build.",
            hint=f"Use --device {supported_devices()}.",
        )
    try:
        torch.device(name)
    except RuntimeError:
        raise DriftlabError(f"Unknown device '{device}'.", hint=f"Use --device {supported_devices()}.") from None
    raise DriftlabError(
        f"Device '{device}' is not supported: driftlab runs models only on the CPU or a GPU.",
        hint=f"Use --device {supported_devices()}.",
    )


def cpu_has_native_bf16() -> bool:
    """True if the CPU multiplies bf16 natively (AVX512-BF16 or AMX)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def pick_dtype(dtype: str, device: torch.device | None = None) -> torch.dtype:
    """Resolve a dtype name; `auto` picks what is fastest on the device.

    `auto`: bf16 on CUDA (fp16 if the GPU lacks bf16) and on CPUs with native bf16; float32
    on other CPUs, where bf16 matmuls are emulated: measured on a 2-core AVX-512 Xeon without
    BF16, fp32 generated 1.1x (batch 1) to 3.4x (batch 30) more tokens/s than bf16.
    """
    if dtype == "auto":
        if device is not None and device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    try:
        return DTYPES[dtype]
    except KeyError:
        raise DriftlabError(
            f"Unknown dtype '{dtype}'.", hint=f"Use one of: auto, {', '.join(DTYPES)}."
        ) from None


def prepare_attention(attn_implementation: str) -> None:
    """Make driftlab's attention implementation known to transformers if it is the one asked for:
    the step right before a model is loaded with it (load_model, or a stand-in for it)."""
    from driftlab.attention import ATTENTION_NAME, register

    if attn_implementation == ATTENTION_NAME:
        register()


@contextmanager
def collections_paused() -> Iterator[None]:
    """No cyclic garbage collection inside: a first load imports most of transformers and builds
    the model, some 250k objects that live as long as the process. Python's full collections walk
    the growing heap again and again meanwhile and find nothing to free: a new process's first
    load of SmolLM2-135M ran 3 full collections fewer with the pause, and took 0.46 s less
    (benchmarks/loading.py). Everything stays collectable once it ends."""
    if not gc.isenabled():  # the caller's choice, kept
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def load_model(
    name_or_path: str,
    dtype: str = "auto",
    device: str = "auto",
    attn_implementation: str = "sdpa",
    *,
    device_map: str | None = None,
    quantize: str | None = None,
):
    """Load (model, tokenizer, path) from a preset, a local directory or a Hub id.

    Device, dtype and quantisation are checked first, so a bad flag fails before the default
    model is pulled or a Hub model downloaded; damaged weight files are named, with the
    command that repairs them. The name is resolved (maybe downloaded) before the load itself,
    which then reads only the local directory.
    `device_map` spreads the layers over devices with accelerate, whose hooks move each
    layer's inputs to where its weights are (the attention engine follows them);
    `quantize` loads 8- or 4-bit weights with bitsandbytes.
    """
    from driftlab.assets import resolve_model

    torch_device = pick_device(device)
    torch_dtype = pick_dtype(dtype, torch_device)
    placement = _placement(device_map, quantize, torch_device, torch_dtype)
    path = Path(resolve_model(name_or_path))
    # The load itself reads only `path` (local_files_only): the network is for resolving a Hub
    # id, above. HF_HUB_OFFLINE is left as the user set it, so a later model of the same
    # process (a --user-model, a --compare model) can still be downloaded.
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    check_weights(path, name_or_path)
    with collections_paused():
        prepare_attention(attn_implementation)  # here, not first: registering imports seconds of transformers
        hf_logging.disable_progress_bar()
        try:
            tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
            model = AutoModelForCausalLM.from_pretrained(
                path, dtype=torch_dtype, attn_implementation=attn_implementation, local_files_only=True, **placement)
        except SafetensorError as err:  # a damage check_weights could not see from the header
            raise DriftlabError(
                f"A weights file in {path} is damaged: {err}", hint=_repair_hint(path, name_or_path)
            ) from err
        except (OSError, ValueError) as err:
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise DriftlabError(
                f"Could not load a causal language model from {path}: {first}",
                hint="The directory must hold a Hugging Face causal LM (config.json, weights, tokenizer)"
                + ("; check --device-map." if device_map else "."),
            ) from err
        finally:
            hf_logging.enable_progress_bar()
    if not placement:
        model.to(torch_device)
    model.eval()
    return model, tokenizer, path


def input_device(model) -> torch.device:
    """Where a model's inputs go: its device, or, for a model spread by a device map, the
    first GPU of the map (the CPU when it keeps everything on the CPU or disk: offloaded
    weights sit on the meta device and must not be asked)."""
    device_map = getattr(model, "hf_device_map", None)
    if not device_map:
        return model.device
    for where in device_map.values():
        if isinstance(where, int):
            return torch.device("cuda", where)
        if where not in ("cpu", "disk"):
            return torch.device(where)
    return torch.device("cpu")


def _placement(device_map: str | None, quantize: str | None, device: torch.device, dtype: torch.dtype) -> dict:
    """from_pretrained's keyword arguments for --device-map and --quantize ({} for neither).

    Refuses, before anything is resolved or loaded, what this machine cannot do: bitsandbytes
    quantisation needs CUDA and the bitsandbytes package; a device map needs accelerate.
    """
    import importlib.util

    kwargs: dict = {}
    if device_map is not None:
        if importlib.util.find_spec("accelerate") is None:
            raise DriftlabError("--device-map needs the accelerate package, which is not installed.",
                                hint="pip install accelerate")
        mapping = json.loads(device_map) if device_map.startswith("{") else device_map
        if isinstance(mapping, dict):
            gpus = [d for d in mapping.values() if isinstance(d, int) or str(d).startswith("cuda")]
            if gpus and not torch.cuda.is_available():
                raise DriftlabError(f"--device-map places modules on GPU {gpus[0]!r}, but this torch build sees no "
                                    "CUDA GPU.", hint="Map them to 'cpu' or 'disk', or run on a GPU machine.")
        elif not torch.cuda.is_available():
            mapping = {"": "cpu"}  # accelerate's strategies would put everything on the CPU anyway
        kwargs["device_map"] = mapping
        if "disk" in (mapping.values() if isinstance(mapping, dict) else ()):
            kwargs["offload_folder"] = _offload_folder()
    if quantize is not None:
        missing = [what for what, ok in (("a CUDA GPU", torch.cuda.is_available()),
                                         ("the bitsandbytes package", importlib.util.find_spec("bitsandbytes")))
                   if not ok]
        if missing:
            raise DriftlabError(
                f"--quantize {quantize} needs {' and '.join(missing)}, which this machine lacks.",
                hint="Install a CUDA build of torch and `pip install bitsandbytes` on a GPU machine, "
                "or drop --quantize.",
            )
        from transformers import BitsAndBytesConfig

        kwargs["quantization_config"] = (
            BitsAndBytesConfig(load_in_8bit=True) if quantize == "8bit"
            else BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype))
        kwargs.setdefault("device_map", {"": device.index or 0} if device.type == "cuda" else {"": 0})
    return kwargs


def _offload_folder() -> str:
    """A private folder for the weights a device map sends to 'disk', removed at exit."""
    import atexit
    import shutil
    import tempfile

    folder = tempfile.mkdtemp(prefix="driftlab-offload-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


def check_weights(path: Path, name_or_path: str | None = None) -> None:
    """Raise a DriftlabError naming the first *.safetensors file whose header is unreadable or
    that is shorter than its header says (an interrupted copy or pull). Reads headers only."""
    from safetensors import SafetensorError, safe_open

    for file in sorted(path.glob("*.safetensors")):
        try:
            with safe_open(str(file), framework="pt"):
                pass
        except (SafetensorError, OSError) as err:
            raise DriftlabError(
                f"Model weights file {file} is truncated or corrupt ({err}).",
                hint=_repair_hint(path, name_or_path or str(path)),
            ) from None


def _repair_hint(path: Path, name_or_path: str) -> str:
    """`models pull NAME --force` when the directory is (a copy of) a preset, else re-save it."""
    from driftlab.assets import PRESETS
    from driftlab.assets.store import MARKER

    preset = name_or_path if name_or_path in PRESETS else None
    if preset is None:
        try:
            preset = json.loads((path / MARKER).read_text(encoding="utf-8")).get("preset")
        except (OSError, ValueError, AttributeError):
            preset = None
    if preset in PRESETS:
        return f"Run `driftlab models pull {preset} --force` to fetch and convert it again."
    return (
        "Copy or save the model directory again (save_pretrained); for a preset, run "
        "`driftlab models pull NAME --force`."
    )
