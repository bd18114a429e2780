"""The engine computes exactly what HF transformers' Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM and
Qwen3NextForCausalLM define (fp32, CPU).

Three random Qwen3.5 configs (written by `make_model`) vary the layer_types pattern (leading attention, runs of Gated DeltaNet layers), attention
heads and GQA ratios (MQA too), the partial-RoPE factor, the conv width, key/value head counts and dims that
differ, odd vocab sizes and tied embeddings. Prefill logits of every position match HF within fp32 tolerance, also
when the prompt is prefilled in several chunks; greedy tokens of a batch of prompt lengths 1, 2, 3, GDN chunk-1,
chunk, chunk+1, KV block±1 and a long one, served together with chunked prefill, match HF's token for token.
The MoE config (every layer's MLP a sparse MoE block) and the Qwen3-Next one (MoE on every other layer but one
listed in `mlp_only_layers`, the GDN projections fused and grouped per key head) are built by HF itself with
random weights, and saved as HF saves them (per-expert tensors): the same checks hold.
"""

import pytest
import torch

from baton.engine.config_qwen3_5 import GDN_CHUNK_SIZE
from baton.engine.engine_config import EngineConfig
from baton.engine.llm_engine import LLMEngine
from baton.engine.loader import load_checkpoint
from baton.engine.make_model import make_model
from baton.engine.sampling_params import SamplingParams
from tests.test_exactness import engine_prefill_logits

transformers = pytest.importorskip("transformers")

L, F = "linear_attention", "full_attention"
CONFIGS = {
    # the preset: G G G *, GQA 4:2 on attention and 4:2 value:key heads on GDN, Dk 16 != Dv 24, RoPE on 1/4
    "preset": {},
    # leading attention, MQA, RoPE on half the head, conv 3, one value head per key head, tied embeddings, odd vocab
    "attn-first": {"layer_types": [F, L, L, F, L], "num_hidden_layers": 5, "num_attention_heads": 4,
                   "num_key_value_heads": 1, "head_dim": 32, "rope_parameters": {
                       "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
                   "linear_conv_kernel_dim": 3, "linear_num_key_heads": 2, "linear_num_value_heads": 2,
                   "linear_key_head_dim": 8, "linear_value_head_dim": 8, "vocab_size": 301,
                   "tie_word_embeddings": True},
    # three GDN layers in a row twice, conv 2, 3 value heads on 1 key head, full RoPE, 6:3 attention heads
    "gdn-runs": {"layer_types": [L, L, L, F, L, L], "num_hidden_layers": 6, "num_attention_heads": 6,
                 "num_key_value_heads": 3, "head_dim": 8, "rope_parameters": {
                     "rope_type": "default", "rope_theta": 1000.0, "partial_rotary_factor": 1.0},
                 "linear_conv_kernel_dim": 2, "linear_num_key_heads": 1, "linear_num_value_heads": 3,
                 "linear_key_head_dim": 12, "linear_value_head_dim": 16, "vocab_size": 509},
}
# Built by HF: its config class and model class, the shared fields, and the family's own.
_SHARED = {"vocab_size": 389, "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
           "linear_key_head_dim": 8, "linear_value_head_dim": 12, "linear_conv_kernel_dim": 4, "eos_token_id": 1,
           "num_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
           "shared_expert_intermediate_size": 48}
HF_BUILT = {
    "moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", {}),
    "next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", {"intermediate_size": 80, "decoder_sparse_step": 2,
                                                         "mlp_only_layers": [3], "norm_topk_prob": False}),
}
BLOCK = 16
PROMPT_LENGTHS = (1, 2, 3, GDN_CHUNK_SIZE - 1, GDN_CHUNK_SIZE, GDN_CHUNK_SIZE + 1, BLOCK - 1, BLOCK + 1, 150)
NUM_TOKENS = 12


def _hf_built(name: str, out) -> None:
    config_cls, model_cls, own = HF_BUILT[name]
    torch.manual_seed(sum(map(ord, name)))
    hf = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**_SHARED, **own)).float().eval()
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if "norm" in n or "gate" in n:  # HF's init leaves these at constants: spread them
                p.add_(torch.randn_like(p) * 0.1)
    hf.save_pretrained(out)


@pytest.fixture(scope="module", params=sorted(CONFIGS) + sorted(HF_BUILT))
def checkpoint(request, tmp_path_factory):
    name = request.param
    out = tmp_path_factory.mktemp(name)
    if name in HF_BUILT:
        _hf_built(name, out)
    else:
        make_model(out, preset="qwen3.5-tiny", seed=sum(map(ord, name)), overrides=CONFIGS[name], progress=False)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(hf).__name__ == HF_BUILT.get(name, (None, "Qwen3_5ForCausalLM"))[1]
    # Greedy through EOS like the engine's ignore_eos (min_new_tokens would mask the EOS logit instead).
    hf.generation_config.eos_token_id = None
    return out, hf


def prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


@torch.inference_mode()
def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    """HF's own greedy generation (its cached prefill, then its recurrent decode steps)."""
    out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                      max_new_tokens=n, do_sample=False, pad_token_id=0)
    assert out.shape[1] == len(prompt) + n
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("chunk", [512, 40])
def test_prefill_logits_match_hf(checkpoint, chunk):
    path, hf = checkpoint
    cfg, weights = load_checkpoint(path)
    engine = LLMEngine(cfg, weights, EngineConfig(max_num_batched_tokens=chunk, max_num_seqs=4, block_size=BLOCK))
    prompt = prompts(cfg.vocab_size)[-1]  # several GDN chunks and, at 40, several prefill chunks
    ours = engine_prefill_logits(engine, prompt)
    with torch.inference_mode():
        ref = hf(input_ids=torch.tensor([prompt])).logits[0]
    assert ours.shape == ref.shape
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


def test_greedy_batch_of_every_length_matches_hf_token_for_token(checkpoint):
    path, hf = checkpoint
    cfg, weights = load_checkpoint(path)
    ecfg = EngineConfig(max_num_batched_tokens=48, long_prefill_token_threshold=32, max_num_seqs=len(PROMPT_LENGTHS),
                        block_size=BLOCK)
    engine = LLMEngine(cfg, weights, ecfg)
    ps = prompts(cfg.vocab_size, seed=1)
    outs = engine.generate(ps, SamplingParams(max_tokens=NUM_TOKENS, ignore_eos=True))
    assert engine.stats.mixed_steps > 0, "no step mixed prefill chunks with decode rows"
    assert any(d > 0 and p > 1 for d, p in engine.stats.row_kinds), "no step held several prefill chunks + decodes"
    for p, o in zip(ps, outs, strict=True):
        assert list(o.token_ids) == hf_greedy(hf, p, NUM_TOKENS), f"prompt length {len(p)}"
    assert engine.cache.blocks.num_used == 0 and engine.cache.slots.num_used == 0
