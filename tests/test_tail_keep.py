"""The layers past the last cache-writing one run on the sampled tokens only (`pre_norm_stack`'s keep): a prefill
step gets the same logits and writes the same caches as when every token runs every layer, and the tail's linear
layers see one row per sampling row."""

import pytest
import torch

from baton.engine.engine_config import EngineConfig
from baton.engine.llm_engine import LLMEngine
from baton.engine.loader import load_checkpoint
from baton.engine.make_model import make_model
from baton.engine.sampling_params import SamplingParams
from tests.test_spec_decode import new_engine, run, spec_model, staggered  # noqa: F401

# (pattern, the last cache-writing layer, the tail's MLP layers)
PATTERNS = {"M*M-MM*-": (6, [7]), "M-M*-M-M-": (7, [8]), "M*-MMM*": (6, [])}
TRITON_PATTERN = "M-M*-M-M-"  # (27 s a pattern in the interpreter)


@pytest.fixture(scope="module", params=sorted(PATTERNS))
def model(request, tmp_path_factory):
    out = tmp_path_factory.mktemp("tail")
    make_model(out, preset="tiny", seed=7, overrides={"hybrid_override_pattern": request.param}, dtype="float32",
               progress=False)
    return request.param, load_checkpoint(out)


def _caches(engine: LLMEngine) -> list[torch.Tensor]:
    p = engine.pools
    return [t.clone() for t in (*p.kv_layers(), *(t for s in p.states.values() for t in s.unbind(1)))]


@pytest.mark.parametrize("kernels", ["torch", pytest.param("triton", marks=pytest.mark.interpreter)])
def test_tail_runs_on_the_kept_tokens_only(model, kernels):
    pattern, (cfg, weights) = model
    if kernels == "triton":
        pytest.importorskip("triton")
        if pattern != TRITON_PATTERN:
            pytest.skip(f"on the interpreted kernels, one pattern: {TRITON_PATTERN} (its last cache layer a Mamba "
                        f"layer); the torch run covers this one")
    cache_layer, tail = PATTERNS[pattern]
    engine = LLMEngine(cfg, weights, EngineConfig(max_num_batched_tokens=128, max_num_seqs=4, block_size=8,
                                                  kernels=kernels))
    assert engine.model.model.last_cache_layer == cache_layer
    g = torch.Generator().manual_seed(0)
    for n in (5, 17, 40):
        engine.add_request(torch.randint(3, cfg.vocab_size, (n,), generator=g).tolist(), SamplingParams(max_tokens=2))
    out = engine.scheduler.schedule()
    assert len(out.rows) == 3 and all(r.sample for r in out.rows)
    starts = out.token_starts
    keep = torch.tensor([starts[i + 1] - 1 for i in range(3)])
    layers = engine.model.model.layers
    seen: dict[int, int] = {}

    def hook(i):
        def record(module, args):
            seen[i] = args[0].shape[0]
        return record

    handles = [layers[i].mixer.register_forward_pre_hook(hook(i)) for i in tail]
    last = layers[cache_layer].mixer
    proj = last.out_proj if hasattr(last, "out_proj") else last.o_proj
    handles.append(proj.register_forward_pre_hook(hook(-1)))
    with torch.inference_mode():
        ids, batch = engine.runner.build_batch(out)
        full = engine.model(ids, batch)
        seen_full = dict(seen)
        caches = _caches(engine)
        ids, batch = engine.runner.build_batch(out)
        kept = engine.model(ids, batch, keep=keep)
        seen_kept = dict(seen)
        assert all(torch.equal(a, b) for a, b in zip(caches, _caches(engine), strict=True))
        ids, batch = engine.runner.build_batch(out)
        none = engine.model(ids, batch, keep=keep[:0])
    for h in handles:
        h.remove()
    assert kept.shape == (3, cfg.hidden_size) and none.shape == (0, cfg.hidden_size)
    torch.testing.assert_close(engine.model.logits(kept), engine.model.logits(full[keep]), rtol=1e-5, atol=1e-5)
    assert all(torch.equal(a, b) for a, b in zip(caches, _caches(engine), strict=True))  # also with nothing kept
    # The tail and the last cache layer's output projection ran on all 62 tokens, then on the 3 kept ones.
    assert seen_full == {i: 62 for i in (*tail, -1)} and seen_kept == {i: 3 for i in (*tail, -1)}


def _recording(engine: LLMEngine) -> tuple[list[dict], list[int]]:
    """Every step's drafts, and the rows the drafter's last block (its MoE or MLP, past its attention) ran on."""
    drafts: list[dict] = []
    rows: list[int] = []
    execute = engine.runner.execute

    def record(out, return_logits=False):
        res = execute(out, return_logits)
        drafts.append(dict(res.drafts or {}))
        return res

    engine.runner.execute = record
    last = engine.runner.mtp.layers[-1]
    tail = last.mixer if hasattr(last, "mixer") else last.mlp  # NemotronH's MTP block, or Qwen3.5's decoder layer
    tail.register_forward_pre_hook(lambda m, args: rows.append(args[0].shape[0]))
    return drafts, rows


@pytest.mark.parametrize("k", [1, 3])
def test_drafter_tail_runs_on_the_anchors_only(spec_model, k):  # noqa: F811
    """The drafter's catch-up over every position writes its KV there, but only the drafting rows' anchors (a
    verify row's last accepted position, a prefill's last token) go past its attention layer: the same drafts,
    step by step, as a drafter whose every layer runs on every token, with one row per drafting row in its tail."""
    engine = new_engine(spec_model, k)
    drafts, rows = _recording(engine)
    ref = new_engine(spec_model, k)
    ref_drafts, ref_rows = _recording(ref)
    mtp = ref.runner.mtp

    def every_token(*args, keep=None, **kw):  # the whole drafter on every token, then the anchors' outputs
        out = type(mtp).forward(mtp, *args, **kw)
        return out if keep is None else out[keep]

    mtp.forward = every_token
    got, want = run(engine, staggered(k)), run(ref, staggered(k))
    assert {r: o.token_ids for r, o in got.items()} == {r: o.token_ids for r, o in want.items()}
    assert drafts == ref_drafts and sum(len(d) for d in drafts) > 10
    # The catch-up's tail: one row per drafting row (the chain's steps after it: one each too); the reference's
    # took every token of the step, prompt chunks included.
    assert max(rows) <= engine.config.max_num_seqs < max(ref_rows)
    assert sum(rows) < sum(ref_rows)
