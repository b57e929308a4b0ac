"""A trained draft head: the target's own next hidden state, guessed by one small layer.

Copying drafters (the drafter service's n-gram tables) cannot guess text
that was never written before. The head can: like EAGLE (Li et al. 2024)
and IBM's MLP speculators, it reads the target's last hidden state at the
position just verified (the input of the target's output layer, which the
verification pass computed anyway) and the embedding of the token just
emitted, and predicts the hidden state the target will have at that token.
The target's own output layer reads the guess out; a chain several tokens
deep feeds each guess back in. It costs no extra target pass.

    feature f_t (target, position t) + embedding of x_{t+1}
        -> fuse (linear) -> + SwiGLU MLP (residual) -> RMSNorm -> f'_{t+1}
        -> the target's output rows of the draft vocabulary -> x'_{t+2}

The readout uses only a draft vocabulary of the tokens most frequent in the
target's own answers (vLLM's draft vocab, FR-Spec): the full output layer
would cost a fifth of a target pass per drafted token. The readout rows are
the target's, not stored with the head; the head's weights are a few MB.

Weights live in a folder with a manifest (``HeadManifest``) that names the
target they were trained on (``target_fingerprint``): a head is never loaded
onto another model. ``verifier_service.head.train`` trains one. A head folder
is a file on disk, untrusted: every manifest field is checked (its type, its
range, the sizes against the target's) and so is the weights file (its size
before it is read, then each tensor's name, shape, dtype and values) before
anything is built; a head that fails any check is refused with one
``HeadMismatch`` naming what is wrong and what was expected.

Exactness does not depend on the head: its drafts are verified like any
other (deterministic points, as the n-gram drafts are).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path
from typing import cast

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from specdec.vocabulary import tokenizer_fingerprint
from verifier_service.core.model_loading import cache_root, staged_folder

log = logging.getLogger(__name__)

# 2: the draft vocabulary is stored most frequent first (format 1's was by id).
HEAD_FORMAT = 2
# Draft-vocabulary entries a served head keeps (the most frequent first).
DEFAULT_HEAD_VOCABULARY = 2048
MANIFEST = "manifest.json"
WEIGHTS = "head.safetensors"
# Values of each parameter tensor the fingerprint reads: enough to tell a
# fine-tune from its base (every tensor changes), cheap on any model size.
FINGERPRINT_VALUES_PER_TENSOR = 4096
# Config entries that say how a model was saved or loaded, not which model it is.
UNFINGERPRINTED_CONFIG = ("architectures", "dtype", "torch_dtype", "transformers_version", "use_cache")
TARGET_FINGERPRINT_DIGITS = 16  # target_fingerprint's length, in hex digits

# The bounds a head folder is held to before anything is read into memory or built.
# A manifest is a few hundred bytes: a larger file is not one (and is not read whole).
MAX_MANIFEST_BYTES = 64 * 1024
# Characters of a manifest's text fields (vocabulary, note): they are logged with the head.
MAX_MANIFEST_TEXT = 1024
# The MLP's inner size, at most this many times the target's feature size: targets' own
# MLPs are 2.7-8x as wide (train_head's default 1536 on a 576-wide target is 2.7x); 16x
# leaves room for any head worth its cost and refuses sizes that cannot fit in memory.
MAX_WIDTH_PER_FEATURE = 16
# A level reads the head's two best guesses (HeadDrafter.level's topk(2)).
MIN_DRAFT_VOCABULARY = 2
# Bytes of a weights file besides its tensors' values: six tensors' names, shapes and
# offsets take a few hundred (safetensors: 8 bytes of length, then a JSON header).
MAX_WEIGHTS_HEADER_BYTES = 64 * 1024
# The safetensors dtypes a head's parameters may be saved in (bytes per value): loading
# converts them to the target's dtype. The draft vocabulary is saved as int64 ("I64").
PARAMETER_DTYPES = {"F32": 4, "F16": 2, "BF16": 2}
VOCAB_DTYPE = "I64"


class HeadMismatch(ValueError):
    """A head that cannot be used: its manifest or weights are malformed, out of range, or
    describe another target. The message names the field or tensor and what was expected."""


def shown(value: object) -> str:
    """``value`` for a message, cut short: a manifest may hold anything."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


