"""`Load` and `Info` answers, computed on the engine thread from the engine's own counters."""

from __future__ import annotations

from baton.engine.llm_engine import LLMEngine
from baton.proto.v1 import generation_pb2 as gen
from baton.proto.v1 import worker_pb2 as wk


def load_response(engine: LLMEngine, role: str, held_leases: int = 0) -> wk.LoadResponse:
    s = engine.scheduler
    if engine.config.prefill_only:
        # Counted until handed back, as the router counts a Prefill call until it returns (then takes it off).
        outstanding = engine.prefill_tokens_not_handed_back()
    else:
        outstanding = sum(r.num_prefill_tokens - r.num_computed_tokens for r in s.running if not r.in_decode)
        outstanding += sum(r.num_tokens for r in s.waiting)
    return wk.LoadResponse(
        role=role, waiting=len(s.waiting), running=len(s.running), outstanding_prefill_tokens=outstanding,
        free_kv_blocks=s.cache.blocks.num_free, total_kv_blocks=s.cache.blocks.capacity,
        free_state_slots=s.cache.slots.num_free, total_state_slots=s.cache.slots.capacity, held_leases=held_leases)


def model_info(engine: LLMEngine, model: str, has_tokenizer: bool) -> gen.ModelInfoResponse:
    cfg = engine.model_config
    return gen.ModelInfoResponse(model=model, vocab_size=cfg.vocab_size, max_model_len=engine.max_model_len,
                                 has_tokenizer=has_tokenizer, layer_pattern=cfg.pattern,
                                 eos_token_ids=list(cfg.eos_token_ids))


def info_response(engine: LLMEngine, role: str, engine_id: str, model: str, has_tokenizer: bool,
                  http_port: int = 0) -> wk.InfoResponse:
    return wk.InfoResponse(role=role, engine_id=engine_id, model=model_info(engine, model, has_tokenizer),
                           block_size=engine.config.block_size,
                           max_num_batched_tokens=engine.config.max_num_batched_tokens, http_port=http_port)
