"""The MTP drafter against a dense whole-sequence reference, through the paged KV cache (R8)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from baton.engine.forward_batch import ForwardBatch
from baton.engine.loader import load_checkpoint
from baton.engine.make_model import make_model
from baton.engine.model import NemotronHForCausalLM
from baton.engine.mtp import MTPModule
from baton.engine.ops.kernels import resolve_kernels

NUM_BLOCKS, BLOCK_SIZE = 32, 4
SEQ_LENS = (9, 14)  # two requests of N target tokens each: a varlen batch crossing block boundaries
K = 3  # draft steps of the chain test
ATOL = RTOL = 1e-5


@pytest.fixture(scope="module", params=["*E", "*-"])
def ckpt(request, tmp_path_factory):
    """(cfg, state, target, mtp) of a tiny model whose MTP step is attention+MoE, or attention+MLP."""
    out = make_model(tmp_path_factory.mktemp("mtp") / "tiny", "tiny", mtp_layers=1, progress=False,
                     overrides={"mtp_hybrid_override_pattern": request.param}, tokenizer=False)
    cfg, state = load_checkpoint(out)
    target = NemotronHForCausalLM.from_state_dict(cfg, state, "cpu", torch.float32, resolve_kernels("auto", "cpu"))
    mtp = MTPModule.from_state_dict(cfg, state, "cpu", torch.float32, resolve_kernels("auto", "cpu"))
    return cfg, state, target, mtp


# ---- the dense reference: plain torch over one whole sequence, straight from the checkpoint tensors ----

def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def dense_attention(cfg, st: dict, p: str, x: torch.Tensor) -> torch.Tensor:
    """Causal GQA attention of x [S, hidden] over itself: position i sees 0..i."""
    s, hq, hkv, d = x.shape[0], cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    q = (x @ st[f"{p}.q_proj.weight"].T).view(s, hq, d)
    k = (x @ st[f"{p}.k_proj.weight"].T).view(s, hkv, d).repeat_interleave(hq // hkv, dim=1)  # [S, Hq, D]
    v = (x @ st[f"{p}.v_proj.weight"].T).view(s, hkv, d).repeat_interleave(hq // hkv, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * d ** -0.5
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(s, hq * d)
    return out @ st[f"{p}.o_proj.weight"].T


def reference(cfg, st: dict, mtp: MTPModule, emb: torch.Tensor, hidden: torch.Tensor,
              next_ids: torch.Tensor) -> torch.Tensor:
    """Drafter outputs [S, hidden] at positions 0..S-1 from h_i = hidden[i], t_{i+1} = next_ids[i]."""
    eps = cfg.layer_norm_epsilon
    e = emb[next_ids]  # [S, hidden]
    x = torch.cat([rms(e, st["mtp.layers.0.enorm.weight"], eps), rms(hidden, st["mtp.layers.0.hnorm.weight"], eps)],
                  dim=-1) @ st["mtp.layers.0.eh_proj.weight"].T
    for j, symbol in enumerate(cfg.mtp_layer_types):
        p = f"mtp.layers.{j}"
        y = rms(x, st[f"{p}.norm.weight"], eps)
        if symbol == "*":
            x = x + dense_attention(cfg, st, f"{p}.mixer", y)
        elif symbol == "-":
            x = x + torch.relu(y @ st[f"{p}.mixer.up_proj.weight"].T).square() @ st[f"{p}.mixer.down_proj.weight"].T
        else:
            # MoE is token-wise (no cache involved) and checked against HF elsewhere; reuse the module's mixer.
            x = x + mtp.layers[j].mixer(y)
    return rms(x, st[f"mtp.layers.{len(cfg.mtp_layer_types) - 1}.final_layernorm.weight"], eps)


# ---- paged batches ---------------------------------------------------------------------------------------

def block_tables(g: torch.Generator) -> torch.Tensor:
    """Scattered, non-ascending blocks per request, padded with -1."""
    free = torch.randperm(NUM_BLOCKS, generator=g).tolist()
    max_blocks = -(-(max(SEQ_LENS) + K) // BLOCK_SIZE)
    bt = torch.full((len(SEQ_LENS), max_blocks), -1, dtype=torch.int64)
    for r in range(len(SEQ_LENS)):
        for b in range(max_blocks):
            bt[r, b] = free.pop()
    return bt


def batch_for(rows: list[tuple[int, int]], bt: torch.Tensor, kv: list[torch.Tensor], decode: bool) -> ForwardBatch:
    """rows[r] = (first position, number of positions) of request r this step."""
    slots = [int(bt[r, p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE
             for r, (lo, n) in enumerate(rows) for p in range(lo, lo + n)]
    qsl = torch.tensor([0] + [n for _, n in rows]).cumsum(0)
    return ForwardBatch(
        num_decodes=len(rows) if decode else 0, query_start_loc=qsl,
        seq_lens=torch.tensor([lo + n for lo, n in rows]), block_tables=bt, slot_mapping=torch.tensor(slots),
        state_slots=torch.zeros(len(rows), dtype=torch.int64), has_initial_state=torch.ones(len(rows), dtype=torch.bool),
        kv_caches=kv, mixer_states=[])


def new_kv(cfg, mtp: MTPModule) -> list[torch.Tensor]:
    return [torch.zeros(NUM_BLOCKS, 2, BLOCK_SIZE, cfg.num_key_value_heads, cfg.head_dim)
            for _ in range(mtp.num_kv_layers)]


def inputs(cfg, seed: int = 0) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per request: target hidden states h_0..h_{N-1} [N, hidden] (post-norm_f-like) and tokens t_0..t_N."""
    g = torch.Generator().manual_seed(seed)
    hidden = [torch.randn(n, cfg.hidden_size, generator=g) for n in SEQ_LENS]
    tokens = [torch.randint(0, cfg.vocab_size, (n + 1,), generator=g) for n in SEQ_LENS]
    return hidden, tokens