# The manifest's field types, JSON's values each admits and how a message names it: JSON's
# true is not an integer, nor are 64.0 and "64"; an integer is a number.
MANIFEST_TYPES = {
    "int": ("an integer", lambda value: isinstance(value, int) and not isinstance(value, bool)),
    "float": ("a number", lambda value: isinstance(value, (int, float)) and not isinstance(value, bool)),
    "str": ("a string", lambda value: isinstance(value, str)),
}


def check_type(name: str, value: object, kind: str) -> None:
    """``HeadMismatch`` unless ``value`` is of the manifest type ``kind`` (a MANIFEST_TYPES key)."""
    expected, admits = MANIFEST_TYPES[kind]
    if not admits(value):
        raise HeadMismatch(f"field {name} must be {expected}, found {type(value).__name__} {shown(value)}")


def check_range(name: str, value: float, low: float, high: float, why: str = "") -> None:
    """``HeadMismatch`` unless ``low <= value <= high``."""
    if not low <= value <= high:  # False for NaN too
        bound = f"{low}" if low == high else f"[{low}, {high}]" if high < math.inf else f">= {low}"
        raise HeadMismatch(f"field {name} is {shown(value)}, expected {bound}{f' ({why})' if why else ''}")


def check_format(value: object) -> None:
    check_type("format", value, "int")
    if value != HEAD_FORMAT:
        raise HeadMismatch(
            f"head format {value}, this verifier reads format {HEAD_FORMAT}: train a new head with python -m verifier_service.head.train"
        )


@dataclass(frozen=True)
class HeadManifest:
    """What a head folder holds and what it was trained on."""

    format: int
    target: str  # target_fingerprint of the model it was trained on
    vocabulary: str  # tokenizer_fingerprint
    hidden_size: int  # the target's feature size (its output layer's input)
    embedding_size: int
    width: int  # the MLP's inner size
    draft_vocabulary: int  # tokens the head can draft
    trained_tokens: int = 0
    held_out_accuracy: float = 0.0  # first-token accuracy on held-out prompts, when trained
    note: str = ""

    def __post_init__(self) -> None:
        """The checks that need no target (``HeadMismatch``); ``check_fits`` holds the sizes to one."""
        for field in fields(self):
            kind = field.type if isinstance(field.type, str) else field.type.__name__  # a string: annotations are postponed
            check_type(field.name, getattr(self, field.name), kind)
        check_format(self.format)
        if len(self.target) != TARGET_FINGERPRINT_DIGITS or any(digit not in "0123456789abcdef" for digit in self.target):
            expected = f"{TARGET_FINGERPRINT_DIGITS} hex digits (target_fingerprint)"
            raise HeadMismatch(f"field target is {shown(self.target)}, expected {expected}")
        for name in ("hidden_size", "embedding_size", "width"):
            check_range(name, getattr(self, name), 1, math.inf)
        check_range("draft_vocabulary", self.draft_vocabulary, MIN_DRAFT_VOCABULARY, math.inf, "a level drafts the two best guesses")
        check_range("trained_tokens", self.trained_tokens, 0, math.inf)
        check_range("held_out_accuracy", self.held_out_accuracy, 0.0, 1.0)
        for name in ("vocabulary", "note"):
            check_range(f"{name}'s length", len(getattr(self, name)), 0, MAX_MANIFEST_TEXT)

    def check_fits(self, hidden_size: int, embedding_size: int, tokens: int) -> None:
        """``HeadMismatch`` unless the head's sizes fit a target of feature size ``hidden_size``,
        embedding size ``embedding_size`` and ``tokens`` output rows."""
        for name, size in (("hidden_size", hidden_size), ("embedding_size", embedding_size)):
            check_range(name, getattr(self, name), size, size, f"the target's {name.replace('_', ' ')}")
        widest = MAX_WIDTH_PER_FEATURE * hidden_size
        check_range("width", self.width, 1, widest, f"at most {MAX_WIDTH_PER_FEATURE} x the target's hidden size {hidden_size}")
        check_range("draft_vocabulary", self.draft_vocabulary, MIN_DRAFT_VOCABULARY, tokens, "at most the target's vocabulary")

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> HeadManifest:
        """The manifest ``text`` holds; ``HeadMismatch`` when it is not JSON, not an object,
        of another format, lacks or adds fields, or a field is of the wrong type or range."""
        try:
            record = json.loads(text)
        except ValueError as error:
            raise HeadMismatch(f"not a draft head manifest: not JSON ({error})") from None
        if not isinstance(record, dict):
            raise HeadMismatch(f"not a draft head manifest: a JSON object is expected, found {type(record).__name__}")
        if "format" in record:  # first: another format's fields may differ
            check_format(record["format"])
        required = [field.name for field in fields(cls) if field.default is MISSING]
        missing = [name for name in required if name not in record]
        if missing:
            raise HeadMismatch(f"not a draft head manifest of format {HEAD_FORMAT}: fields {', '.join(missing)} missing")
        unknown = sorted(set(record) - {field.name for field in fields(cls)})
        if unknown:
            raise HeadMismatch(f"not a draft head manifest of format {HEAD_FORMAT}: unknown fields {', '.join(map(shown, unknown))}")
        return cls(**record)


