"""The Qwen3.5 MTP drafter against a dense reference built from HF transformers' own modules (HF does not load
`mtp.*`): the drafts the engine makes after a prompt's prefill, K of them chained, equal the reference's.

The reference, per vLLM's `Qwen3_5MultiTokenPredictor`: h = HF's final hidden states (after `model.norm`) over the
prompt; the drafter's input at position i is (h_i, t_{i+1}), t_N the target's greedy token; x = fc(cat(
pre_fc_norm_embedding(embed(t)), pre_fc_norm_hidden(h))); an HF `Qwen3_5DecoderLayer` (full attention, causal, RoPE
at the positions) carrying `mtp.layers.0.*`; then `mtp.norm` and the target's lm_head. Draft k+1 comes from the
drafter's own output at the next position, fed the draft k token, attending to all positions before it.
"""

import pytest
import torch

from baton.engine.engine_config import EngineConfig
from baton.engine.llm_engine import LLMEngine
from baton.engine.loader import load_checkpoint
from baton.engine.make_model import make_model
from baton.engine.sampling_params import SamplingParams
from tests.test_spec_decode import Log

transformers = pytest.importorskip("transformers")
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf_qwen  # noqa: E402

K = 3


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    out = tmp_path_factory.mktemp("qwen-mtp") / "m"
    make_model(out, preset="qwen3.5-tiny", mtp_layers=1, seed=21, progress=False, tokenizer=False)
    cfg, weights = load_checkpoint(out)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    return cfg, weights, hf


class DenseDrafter:
    """The reference drafter from HF modules, loaded with the checkpoint's `mtp.*` tensors."""

    def __init__(self, hf, weights: dict[str, torch.Tensor]) -> None:
        config = hf.config.__class__(**{**hf.config.to_dict(), "layer_types": ["full_attention"],
                                        "num_hidden_layers": 1})
        config._attn_implementation = "eager"
        self.layer = hf_qwen.Qwen3_5DecoderLayer(config, 0).eval()
        self.layer.load_state_dict({k[len("mtp.layers.0."):]: v for k, v in weights.items()
                                    if k.startswith("mtp.layers.0.")})
        h, eps = config.hidden_size, config.rms_norm_eps
        self.norms = {}
        for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
            n = hf_qwen.Qwen3_5RMSNorm(h, eps)
            n.load_state_dict({"weight": weights[f"mtp.{name}.weight"]})
            self.norms[name] = n
        self.fc = weights["mtp.fc.weight"]
        self.rotary = hf_qwen.Qwen3_5TextRotaryEmbedding(config)
        self.hf = hf

    @torch.inference_mode()
    def __call__(self, hidden: torch.Tensor, next_ids: list[int]) -> torch.Tensor:
        """Drafter outputs [S, hidden] for inputs (hidden[i], next_ids[i]) at positions 0..S-1."""
        s = hidden.shape[0]
        e = self.hf.model.embed_tokens(torch.tensor(next_ids))
        x = torch.cat([self.norms["pre_fc_norm_embedding"](e), self.norms["pre_fc_norm_hidden"](hidden)], -1)
        x = (x @ self.fc.T)[None]
        pos = torch.arange(s)[None]
        mask = torch.full((s, s), float("-inf")).triu(1)[None, None]
        out = self.layer(x, position_embeddings=self.rotary(x, pos), attention_mask=mask, position_ids=pos)
        out = out[0] if isinstance(out, tuple) else out
        return self.norms["norm"](out[0])

    @torch.inference_mode()
    def drafts(self, prompt: list[int], first: int, k: int) -> list[int]:
        """K chained drafts after a prompt whose greedy next token is `first`."""
        h = self.hf.model(input_ids=torch.tensor([prompt])).last_hidden_state[0]
        hidden, ids, out = h, [*prompt[1:], first], []
        for _ in range(k):
            y = self(hidden, ids)
            tok = int(self.hf.lm_head(y[-1]).argmax())
            out.append(tok)
            hidden, ids = torch.cat([hidden, y[-1:]]), [*ids, tok]
        return out


def test_drafts_after_prefill_equal_the_dense_reference(checkpoint):
    cfg, weights, hf = checkpoint
    ref = DenseDrafter(hf, weights)
    engine = LLMEngine(cfg, weights, EngineConfig(num_speculative_tokens=K, block_size=8, max_num_seqs=4,
                                                  max_num_batched_tokens=256, num_kv_blocks=64))
    log = Log(engine)
    g = torch.Generator().manual_seed(3)
    prompts = {f"p{n}": torch.randint(3, cfg.vocab_size, (n,), generator=g).tolist() for n in (1, 5, 17, 40)}
    for rid, p in prompts.items():
        engine.add_request(p, SamplingParams(max_tokens=4, ignore_eos=True), request_id=rid)
    while engine.has_unfinished():
        engine.step()
    for rid, p in prompts.items():
        first_row = log.rows[rid][0]  # the whole prompt in one prefill row: its sampled token, then its drafts
        (token,), drafts = first_row[3], first_row[4]
        assert len(drafts) == K
        assert list(drafts) == ref.drafts(p, token, K), f"prompt length {len(p)}"