# ---- tests ---------------------------------------------------------------------------------------------

def test_names_match_checkpoint_exactly(ckpt):
    cfg, state, _, mtp = ckpt
    assert {f"mtp.{k}" for k in mtp.state_dict()} == {k for k in state if k.startswith("mtp.")}
    assert mtp.num_kv_layers == 1
    fresh = MTPModule(cfg)
    fresh.load(state)  # in place, strict
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, state[f"mtp.{k}"]), k


def test_missing_and_unexpected_weights_are_listed(ckpt):
    cfg, state, _, _ = ckpt
    bad = {k: v for k, v in state.items() if k != "mtp.layers.0.eh_proj.weight"}
    bad["mtp.layers.9.norm.weight"] = torch.ones(cfg.hidden_size)
    with pytest.raises(ValueError, match=r"mtp\.layers\.0\.eh_proj\.weight.*mtp\.layers\.9\.norm\.weight"):
        MTPModule.from_state_dict(cfg, bad, "cpu", torch.float32, resolve_kernels("auto", "cpu"))


def test_prefill_of_positions_0_to_n_minus_2_matches_dense(ckpt):
    """R8: the prefill node's one pass over positions 0..N-2 (h_i, t_{i+1}) of a varlen batch."""
    cfg, state, target, mtp = ckpt
    emb = target.model.embeddings
    hidden, tokens = inputs(cfg)
    bt, kv = block_tables(torch.Generator().manual_seed(1)), new_kv(cfg, mtp)
    batch = batch_for([(0, n - 1) for n in SEQ_LENS], bt, kv, decode=False)
    out = mtp(torch.cat([h[:-1] for h in hidden]), torch.cat([t[1:-1] for t in tokens]), emb, batch)
    refs = [reference(cfg, state, mtp, emb.weight, h[:-1], t[1:-1]) for h, t in zip(hidden, tokens, strict=True)]
    torch.testing.assert_close(out, torch.cat(refs), atol=ATOL, rtol=RTOL)


def test_prefix_then_one_position_at_a_time_reads_the_cache(ckpt):
    """A prefill chunk, then decode rows of one position each, attending over the cached drafter KV."""
    cfg, state, target, mtp = ckpt
    emb = target.model.embeddings
    hidden, tokens = inputs(cfg, seed=2)
    bt, kv = block_tables(torch.Generator().manual_seed(3)), new_kv(cfg, mtp)
    prefix = 3
    pieces: list[list[torch.Tensor]] = [[] for _ in SEQ_LENS]
    out = mtp(torch.cat([h[:prefix] for h in hidden]), torch.cat([t[1:prefix + 1] for t in tokens]), emb,
              batch_for([(0, prefix)] * len(SEQ_LENS), bt, kv, decode=False))
    for r in range(len(SEQ_LENS)):
        pieces[r].append(out[r * prefix:(r + 1) * prefix])
    for pos in range(prefix, max(SEQ_LENS)):
        live = [r for r, n in enumerate(SEQ_LENS) if pos < n]  # the shorter request finishes first
        sub_bt = bt[live]
        out = mtp(torch.stack([hidden[r][pos] for r in live]), torch.stack([tokens[r][pos + 1] for r in live]), emb,
                  batch_for([(pos, 1)] * len(live), sub_bt, kv, decode=True))
        for i, r in enumerate(live):
            pieces[r].append(out[i:i + 1])
    for r, (h, t) in enumerate(zip(hidden, tokens, strict=True)):
        torch.testing.assert_close(torch.cat(pieces[r]), reference(cfg, state, mtp, emb.weight, h, t[1:]),
                                   atol=ATOL, rtol=RTOL)