def target_fingerprint(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> str:
    """16 hex digits naming the target: its config, its tokenizer, and the leading values of
    every parameter (so a fine-tune of the same architecture differs). Not where it was
    loaded from, nor its dtype: the values are hashed rounded to bfloat16, so the same
    model loaded in float32 or bfloat16 has one fingerprint."""
    config = json.loads(model.config.to_json_string(use_diff=False))
    kept = {key: value for key, value in config.items() if not key.startswith("_") and key not in UNFINGERPRINTED_CONFIG}
    digest = hashlib.sha256(json.dumps(kept, sort_keys=True).encode())
    digest.update(tokenizer_fingerprint(tokenizer).encode())
    for name, parameter in model.state_dict().items():
        flat = parameter.detach().reshape(-1)
        head = flat[:FINGERPRINT_VALUES_PER_TENSOR].to("cpu", torch.bfloat16).float().contiguous()
        digest.update(f"{name}:{tuple(parameter.shape)}:".encode())
        digest.update(head.numpy().tobytes())
    return digest.hexdigest()[:16]


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class DraftHead(nn.Module):
    """The trainable part: (feature, embedding of the next token) -> the next feature."""

    vocab: torch.Tensor  # a buffer: the target id of each draft-vocabulary entry

    def __init__(self, hidden_size: int, embedding_size: int, width: int, draft_vocabulary: int) -> None:
        super().__init__()
        self.fuse = nn.Linear(hidden_size + embedding_size, hidden_size, bias=False)
        self.norm = RMSNorm(hidden_size)
        self.gate_up = nn.Linear(hidden_size, 2 * width, bias=False)
        self.down = nn.Linear(width, hidden_size, bias=False)
        self.out_norm = RMSNorm(hidden_size)
        # Target token id of each draft-vocabulary entry (kept with the weights: it is part of the head).
        self.register_buffer("vocab", torch.zeros(draft_vocabulary, dtype=torch.long))

    def forward(self, feature: torch.Tensor, embedding: torch.Tensor) -> torch.Tensor:
        x = self.fuse(torch.cat([feature, embedding], dim=-1))
        gate, up = self.gate_up(self.norm(x)).chunk(2, dim=-1)
        return self.out_norm(x + self.down(nn.functional.silu(gate) * up))


class HeadDrafter:
    """A trained head bound to its target: the target's embeddings and the output rows of
    the head's draft vocabulary, on the target's device and dtype. ``vocabulary`` keeps
    only the head's most frequent entries (its first rows): a level reads fewer weights
    and misses the tokens cut."""

    def __init__(self, head: DraftHead, model: PreTrainedModel, manifest: HeadManifest | None = None, vocabulary: int = 0) -> None:
        parameter = next(model.parameters())
        self.head = head.to(parameter.device, parameter.dtype).eval().requires_grad_(False)
        self.manifest = manifest
        self.embeddings = model.get_input_embeddings()
        output = model.get_output_embeddings()
        self.vocab = self.head.vocab[:vocabulary] if vocabulary > 0 else self.head.vocab
        self.readout = output.weight.detach()[self.vocab].contiguous()  # [draft vocabulary, hidden]
        bias = getattr(output, "bias", None)
        self.readout_bias = bias.detach()[self.vocab] if bias is not None else None

    def logits(self, feature: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits of predicted features [..., hidden]."""
        logits = feature @ self.readout.T
        return logits if self.readout_bias is None else logits + self.readout_bias

    @torch.inference_mode()
    def level(self, features: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One level of drafting for a batch: ``features`` [rows, hidden] is the target's
        (or the previous level's) feature at each row's last position and ``tokens`` [rows]
        the token there. Returns the predicted features at those tokens, the head's two
        best guesses for the token after each [rows, 2] (target ids), and their
        probabilities [rows, 2] (no softmax over the whole vocabulary: two exps)."""
        feature = self.head(features.to(self.readout.dtype), self.embeddings(tokens))
        logits = self.logits(feature).float()
        best, index = logits.topk(2, dim=-1)
        return feature, self.vocab[index], (best - logits.logsumexp(dim=-1, keepdim=True)).exp()


def head_sizes(model: PreTrainedModel) -> tuple[int, int]:
    """(feature size, embedding size) of a target."""
    output = cast(nn.Linear, model.get_output_embeddings())
    embeddings = cast(nn.Embedding, model.get_input_embeddings())
    return output.weight.shape[1], embeddings.weight.shape[1]


def save_head(folder: Path, head: DraftHead, manifest: HeadManifest) -> None:
    """Write the head and its manifest into ``folder``, whole or not at all."""
    with staged_folder(folder, replace=True) as staging:
        state = {name: tensor.detach().to("cpu").contiguous() for name, tensor in head.state_dict().items()}
        save_file(state, str(staging / WEIGHTS))
        (staging / MANIFEST).write_text(manifest.to_json())


def read_manifest(folder: Path) -> HeadManifest:
    """The manifest in ``folder``, checked (``HeadManifest.from_json``) but not against a target."""
    path = folder / MANIFEST
    try:
        size = path.stat().st_size
        if size > MAX_MANIFEST_BYTES:
            raise HeadMismatch(f"{path} is {size} bytes, more than a manifest's {MAX_MANIFEST_BYTES}: not a draft head manifest")
        text = path.read_bytes().decode("utf-8")
    except OSError as error:
        raise HeadMismatch(f"{folder} is not a draft head folder: {error.strerror or error} ({path})") from None
    except UnicodeDecodeError:
        raise HeadMismatch(f"{path} is not a draft head manifest: not UTF-8 text") from None
    try:
        return HeadManifest.from_json(text)
    except HeadMismatch as error:
        raise HeadMismatch(f"{path}: {error}") from None


def weights_file_bounds(expected: dict[str, torch.Tensor]) -> tuple[int, int]:
    """The fewest and most bytes a safetensors file of the ``expected`` tensors takes (their
    values in the smallest or largest dtype allowed, plus its header)."""
    smallest, largest = min(PARAMETER_DTYPES.values()), max(PARAMETER_DTYPES.values())
    low = high = 8  # the header's length
    for tensor in expected.values():
        floating = tensor.is_floating_point()
        low += tensor.numel() * (smallest if floating else tensor.element_size())
        high += tensor.numel() * (largest if floating else tensor.element_size())
    return low + 2, high + MAX_WEIGHTS_HEADER_BYTES  # the shortest header is "{}"


def read_weights(path: Path, manifest: HeadManifest) -> dict[str, torch.Tensor]:
    """The head's tensors in ``path``, checked against the sizes ``manifest`` gives: the file's
    size before it is read, each tensor's name, shape and dtype from its header, then its values
    (finite). ``HeadMismatch`` saying which, otherwise."""
    with torch.device("meta"):  # the shapes, allocating nothing
        expected = DraftHead(manifest.hidden_size, manifest.embedding_size, manifest.width, manifest.draft_vocabulary).state_dict()
    problem = f"{path} does not hold the head its manifest describes"
    low, high = weights_file_bounds(expected)
    try:
        size = path.stat().st_size
        if not low <= size <= high:
            raise HeadMismatch(f"{problem}: it is {size} bytes, a head of these sizes takes {low} to {high} (truncated or another head's?)")
        with safe_open(str(path), "pt") as file:
            found = {name: (tuple(file.get_slice(name).get_shape()), file.get_slice(name).get_dtype()) for name in file.keys()}
    except (OSError, SafetensorError) as error:
        raise HeadMismatch(f"{problem}: {error}") from None
    if set(found) != set(expected):
        raise HeadMismatch(f"{problem}: tensors {sorted(found)}, expected {sorted(expected)}")
    for name, tensor in expected.items():
        shape, dtype = found[name]
        dtypes = sorted(PARAMETER_DTYPES) if tensor.is_floating_point() else [VOCAB_DTYPE]
        if shape != tuple(tensor.shape) or dtype not in dtypes:
            raise HeadMismatch(f"{problem}: {name} is {dtype} {list(shape)}, expected {' or '.join(dtypes)} {list(tensor.shape)}")
    try:
        tensors = load_file(str(path))
    except (OSError, SafetensorError) as error:
        raise HeadMismatch(f"{problem}: {error}") from None
    for name, tensor in tensors.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise HeadMismatch(f"{problem}: {name} holds values that are not finite")
    return tensors


def load_head(
    folder: Path, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, fingerprint: str | None = None, vocabulary: int = 0
) -> HeadDrafter:
    """The head in ``folder``, bound to ``model`` (whose ``target_fingerprint`` is
    ``fingerprint``, computed when not given) and cut to ``vocabulary`` draft tokens
    (0: all); ``HeadMismatch`` when it was trained on another target, its manifest is
    malformed or does not fit the target, or its weights do not match its manifest.
    Everything is checked before the head is built."""
    manifest = read_manifest(folder)
    fingerprint = fingerprint or target_fingerprint(model, tokenizer)
    if manifest.target != fingerprint:
        raise HeadMismatch(
            f"{folder} was trained on another target (fingerprint {manifest.target}; this model's is {fingerprint}): "
            "train a head for this model with python -m verifier_service.head.train, or start without --draft-head"
        )
    hidden, embedding = head_sizes(model)
    tokens = model.get_output_embeddings().weight.shape[0]
    try:
        manifest.check_fits(hidden, embedding, tokens)
    except HeadMismatch as error:
        raise HeadMismatch(f"{folder / MANIFEST}: {error}") from None
    tensors = read_weights(folder / WEIGHTS, manifest)
    if not bool(((tensors["vocab"] >= 0) & (tensors["vocab"] < tokens)).all()):
        raise HeadMismatch(f"{folder}: its draft vocabulary names token ids outside the model's {tokens}")
    head = DraftHead(hidden, embedding, manifest.width, manifest.draft_vocabulary)
    head.load_state_dict(tensors, strict=True)  # names and shapes checked: it cannot fail
    return HeadDrafter(head, model, manifest, vocabulary)


def cached_head_folder(root: Path, fingerprint: str) -> Path:
    """Where the trainer stores the head of the target ``fingerprint`` under the cache root."""
    return root / "draft-heads" / fingerprint


def find_head(setting: str, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, vocabulary: int = 0) -> HeadDrafter | None:
    """The head ``--draft-head`` names: "none", a folder (``HeadMismatch`` when it does not
    fit: a start with the wrong head fails, it does not serve without one), or "auto":
    the cache folder's head for this target when there is one that loads (one that does
    not is left, with one warning: the verifier serves without a head)."""
    if setting == "none":
        return None
    if setting != "auto":
        drafter = load_head(Path(setting), model, tokenizer, vocabulary=vocabulary)
        log.info("draft head from %s (%s)", setting, drafter.manifest)
        return drafter
    fingerprint = target_fingerprint(model, tokenizer)
    folder = cached_head_folder(cache_root(), fingerprint)
    if not (folder / MANIFEST).exists():
        log.info("no draft head for this model in %s (train one: python -m verifier_service.head.train)", folder.parent)
        return None
    try:
        drafter = load_head(folder, model, tokenizer, fingerprint, vocabulary)
    except HeadMismatch as error:
        log.warning("the cached draft head is not usable, serving without one: %s", error)
        return None
    log.info("draft head from %s (%s)", folder, drafter.manifest)
    return drafter
