"""A packed step through a Llama model in one function: transformers' arithmetic without
its module layers.

A one-token step of the default model (int4, two threads) took 24 ms, of which the
matrix kernels and attention were 10: the rest was Python, in the wrappers every
transformers module call goes through (hooks, keyword merging, output capture,
deprecation shims) and in per-pass work such as the rotary table, 30 layers deep.
``LlamaPass`` runs the same operations in the same order on the same modules' weights,
so it computes the same bits (the tests hold it to transformers' logits bitwise), with
the rotary table built once for every position the cache holds.

It takes ``LlamaForCausalLM`` with the layers transformers builds for it and a rotary
embedding that does not change with the sequence (``STATIC_ROPE``); any other model runs
through transformers (``PackedModel``).
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn
from transformers import LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaDecoderLayer, LlamaMLP, LlamaRMSNorm

from verifier_service.core.kv_cache import STEP_KWARG, StepLayout, slot_attention
from verifier_service.core.weights import JoinedInt4Linear, join

# Rotary embeddings whose angle for a position is fixed (no dependence on the sequence's
# length), so that one table serves every pass.
STATIC_ROPE = ("default", "linear", "llama3")


class LlamaPass:
    """``model``'s forward over a packed step (``PackedModel.forward``'s call), or None from
    ``of`` when ``model`` is not a Llama this function computes exactly as transformers does."""

    def __init__(self, model: LlamaForCausalLM, capacity: int) -> None:
        self.model = model
        inner = model.model
        self.layers: list[LlamaDecoderLayer] = list(inner.layers[: model.config.num_hidden_layers])
        # Each layer's projections of one input as one layer, where that computes the same bits.
        self.joined = [
            (join([layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj]), join([layer.mlp.gate_proj, layer.mlp.up_proj]))
            for layer in self.layers
        ]
        self.embed, self.norm, self.head = inner.embed_tokens, inner.norm, model.lm_head
        parameter = next(model.parameters())
        # Every position's cos and sin, as transformers computes them for each pass: each
        # entry depends on its position alone, so the table holds the same bits.
        positions = torch.arange(capacity, device=parameter.device)[None]
        with torch.inference_mode():
            cos, sin = inner.rotary_emb(self.embed.weight[:1].to(parameter.dtype), position_ids=positions)
        self.cos, self.sin = cos[0], sin[0]  # [capacity, head_dim]

    @classmethod
    def of(cls, model: nn.Module, capacity: int) -> LlamaPass | None:
        return cls(cast(LlamaForCausalLM, model), capacity) if takes(model) else None

    def __call__(self, input_ids: torch.Tensor, layout: StepLayout, keep: torch.Tensor | None) -> torch.Tensor:
        """Logits [kept (or every token), vocab] of ``input_ids`` [1, tokens] laid out by ``layout``."""
        hidden = self.embed(input_ids)  # [1, tokens, hidden]
        positions = layout.position_ids[0]
        cos, sin = self.cos[positions][None, None], self.sin[positions][None, None]  # [1, 1, tokens, head_dim]
        step = {STEP_KWARG: layout}
        for layer, (qkv, gate_up) in zip(self.layers, self.joined):
            hidden = hidden + _attention(layer.self_attn, qkv, _rms_norm(layer.input_layernorm, hidden), cos, sin, step)
            mlp = layer.mlp
            normed = _rms_norm(layer.post_attention_layernorm, hidden)
            if gate_up is None:
                gate, up = mlp.gate_proj(normed), mlp.up_proj(normed)
            else:
                gate, up = gate_up(normed).split(gate_up.splits, dim=-1)
            hidden = hidden + mlp.down_proj(mlp.act_fn(gate) * up)
        hidden = _rms_norm(self.norm, hidden)
        if keep is not None:
            hidden = hidden[:, keep]
        return self.head(hidden)[0]


def takes(model: nn.Module) -> bool:
    """Whether ``LlamaPass`` computes ``model``: a ``LlamaForCausalLM`` of transformers' own
    layers with a static rotary embedding."""
    if type(model) is not LlamaForCausalLM:
        return False
    inner = model.model
    if getattr(inner.rotary_emb, "rope_type", None) not in STATIC_ROPE or type(inner.norm) is not LlamaRMSNorm:
        return False
    expected = (LlamaDecoderLayer, LlamaAttention, LlamaMLP, LlamaRMSNorm, LlamaRMSNorm)
    return all(
        tuple(map(type, (layer, layer.self_attn, layer.mlp, layer.input_layernorm, layer.post_attention_layernorm))) == expected
        for layer in inner.layers
    )


def forward_name(model: nn.Module) -> str:
    """What computes ``model``'s packed passes, for the keys of stored measurements: their costs depend on it."""
    return "llama_pass" if takes(model) else "transformers"


def _rms_norm(norm: LlamaRMSNorm, hidden: torch.Tensor) -> torch.Tensor:
    """``LlamaRMSNorm.forward``, its operations in its order."""
    dtype = hidden.dtype
    hidden = hidden.to(torch.float32)
    variance = hidden.pow(2).mean(-1, keepdim=True)
    hidden = hidden * torch.rsqrt(variance + norm.variance_epsilon)
    return norm.weight * hidden.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _attention(
    attention: LlamaAttention, qkv: JoinedInt4Linear | None, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, step: dict
) -> torch.Tensor:
    """``LlamaAttention.forward`` over the slot cache: [1, tokens, hidden] -> [1, tokens, hidden]."""
    shape = (*hidden.shape[:-1], -1, attention.head_dim)
    if qkv is None:
        projected = attention.q_proj(hidden), attention.k_proj(hidden), attention.v_proj(hidden)
        query, key, value = (part.view(shape).transpose(1, 2) for part in projected)
        query = (query * cos) + (_rotate_half(query) * sin)
        key = (key * cos) + (_rotate_half(key) * sin)
    else:  # the query and key heads side by side, turned in one go: the same products, element by element
        heads = qkv(hidden).view(shape)  # [1, tokens, query + key + value heads, head_dim]
        queries, keys = qkv.splits[0] // attention.head_dim, qkv.splits[1] // attention.head_dim
        turned = heads[:, :, : queries + keys]
        turned = (turned * cos.transpose(1, 2)) + (_rotate_half(turned) * sin.transpose(1, 2))
        query, key = turned[:, :, :queries].transpose(1, 2), turned[:, :, queries:].transpose(1, 2)
        value = heads[:, :, queries + keys :].transpose(1, 2)
    output, _ = slot_attention(attention, query, key, value, None, dropout=0.0, scaling=attention.scaling, **step)
    return attention.o_proj(output.reshape(*hidden.shape[:-1], -1).contiguous())