def test_k_step_draft_chain_matches_dense_chain(ckpt):
    """Prefill 0..N-2, then K draft steps reusing the same weights: step k at position N-1+k feeds its own
    post-final_layernorm output and its drafted token to step k+1."""
    cfg, state, target, mtp = ckpt
    emb = target.model.embeddings
    hidden, tokens = inputs(cfg, seed=4)
    bt, kv = block_tables(torch.Generator().manual_seed(5)), new_kv(cfg, mtp)
    mtp(torch.cat([h[:-1] for h in hidden]), torch.cat([t[1:-1] for t in tokens]), emb,
        batch_for([(0, n - 1) for n in SEQ_LENS], bt, kv, decode=False))
    # Step 0 reads the target's h_{N-1} and its sampled token t_N.
    h = torch.stack([x[-1] for x in hidden])
    ids = torch.stack([t[-1] for t in tokens])
    drafts, outs = [], []
    for k in range(K):
        h = mtp(h, ids, emb, batch_for([(n - 1 + k, 1) for n in SEQ_LENS], bt, kv, decode=True), step=k)
        ids = target.logits(h).argmax(-1)
        outs.append(h)
        drafts.append(ids)

    for r, n in enumerate(SEQ_LENS):
        seq_h, seq_t = hidden[r], tokens[r][1:]  # h_0..h_{N-1}; t_1..t_N
        for k in range(K):
            ref = reference(cfg, state, mtp, emb.weight, seq_h, seq_t)[-1]
            torch.testing.assert_close(outs[k][r], ref, atol=ATOL, rtol=RTOL)
            draft = target.logits(ref[None]).argmax(-1)
            assert int(drafts[k][r]) == int(draft)
            seq_h, seq_t = torch.cat([seq_h, ref[None]]), torch.cat([seq_t, draft])
        assert seq_h.shape[0] == n + K


def test_kv_written_only_at_the_requests_positions(ckpt):
    """The drafter's KV for position i lands in the slot of the target's token i, in the MTP's own pool."""
    cfg, _, target, mtp = ckpt
    hidden, tokens = inputs(cfg, seed=6)
    bt, kv = block_tables(torch.Generator().manual_seed(7)), new_kv(cfg, mtp)
    batch = batch_for([(0, n - 1) for n in SEQ_LENS], bt, kv, decode=False)
    mtp(torch.cat([h[:-1] for h in hidden]), torch.cat([t[1:-1] for t in tokens]), target.model.embeddings, batch)
    written = kv[0].abs().sum(dim=(1, 3, 4)).ne(0).flatten()  # [num_blocks * block_size]
    expected = torch.zeros_like(written)
    expected[batch.slot_mapping] = True
    assert torch.equal(written, expected)


def test_with_kv_caches_keeps_metadata():
    cfg_batch = batch_for([(0, 2)], torch.tensor([[0]]), [], decode=False)
    pool = [torch.zeros(1, 2, BLOCK_SIZE, 1, 1)]
    b = MTPModule.with_kv_caches(cfg_batch, pool)
    assert b.kv_caches is pool and torch.equal(b.slot_mapping, cfg_batch.slot_mapping)


def test_bad_mtp_pattern_and_no_mtp_layers_raise(ckpt):
    cfg = ckpt[0]
    with pytest.raises(ValueError, match="mtp_hybrid_override_pattern"):
        MTPModule(dataclasses.replace(cfg, mtp_layer_types=("*", "M")))
    with pytest.raises(ValueError, match="num_nextn_predict_layers"):
        MTPModule(dataclasses.replace(cfg, num_nextn_predict_layers=0))
