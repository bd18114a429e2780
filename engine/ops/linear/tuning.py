"""Where the fused GEMV runs, each entry with its reason (its tiles: `kernel.default_tiles`). Numbers and their
history: benchmarks/RESULTS.md ("Decode step")."""

# GPUs (by name) where decode steps of up to this many tokens are faster with the fused GEMVs than with cuBLAS, as
# benchmarks/engine_bench.py measured them; other GPUs keep cuBLAS (`llm_engine.resolved_fused_gemv_max_tokens`).
FUSED_GEMV_GPUS = {"H100": 1, "H200": 48}
