"""Which causal LM class runs a config: one per model family (`ModelConfig.family`)."""

from __future__ import annotations

from baton.engine.causal_lm import CausalLM
from baton.engine.config import ModelConfig
from baton.engine.layer_symbols import NEMOTRON_H, QWEN3_5
from baton.engine.model import NemotronHForCausalLM
from baton.engine.qwen3_5_model import Qwen3_5ForCausalLM

MODEL_CLASSES: dict[str, type[CausalLM]] = {NEMOTRON_H: NemotronHForCausalLM, QWEN3_5: Qwen3_5ForCausalLM}


def model_class(cfg: ModelConfig) -> type[CausalLM]:
    if cfg.family not in MODEL_CLASSES:
        raise ValueError(f"model family: expected one of {', '.join(MODEL_CLASSES)}, got {cfg.family!r}")
    return MODEL_CLASSES[cfg.family]
