"""A small GPT: pre-norm blocks of causal attention + MLP, tied LM head (GPT-2's shape).

The model of examples/train_gpt.py and of the FSDP and checkpoint benchmarks (benchmarks/_gpt.py imports it).
Defined here rather than taken from transformers so the example and the benchmarks need torch alone and every
wrapper sees the same plain modules; ``Block`` is the unit every FSDP wraps.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab: int = 8192
    d_model: int = 512
    heads: int = 8
    layers: int = 8
    seq: int = 64
    batch: int = 4          # sequences per rank per step


QUICK_MODEL = ModelConfig(vocab=256, d_model=64, heads=4, layers=2, seq=16, batch=2)


class Block(nn.Module):
    """Pre-norm GPT block: x + attn(ln(x)), then x + mlp(ln(x)); the unit every FSDP wraps."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.out = nn.Linear(4 * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).transpose(1, 3).unbind(2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """Token + position embeddings, blocks, final LayerNorm, LM head tied to the token embedding (GPT-2's)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = nn.LayerNorm(cfg.d_model)
        # GPT-2's initialisation: with torch's N(0, 1) embeddings the tied head's logits would have a spread of
        # sqrt(d_model) and the loss would start in the hundreds, not at ln(vocab).
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear):
                nn.init.zeros_(m.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return F.linear(self.norm(x), self.tok.weight)


def n_params(cfg: ModelConfig) -> int:
    return sum(p.numel() for p in GPT(cfg).parameters())  # the tied weight once
