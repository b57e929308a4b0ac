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
onto another model. ``verifier_service.train_head`` trains one.

Exactness does not depend on the head: its drafts are verified like any
other (deterministic points, as the n-gram drafts are).
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import cast

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from specdec.vocabulary import tokenizer_fingerprint
from verifier_service.model_loading import cache_root, staged_folder

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


class HeadMismatch(ValueError):
    """The head's manifest does not describe this target (or is not a head at all)."""


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

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> HeadManifest:
        try:
            record = json.loads(text)
            return cls(**record)
        except (ValueError, TypeError) as error:
            raise HeadMismatch(f"not a draft head manifest: {error}") from None


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


class FeatureCapture:
    """Keeps the input of the target's output layer (its last hidden state, at the positions
    whose logits are computed) from every forward pass: a hook, no extra computation."""

    def __init__(self, model: PreTrainedModel) -> None:
        self.features: torch.Tensor | None = None
        self._handle = model.get_output_embeddings().register_forward_pre_hook(self._keep)

    def _keep(self, module, inputs) -> None:
        self.features = inputs[0].detach()

    def take(self) -> torch.Tensor | None:
        """The latest pass's features [positions, hidden], once."""
        features, self.features = self.features, None
        return None if features is None else features.reshape(-1, features.shape[-1])

    def remove(self) -> None:
        self._handle.remove()


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
    try:
        return HeadManifest.from_json((folder / MANIFEST).read_text())
    except OSError as error:
        raise HeadMismatch(f"{folder} is not a draft head folder: {error.strerror or error} ({folder / MANIFEST})") from None


def load_head(
    folder: Path, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, fingerprint: str | None = None, vocabulary: int = 0
) -> HeadDrafter:
    """The head in ``folder``, bound to ``model`` (whose ``target_fingerprint`` is
    ``fingerprint``, computed when not given) and cut to ``vocabulary`` draft tokens
    (0: all); ``HeadMismatch`` when it was trained on another target or its files do
    not match its manifest."""
    manifest = read_manifest(folder)
    if manifest.format != HEAD_FORMAT:
        raise HeadMismatch(f"{folder}: head format {manifest.format}, this verifier reads format {HEAD_FORMAT}")
    fingerprint = fingerprint or target_fingerprint(model, tokenizer)
    if manifest.target != fingerprint:
        raise HeadMismatch(
            f"{folder} was trained on another target (fingerprint {manifest.target}; this model's is {fingerprint}): "
            "train a head for this model with python -m verifier_service.train_head, or start without --draft-head"
        )
    hidden, embedding = head_sizes(model)
    if (manifest.hidden_size, manifest.embedding_size) != (hidden, embedding):
        raise HeadMismatch(f"{folder}: sizes {manifest.hidden_size}/{manifest.embedding_size}, the model's {hidden}/{embedding}")
    head = DraftHead(hidden, embedding, manifest.width, manifest.draft_vocabulary)
    try:
        head.load_state_dict(load_file(str(folder / WEIGHTS)), strict=True)
    except (OSError, RuntimeError, KeyError, ValueError, SafetensorError) as error:
        raise HeadMismatch(f"{folder / WEIGHTS} does not hold the head its manifest describes: {error}") from None
    tokens = model.get_output_embeddings().weight.shape[0]
    if not bool(((head.vocab >= 0) & (head.vocab < tokens)).all()):
        raise HeadMismatch(f"{folder}: its draft vocabulary names token ids outside the model's {tokens}")
    return HeadDrafter(head, model, manifest, vocabulary)


def cached_head_folder(root: Path, fingerprint: str) -> Path:
    """Where the trainer stores the head of the target ``fingerprint`` under the cache root."""
    return root / "draft-heads" / fingerprint


def find_head(setting: str, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, vocabulary: int = 0) -> HeadDrafter | None:
    """The head ``--draft-head`` names: "none", a folder (``HeadMismatch`` when it does not
    fit: a start with the wrong head fails, it does not serve without one), or "auto":
    the cache folder's head for this target when there is one that loads."""
    if setting == "none":
        return None
    if setting != "auto":
        drafter = load_head(Path(setting), model, tokenizer, vocabulary=vocabulary)
        log.info("draft head from %s (%s)", setting, drafter.manifest)
        return drafter
    fingerprint = target_fingerprint(model, tokenizer)
    folder = cached_head_folder(cache_root(), fingerprint)
    if not (folder / MANIFEST).exists():
        log.info("no draft head for this model in %s (train one: python -m verifier_service.train_head)", folder.parent)
        return None
    try:
        drafter = load_head(folder, model, tokenizer, fingerprint, vocabulary)
    except HeadMismatch as error:
        log.warning("the cached draft head is not usable, serving without one: %s", error)
        return None
    log.info("draft head from %s (%s)", folder, drafter.manifest)
    return drafter
