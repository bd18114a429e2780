"""Which causal LM class (and MTP drafter) runs a config: one per model family (`ModelConfig.family`)."""

from __future__ import annotations

from baton.engine.causal_lm import CausalLM
from baton.engine.config import ModelConfig
from baton.engine.layer_symbols import NEMOTRON_H, QWEN3_5
from baton.engine.model import NemotronHForCausalLM
from baton.engine.mtp import MTPModule
from baton.engine.qwen3_5_model import Qwen3_5ForCausalLM
from baton.engine.qwen3_5_mtp import Qwen3_5MTP

MODEL_CLASSES: dict[str, type[CausalLM]] = {NEMOTRON_H: NemotronHForCausalLM, QWEN3_5: Qwen3_5ForCausalLM}
# The MTP drafter of each family (`from_state_dict`, `forward`, `with_kv_caches`, `num_kv_layers`).
MTP_CLASSES: dict[str, type[MTPModule] | type[Qwen3_5MTP]] = {NEMOTRON_H: MTPModule, QWEN3_5: Qwen3_5MTP}


def model_class(cfg: ModelConfig) -> type[CausalLM]:
    if cfg.family not in MODEL_CLASSES:
        raise ValueError(f"model family: expected one of {', '.join(MODEL_CLASSES)}, got {cfg.family!r}")
    return MODEL_CLASSES[cfg.family]


def mtp_class(cfg: ModelConfig) -> type[MTPModule] | type[Qwen3_5MTP]:
    model_class(cfg)  # the family's check
    return MTP_CLASSES[cfg.family]
