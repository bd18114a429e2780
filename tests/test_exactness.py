"""The engine computes exactly what HF transformers' NemotronHForCausalLM defines (fp32, CPU).

Three random configs vary n_groups, heads, head dims, d_state, conv kernel, chunk size and the layer
pattern (leading attention, consecutive Mamba layers, MoE). Prefill logits of every position match HF
within 1e-4 relative, also when the prompt is prefilled in several chunks; 32 greedy tokens of a batch
with prompt lengths 1..100 served together with chunked prefill match HF's greedy continuation token for
token, and the test checks that mixed prefill/decode batches really ran.
"""

import pytest
import torch

from baton.engine.engine_config import EngineConfig
from baton.engine.llm_engine import LLMEngine
from baton.engine.loader import load_checkpoint
from baton.engine.make_model import make_model
from baton.engine.sampling_params import SamplingParams

transformers = pytest.importorskip("transformers")

CONFIGS = {
    # leading attention, consecutive Mamba, one group, conv 4, chunk 8
    "attn-first": {"hybrid_override_pattern": "*MM-M*M-", "n_groups": 1, "mamba_num_heads": 4,
                   "mamba_head_dim": 16, "ssm_state_size": 16, "conv_kernel": 4, "chunk_size": 8,
                   "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 16},
    # three Mamba layers in a row, 2 groups, GQA 4:2, conv 3, chunk 16
    "mamba-run": {"hybrid_override_pattern": "MM*-MMM*", "n_groups": 2, "mamba_num_heads": 8,
                  "mamba_head_dim": 8, "ssm_state_size": 32, "conv_kernel": 3, "chunk_size": 16,
                  "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16},
    # MoE layer, 4 groups, MQA, conv 2, chunk 32, wider heads
    "moe": {"hybrid_override_pattern": "M*E-M*M", "n_groups": 4, "mamba_num_heads": 8,
            "mamba_head_dim": 16, "ssm_state_size": 8, "conv_kernel": 2, "chunk_size": 32,
            "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 32,
            "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
            "moe_shared_expert_intermediate_size": 64},
}
PROMPT_LENGTHS = (1, 2, 3, 7, 16, 17, 33, 100)
NUM_TOKENS = 32


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def checkpoint(request, tmp_path_factory):
    name = request.param
    out = tmp_path_factory.mktemp(name)
    make_model(out, preset="tiny", seed=hash(name) % 1000, overrides=CONFIGS[name], dtype="float32",
               progress=False)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    return out, hf


def prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


@torch.inference_mode()
def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    """The reference: full recompute of the whole sequence for every token (no cache to get wrong)."""
    ids = list(prompt)
    for _ in range(n):
        logits = hf(input_ids=torch.tensor([ids])).logits[0, -1]
        ids.append(int(logits.argmax()))
    return ids[len(prompt):]


def engine_prefill_logits(engine: LLMEngine, prompt: list[int]) -> torch.Tensor:
    """Logits of every prompt position, computed chunk by chunk through the engine's own step."""
    rid = engine.add_request(prompt, SamplingParams(max_tokens=1))
    rows = []
    while engine.has_unfinished():
        out = engine.scheduler.schedule()
        hidden, batch = engine.runner.forward_hidden(out)
        (row,) = out.rows
        rows.append(engine.model.logits(hidden))
        engine.step_update.update(out, {rid: 0} if row.sample else {})
    return torch.cat(rows)


@pytest.mark.parametrize("chunk", [512, 24])
def test_prefill_logits_match_hf(checkpoint, chunk):
    path, hf = checkpoint
    cfg, weights = load_checkpoint(path)
    engine = LLMEngine(cfg, weights, EngineConfig(max_num_batched_tokens=chunk, max_num_seqs=4, block_size=8))
    prompt = prompts(cfg.vocab_size)[-1]  # 100 tokens: several scan chunks and, at 24, several prefill chunks
    ours = engine_prefill_logits(engine, prompt)
    with torch.inference_mode():
        ref = hf(input_ids=torch.tensor([prompt])).logits[0]
    assert ours.shape == ref.shape
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


def test_r6_greedy_batch_matches_hf_token_for_token(checkpoint):
    path, hf = checkpoint
    cfg, weights = load_checkpoint(path)
    # A chunk budget below the longest prompts: prompts are prefilled in chunks while others decode.
    ecfg = EngineConfig(max_num_batched_tokens=24, long_prefill_token_threshold=16, max_num_seqs=8,
                        block_size=8)
    engine = LLMEngine(cfg, weights, ecfg)
    ps = prompts(cfg.vocab_size, seed=1)
    outs = engine.generate(ps, SamplingParams(max_tokens=NUM_TOKENS, ignore_eos=True))
    assert engine.stats.mixed_steps > 0, "no step mixed prefill chunks with decode rows"
    assert any(d > 0 and p > 1 for d, p in engine.stats.row_kinds), "no step held several prefill chunks + decodes"
    for p, o in zip(ps, outs, strict=True):
        assert list(o.token_ids) == hf_greedy(hf, p, NUM_TOKENS), f"prompt length {len(p)}"
        assert o.finish_reason == "length"
    assert engine.cache.blocks.num_used == 0 and engine.cache.slots.num_used == 0
