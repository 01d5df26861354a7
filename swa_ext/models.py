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
    """A model's KV geometry. The SWA side's heads and dims default to the full side's,
    and V's head dim to K's, as SGLang 0.5.23's ``model_config`` defaults them."""

    name: str
    window: int  # sliding window (Llama 4: its attention chunk), tokens
    swa_layers: int
    full_layers: int
    kv_heads: int
    head_dim: int
    context_len: int
    v_head_dim: int | None = None
    swa_kv_heads: int | None = None
    swa_head_dim: int | None = None
    swa_v_head_dim: int | None = None
    # Whether SGLang 0.5.23 builds its hybrid SWA allocator for this architecture, and
    # where that is read; False: SGLang runs one full-size pool, so the SGLang columns
    # are a what-if for this model.
    sglang_hybrid: bool = True
    sglang_source: str = ""

    def __post_init__(self):
        for name, default in (("v_head_dim", "head_dim"), ("swa_kv_heads", "kv_heads"),
                              ("swa_head_dim", "head_dim"), ("swa_v_head_dim", "swa_head_dim")):
            if getattr(self, name) is None:
                object.__setattr__(self, name, getattr(self, default))

    @property
    def full_bytes_per_token(self) -> int:
        # K and V of every full layer (SGLang's heads x (head_dim + v_head_dim) per layer).
        return self.full_layers * self.kv_heads * (self.head_dim + self.v_head_dim) * KV_DTYPE_BYTES

    @property
    def swa_bytes_per_token(self) -> int:
        return self.swa_layers * self.swa_kv_heads * (self.swa_head_dim + self.swa_v_head_dim) * KV_DTYPE_BYTES


def _complete(entry: object) -> bool:
    """True for entries whose geometry is fully known (the file also holds notes
    on models without SWA or with unverified figures)."""
    if not isinstance(entry, dict):
        return False
    keys = ("window", "swa", "full", "kv", "hd", "ctx")
    optional = ("v_hd", "swa_kv", "swa_hd", "swa_v_hd")
    return (all(type(entry.get(k)) is int for k in keys) and entry["swa"] > 0
            and all(type(entry[k]) is int for k in optional if k in entry)
            and type(entry.get("sglang_hybrid")) is bool)


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
            v_head_dim=e.get("v_hd"),
            swa_kv_heads=e.get("swa_kv"),
            swa_head_dim=e.get("swa_hd"),
            swa_v_head_dim=e.get("swa_v_hd"),
            sglang_hybrid=e["sglang_hybrid"],
            sglang_source=e["sglang_src"],
        )
        for name, e in raw.items()
        if _complete(e)
    }


def get_model(name: str) -> ModelConfig:
    models = load_models()
    if name not in models:
        raise KeyError(f"unknown model {name!r}; known: {', '.join(sorted(models))}")
    return models[name]
