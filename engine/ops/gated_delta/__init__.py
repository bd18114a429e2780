"""The Gated DeltaNet recurrence of Qwen3.5 / Qwen3-Next linear-attention layers: decode rows (one token each),
varlen chunked prefill rows and verify rows (1+K tokens each, by replay: `ops.spec_verify`), on a state pool indexed
by slot. `reference.py` holds the torch references; state math runs in fp32 and the pool keeps its own dtype.
"""
