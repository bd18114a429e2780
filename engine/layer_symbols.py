"""The block symbols of a model's layer pattern, the model families, and the config error every parser raises.

Shared by `config.py` (ModelConfig, NemotronH's parse) and the other families' parsers (`config_qwen3_5.py`),
which build ModelConfig's fields without importing it.
"""

from __future__ import annotations

from typing import Any

# Layer symbols of `hybrid_override_pattern`, and G for a Gated DeltaNet mixer (Qwen3.5's linear attention).
MAMBA, ATTENTION, MLP, MOE, GDN = "M", "*", "-", "E", "G"
LAYER_SYMBOLS = (MAMBA, ATTENTION, MLP, MOE)
RECURRENT_SYMBOLS = (MAMBA, GDN)  # mixers with per-request state in the state pools
NEMOTRON_H, QWEN3_5 = "nemotron_h", "qwen3_5"  # the model families (`ModelConfig.family`)


def config_error(field_name: str, expected: str, got: Any) -> ValueError:
    return ValueError(f"config field '{field_name}': expected {expected}, got {got!r}")
