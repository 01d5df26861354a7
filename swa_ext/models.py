"""Attention geometry of hybrid sliding-window-attention models, read from the
bundled ``data/swa_model_configs.json``, and the KV bytes per token of each pool."""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

CONFIGS_PATH = Path(__file__).with_name("data") / "swa_model_configs.json"

# Bytes of one K or V element: the pools hold bf16.
KV_DTYPE_BYTES = 2


@dataclass(frozen=True)
class ModelConfig:
    name: str
    window: int  # sliding window, tokens
    swa_layers: int
    full_layers: int
    kv_heads: int
    head_dim: int
    context_len: int

    def _bytes_per_token(self, layers: int) -> int:
        # K and V, every layer of the kind, every KV head.
        return 2 * layers * self.kv_heads * self.head_dim * KV_DTYPE_BYTES

    @property
    def full_bytes_per_token(self) -> int:
        return self._bytes_per_token(self.full_layers)

    @property
    def swa_bytes_per_token(self) -> int:
        return self._bytes_per_token(self.swa_layers)


def _complete(entry: object) -> bool:
    """True for entries whose geometry is fully known (the file also holds notes
    on models without SWA or with unverified figures)."""
    if not isinstance(entry, dict):
        return False
    keys = ("window", "swa", "full", "kv", "hd", "ctx")
    return all(type(entry.get(k)) is int for k in keys) and entry["swa"] > 0


@lru_cache(maxsize=None)
def load_models() -> dict[str, ModelConfig]:
    with open(CONFIGS_PATH, encoding="utf-8") as f:
        raw = json.load(f)
    return {
        name: ModelConfig(
            name=name,
            window=e["window"],
            swa_layers=e["swa"],
            full_layers=e["full"],
            kv_heads=e["kv"],
            head_dim=e["hd"],
            context_len=e["ctx"],
        )
        for name, e in raw.items()
        if _complete(e)
    }


def get_model(name: str) -> ModelConfig:
    models = load_models()
    if name not in models:
        raise KeyError(f"unknown model {name!r}; known: {', '.join(sorted(models))}")
    return models[name]
