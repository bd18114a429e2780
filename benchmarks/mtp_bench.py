"""MTP speculative-decoding benchmark (issue #5 item 7): train a small NemotronH checkpoint, target model and
MTP head together, on the Python standard library's sources, then measure greedy decoding with K = 0..4
draft tokens per step.

1. Corpus: every `.py` file under `sysconfig.get_paths()["stdlib"]` (site-packages excluded), sorted by
   path, read until `--corpus-mb`; every `--holdout-every`-th file is held out (prompts, eval loss).
   Tokenized with the byte-level BPE that `make_model` ships with the checkpoint (`tokenizer_train`).
2. Model: `make_model`'s random checkpoint is the initialisation; its tensors, under their checkpoint names,
   are the trained parameters. The training forward below is plain differentiable torch over dense
   [B, L] batches and computes exactly what the engine computes (Mamba2 as the chunked SSD scan in fp32,
   causal GQA attention without positions, relu2 MLPs, fp32 RMSNorms), plus the MTP head at draft step 0
   as `engine/mtp.py` defines it: input (h_i after `norm_f`, t_{i+1}), target t_{i+2}.
   Loss = CE(target) + `--mtp-weight` * CE(MTP).
3. AdamW, bf16 autocast on CUDA (fp32 on CPU), for `--steps` or `--seconds`, whichever ends first.
4. The checkpoint is saved (same config.json and tokenizer, trained safetensors), loaded back with
   `load_checkpoint`, and the engine's prefill logits of a held-out sequence, target and MTP head at every
   position, must match the training forward's (fp32, `--check-tol` relative to the largest logit).
5. For each K in 0..`--k-max`: one `LLMEngine` with `num_speculative_tokens=K` greedily decodes the same
   `--prompts` held-out prompts for `--max-tokens` tokens each (all together, `ignore_eos`); reported:
   output tokens/s over the whole run, tokens/s over the pure decode steps, mean acceptance length,
   accepted/drafted, and how many outputs differ from K = 0 (must be none in fp32).
6. SSM state dtype (issue #7 item 1; `--no-state-dtype` skips it): the K = 0 engine in `--dtype` with a
   float32 SSM state pool against `--state-dtypes` (bfloat16, float16). Teacher-forced through the decode
   path: `--state-windows` held-out windows of `--state-window` tokens, `--state-prefix` prefilled, every
   later token fed by a decode step (the state is rounded to the pool dtype after each), reporting held-out
   NLL and perplexity in both, max / mean |Δlogit| relative to the largest logit, KL(p_fp32 ‖ p_low) and
   argmax agreement; free-running: the benchmark prompts greedily decoded `--state-greedy-tokens` tokens,
   how many are identical and where the others first differ. `--json PATH` writes all numbers.

  python benchmarks/mtp_bench.py --device cuda                 # ~3 min of training on one GPU, then K = 0..4
  python benchmarks/mtp_bench.py --device cpu                  # tiny model, under a minute
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import sysconfig
import time
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from tqdm import tqdm

from baton.engine.config import ATTENTION, MAMBA, MOE, ModelConfig
from baton.engine.config import MLP as MLP_SYMBOL
from baton.engine.engine_config import EngineConfig
from baton.engine.layers.mlp import activation
from baton.engine.llm_engine import EngineStats, LLMEngine
from baton.engine.loader import load_checkpoint
from baton.engine.make_model import make_model, parse_overrides
from baton.engine.mtp import MTPModule
from baton.engine.ops.act.reference import relu2_reference
from baton.engine.sampling_params import SamplingParams
from baton.engine.tokenizer import load_tokenizer
from baton.engine.weights import SINGLE_FILE, TORCH_DTYPES

# `python benchmarks/X.py` puts only benchmarks/ on the path; the shared helpers are imported as a package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.run_info import device_name, git_commit  # noqa: E402

Params = Mapping[str, torch.Tensor]

# Model shapes per --preset (make_model preset + overrides). "small": 8 layers, hidden 512, ~20M parameters.
MODEL_PRESETS: dict[str, tuple[str, dict]] = {
    "tiny": ("tiny", {}),
    "small": ("small", {"hybrid_override_pattern": "M*M-M*M-", "vocab_size": 4096}),
}
DEFAULTS = {
    # device -> flag defaults (None flags take these)
    "cuda": {"preset": "small", "steps": 100_000, "seconds": 180.0, "seq_len": 512, "batch_size": 32,
             "lr": 1e-3, "warmup": 100, "corpus_mb": 64.0, "prompts": 16, "prompt_len": 128,
             "max_tokens": 128, "dtype": "bfloat16", "log_every": 100, "state_windows": 32},
    "cpu": {"preset": "tiny", "steps": 60, "seconds": None, "seq_len": 64, "batch_size": 8,
            "lr": 3e-3, "warmup": 5, "corpus_mb": 1.0, "prompts": 4, "prompt_len": 32,
            "max_tokens": 32, "dtype": "float32", "log_every": 10, "state_windows": 4},
}
SKIP_DIRS = {"site-packages", "dist-packages"}


# ---- corpus ---------------------------------------------------------------------------------------------

def stdlib_sources(max_bytes: int, holdout_every: int) -> tuple[list[str], list[str]]:
    """(training texts, held-out texts): the interpreter's stdlib `.py` files in path order, up to
    `max_bytes` in all; file number i is held out when i % holdout_every == holdout_every - 1."""
    root = Path(sysconfig.get_paths()["stdlib"])
    paths = sorted((p for p in root.rglob("*.py") if not SKIP_DIRS & set(p.relative_to(root).parts)),
                   key=lambda p: p.relative_to(root).as_posix())
    train, held, used = [], [], 0
    for p in paths:
        if used >= max_bytes:
            break
        try:
            text = p.read_bytes().decode("utf-8")
        except (OSError, UnicodeDecodeError):  # a few test data files are not UTF-8
            continue
        if not text.strip():
            continue
        used += len(text)
        (held if (len(train) + len(held)) % holdout_every == holdout_every - 1 else train).append(text)
    if not train or not held:
        raise ValueError(f"corpus: expected training and held-out files under {root} within {max_bytes} bytes, "
                         f"got {len(train)} and {len(held)}")
    return train, held


def token_stream(texts: list[str], tokenizer, eos_id: int) -> torch.Tensor:
    """All texts' tokens, each text followed by EOS: [N] int64."""
    ids: list[int] = []
    for enc in tokenizer.tokenizer.encode_batch(texts, add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(eos_id)
    return torch.tensor(ids, dtype=torch.int64)


# ---- the training forward: the engine's math, dense and differentiable ----------------------------------

def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """`layers.norms.RMSNorm`: fp32 statistics, weight in fp32, result in x's dtype."""
    x32 = x.float()
    return (w.float() * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps))).to(x.dtype)


def _segment_sum(a: torch.Tensor) -> torch.Tensor:
    """[..., l] -> [..., l, l]: (l, s) = a[s+1] + ... + a[l] for s <= l, -inf above the diagonal (exact sums
    of the masked steps, as `ops.chunk_scan.reference` computes them)."""
    n = a.shape[-1]
    ones = torch.ones(n, n, dtype=torch.bool, device=a.device)
    terms = a[..., :, None].expand(*a.shape, n).masked_fill(~torch.tril(ones, diagonal=-1), 0.0)
    return terms.cumsum(dim=-2).masked_fill(~torch.tril(ones), float("-inf"))


def ssd_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
             chunk_size: int) -> torch.Tensor:
    """Mamba2 chunked scan from a zero state, batched: x [b, L, H, P], dt [b, L, H] discretized, A [H],
    B, C [b, L, G, N], all fp32. Returns y without the D skip [b, L, H, P]. Chunks start at token 0, as in
    the engine's prefill of a whole sequence.

    Recurrence per head: s_t = exp(dt_t A) s_{t-1} + dt_t x_t B_t^T, y_t = s_t C_t.
    """
    b, length, H, P = x.shape
    G, N = B.shape[2], B.shape[3]
    J = H // G
    cs = min(chunk_size, length)
    nc = -(-length // cs)
    pad = nc * cs - length
    # Padding tokens: dt = 0, so no input and no decay.
    xdt = F.pad(x * dt[..., None], (0, 0, 0, 0, 0, pad)).view(b, nc, cs, G, J, P)
    a = F.pad(dt * A, (0, 0, 0, pad)).view(b, nc, cs, G, J)
    B = F.pad(B, (0, 0, 0, 0, 0, pad)).view(b, nc, cs, G, N)
    C = F.pad(C, (0, 0, 0, 0, 0, pad)).view(b, nc, cs, G, N)

    decay = torch.exp(_segment_sum(a.permute(0, 1, 3, 4, 2)))  # [b, c, G, J, l, s]
    CB = torch.einsum("bclgn,bcsgn->bcgls", C, B)  # [b, c, G, l, s]
    y = torch.einsum("bcgjls,bcsgjp->bclgjp", CB[:, :, :, None] * decay, xdt)  # intra-chunk
    decay_to_end = decay[..., -1, :].permute(0, 1, 4, 2, 3)  # [b, c, s, G, J]
    chunk_states = torch.einsum("bcsgjp,bcsgn->bcgjpn", xdt * decay_to_end[..., None], B)  # [b, c, G, J, P, N]
    chunk_decay = torch.exp(a.sum(dim=2))  # [b, c, G, J]
    state = x.new_zeros(b, G, J, P, N)
    starts = []
    for c in range(nc):
        starts.append(state)
        state = chunk_decay[:, c, :, :, None, None] * state + chunk_states[:, c]
    start = torch.stack(starts, dim=1)  # [b, c, G, J, P, N]
    decay_from_start = torch.exp(a.cumsum(dim=2))  # [b, c, l, G, J]
    y = y + torch.einsum("bclgn,bcgjpn->bclgjp", C, start) * decay_from_start[..., None]
    return y.reshape(b, nc * cs, H, P)[:, :length]


def mamba_mixer(p: Params, pre: str, cfg: ModelConfig, x: torch.Tensor) -> torch.Tensor:
    """`layers.mamba2.Mamba2Mixer` on a dense batch x [b, L, hidden], every row starting from zero state."""
    b, length, _ = x.shape
    inner, conv_dim, H = cfg.mamba_intermediate_size, cfg.conv_dim, cfg.mamba_num_heads
    P, G, N = cfg.mamba_head_dim, cfg.n_groups, cfg.ssm_state_size
    gate, xbc, dt = F.linear(x, p[pre + "in_proj.weight"], p.get(pre + "in_proj.bias")).split(
        [inner, conv_dim, H], dim=-1)
    w = p[pre + "conv1d.weight"]  # [C, 1, K]: out_t = silu(bias + sum_k w[k] u[t-(K-1)+k])
    xbc = F.conv1d(F.pad(xbc.transpose(1, 2), (w.shape[-1] - 1, 0)), w, p.get(pre + "conv1d.bias"),
                   groups=conv_dim)
    xbc = F.silu(xbc).transpose(1, 2)  # [b, L, C]
    xs, Bm, Cm = xbc.split([inner, G * N, G * N], dim=-1)
    with torch.autocast(x.device.type, enabled=False):  # the scan runs in fp32, as the engine's
        xs32 = xs.float().reshape(b, length, H, P)
        dt32 = F.softplus(dt.float() + p[pre + "dt_bias"].float()).clamp(min=cfg.time_step_min)
        A = -torch.exp(p[pre + "A_log"].float())
        y = ssd_scan(xs32, dt32, A, Bm.float().reshape(b, length, G, N), Cm.float().reshape(b, length, G, N),
                     cfg.chunk_size)
        y = y + p[pre + "D"].float()[:, None] * xs32
        # GatedRMSNorm: norm(y * silu(gate)) per group of inner // n_groups channels.
        y = y.to(x.dtype).reshape(b, length, inner).float() * F.silu(gate.float())
        g = y.view(b, length, G, inner // G)
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + cfg.layer_norm_epsilon)
        y = p[pre + "norm.weight"] * g.view(b, length, inner).to(x.dtype)
    return F.linear(y.to(x.dtype), p[pre + "out_proj.weight"], p.get(pre + "out_proj.bias"))


def attention_mixer(p: Params, pre: str, cfg: ModelConfig, x: torch.Tensor) -> torch.Tensor:
    """`layers.attention.Attention`: causal GQA, no positional embedding."""
    b, length, _ = x.shape
    hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    q = F.linear(x, p[pre + "q_proj.weight"]).view(b, length, hq, d).transpose(1, 2)
    k = F.linear(x, p[pre + "k_proj.weight"]).view(b, length, hkv, d).transpose(1, 2)
    v = F.linear(x, p[pre + "v_proj.weight"]).view(b, length, hkv, d).transpose(1, 2)
    # Query head h reads KV head h // (hq // hkv): repeat_interleave, what enable_gqa does.
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=d ** -0.5, enable_gqa=hq != hkv)
    return F.linear(o.transpose(1, 2).reshape(b, length, hq * d), p[pre + "o_proj.weight"])


def mlp_mixer(p: Params, pre: str, cfg: ModelConfig, x: torch.Tensor) -> torch.Tensor:
    # relu2 is an engine op (None here): training differentiates through its torch reference.
    act = activation(cfg.mlp_hidden_act) or relu2_reference
    return F.linear(act(F.linear(x, p[pre + "up_proj.weight"], p.get(pre + "up_proj.bias"))),
                    p[pre + "down_proj.weight"], p.get(pre + "down_proj.bias"))


def mixer(symbol: str, p: Params, pre: str, cfg: ModelConfig, x: torch.Tensor) -> torch.Tensor:
    if symbol == MAMBA:
        return mamba_mixer(p, pre, cfg, x)
    if symbol == ATTENTION:
        return attention_mixer(p, pre, cfg, x)
    if symbol == MLP_SYMBOL:
        return mlp_mixer(p, pre, cfg, x)
    raise ValueError(f"training forward: layer {pre!r} of type {symbol!r} is not supported (no MoE 'E'); "
                     f"pick a pattern of M, * and -")


def check_trainable(cfg: ModelConfig) -> None:
    if MOE in cfg.layer_types or MOE in cfg.mtp_layer_types:
        raise ValueError(f"training forward: MoE ('E') layers are not supported; got hybrid_override_pattern "
                         f"{cfg.pattern!r}, mtp_hybrid_override_pattern {''.join(cfg.mtp_layer_types)!r}")
    if cfg.num_nextn_predict_layers != 1:
        raise ValueError(f"training forward: expected num_nextn_predict_layers = 1, got "
                         f"{cfg.num_nextn_predict_layers}")


def lm_head(p: Params, cfg: ModelConfig) -> torch.Tensor:
    return p["model.embeddings.weight"] if cfg.tie_word_embeddings else p["lm_head.weight"]


def train_forward(p: Params, cfg: ModelConfig, ids: torch.Tensor, with_mtp: bool = True
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """ids [b, L] -> (target logits [b, L, V], MTP step-0 logits [b, L-1, V] or None).

    MTP position i reads h_i (after norm_f) and t_{i+1} and predicts t_{i+2}; its attention is causal over
    the MTP stream's own positions 0..i (the drafter's KV, DESIGN R8).
    """
    eps = cfg.layer_norm_epsilon
    emb = p["model.embeddings.weight"]
    h = F.embedding(ids, emb)
    for i, symbol in enumerate(cfg.layer_types):
        pre = f"model.layers.{i}."
        h = h + mixer(symbol, p, pre + "mixer.", cfg, rms_norm(h, p[pre + "norm.weight"], eps))
    h = rms_norm(h, p["model.norm_f.weight"], eps)
    head = lm_head(p, cfg)
    logits = F.linear(h, head)
    if not with_mtp:
        return logits, None
    first = "mtp.layers.0."
    e = F.embedding(ids[:, 1:], emb)
    x = F.linear(torch.cat([rms_norm(e, p[first + "enorm.weight"], eps),
                            rms_norm(h[:, :-1], p[first + "hnorm.weight"], eps)], dim=-1),
                 p[first + "eh_proj.weight"])
    for j, symbol in enumerate(cfg.mtp_layer_types):
        pre = f"mtp.layers.{j}."
        x = x + mixer(symbol, p, pre + "mixer.", cfg, rms_norm(x, p[pre + "norm.weight"], eps))
    x = rms_norm(x, p[f"mtp.layers.{len(cfg.mtp_layer_types) - 1}.final_layernorm.weight"], eps)
    return logits, F.linear(x, head)


def losses(p: Params, cfg: ModelConfig, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(target CE, MTP CE, MTP-vs-target agreement) over ids [b, L]. Agreement: how often the MTP head's
    argmax at position i equals the target's argmax at position i+1 (what greedy verification accepts)."""
    logits, mtp = train_forward(p, cfg, ids)
    V = logits.shape[-1]
    target = F.cross_entropy(logits[:, :-1].float().reshape(-1, V), ids[:, 1:].reshape(-1))
    mtp_loss = F.cross_entropy(mtp[:, :-1].float().reshape(-1, V), ids[:, 2:].reshape(-1))
    agree = (mtp[:, :-1].argmax(-1) == logits[:, 1:-1].argmax(-1)).float().mean()
    return target, mtp_loss, agree.detach()


# ---- checkpoint --------------------------------------------------------------------------------------------

def init_checkpoint(out: Path, preset: str, overrides: Mapping, seed: int = 0) -> tuple[ModelConfig, dict]:
    """make_model's random checkpoint (config.json, safetensors, tokenizer) in `out`; its fp32 tensors."""
    base, extra = MODEL_PRESETS[preset]
    make_model(out, base, mtp_layers=1, seed=seed, overrides={**extra, **overrides}, dtype="float32",
               progress=False, tokenizer=True)
    cfg, weights = load_checkpoint(out, "float32")
    check_trainable(cfg)
    return cfg, weights


def save_weights(out: Path, params: Params) -> None:
    """The trained tensors, under their checkpoint names, over make_model's `model.safetensors`."""
    save_file({k: v.detach().float().cpu().contiguous() for k, v in params.items()}, str(out / SINGLE_FILE),
              metadata={"format": "pt"})


# ---- training ----------------------------------------------------------------------------------------------

@dataclass
class TrainResult:
    steps: int = 0
    seconds: float = 0.0
    tokens: int = 0
    history: list[tuple[int, float, float]] = field(default_factory=list)  # (step, target CE, MTP CE)


def batches(stream: torch.Tensor, batch_size: int, seq_len: int, gen: torch.Generator,
            device: torch.device) -> Iterator[torch.Tensor]:
    """Random windows [b, seq_len] of the token stream, forever."""
    if stream.numel() <= seq_len:
        raise ValueError(f"corpus: {stream.numel()} training tokens, expected more than --seq-len {seq_len}")
    stream = stream.to(device)
    offsets = torch.arange(seq_len, device=device)
    while True:
        starts = torch.randint(0, stream.numel() - seq_len, (batch_size,), generator=gen).to(device)
        yield stream[starts[:, None] + offsets]


def autocast(device: torch.device) -> contextlib.AbstractContextManager:
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()


def train(params: dict[str, torch.Tensor], cfg: ModelConfig, stream: torch.Tensor, *, steps: int,
          seconds: float | None, batch_size: int, seq_len: int, lr: float, warmup: int, mtp_weight: float,
          device: torch.device, log_every: int = 50, seed: int = 0, progress: bool = True) -> TrainResult:
    """AdamW on `params` in place (fp32 master weights; bf16 autocast on CUDA); cosine decay to lr/10 over
    whichever budget, steps or seconds, runs out first."""
    decay = [v for k, v in params.items() if v.dim() >= 2]
    no_decay = [v for k, v in params.items() if v.dim() < 2]  # norms, biases, A_log, D, dt_bias
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda")
    gen = torch.Generator().manual_seed(seed)
    data = batches(stream, batch_size, seq_len, gen, device)
    res = TrainResult()
    # The bar counts steps, or seconds when a time budget is set (it usually ends first).
    timed = seconds is not None
    bar = tqdm(total=seconds if timed else steps, desc="train", unit="s" if timed else "step",
               disable=not progress, dynamic_ncols=True,
               bar_format="{l_bar}{bar}| {n:.0f}/{total:.0f} s [{elapsed}<{remaining}{postfix}]" if timed else None)
    t0 = time.perf_counter()
    win_t, win_tok = t0, 0
    for step in range(steps):
        elapsed = time.perf_counter() - t0
        if seconds is not None and elapsed >= seconds:
            break
        frac = max(step / steps, elapsed / seconds if seconds else 0.0)
        scale = min(1.0, (step + 1) / max(1, warmup)) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))
        for group in opt.param_groups:
            group["lr"] = lr * scale
        ids = next(data)
        with autocast(device):
            target, mtp_loss, _ = losses(params, cfg, ids)
            loss = target + mtp_weight * mtp_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(params.values()), 1.0)
        opt.step()
        res.steps, res.tokens = step + 1, res.tokens + ids.numel()
        win_tok += ids.numel()
        if step % log_every == 0 or step == steps - 1:
            t, m = target.item(), mtp_loss.item()
            res.history.append((step, t, m))
            now = time.perf_counter()
            tqdm.write(f"step {step:6d}  loss {t:.4f}  mtp loss {m:.4f}  lr {lr * scale:.2e}  "
                       f"{win_tok / max(now - win_t, 1e-9):,.0f} tok/s")
            win_t, win_tok = now, 0
            bar.set_postfix(step=step, loss=f"{t:.3f}", mtp=f"{m:.3f}")
        bar.update(min(seconds, time.perf_counter() - t0) - bar.n if timed else 1)
    bar.close()
    if device.type == "cuda":
        torch.cuda.synchronize()
    res.seconds = time.perf_counter() - t0
    return res


@torch.no_grad()
def evaluate(params: Params, cfg: ModelConfig, stream: torch.Tensor, seq_len: int, batch_size: int,
             device: torch.device, max_batches: int = 4) -> tuple[float, float, float]:
    """Held-out (target CE, MTP CE, MTP/target argmax agreement) over evenly spaced windows."""
    n = min(max_batches * batch_size, max(1, (stream.numel() - 1) // seq_len))
    starts = torch.linspace(0, stream.numel() - seq_len - 1, n).long()
    windows = torch.stack([stream[s:s + seq_len] for s in starts.tolist()]).to(device)
    out = torch.zeros(3)
    count = 0
    for i in range(0, n, batch_size):
        ids = windows[i:i + batch_size]
        with autocast(device):
            t, m, a = losses(params, cfg, ids)
        out += torch.tensor([t.item(), m.item(), a.item()]) * ids.shape[0]
        count += ids.shape[0]
    return tuple((out / count).tolist())


# ---- correctness against the engine ------------------------------------------------------------------------

@contextlib.contextmanager
def exact_fp32() -> Iterator[None]:
    """No TF32 anywhere while comparing fp32 results."""
    old = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def engine_logits(cfg: ModelConfig, weights: Params, seq: list[int], device: torch.device
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The engine's fp32 prefill of seq[:-1] in one chunk: (target logits [N, V], MTP step-0 logits [N, V]),
    the drafter reading (h_i, seq[i+1]) at every position i, through the engine's own batch and caches."""
    prompt = seq[:-1]
    n, bs = len(prompt), 16
    ecfg = EngineConfig(num_speculative_tokens=1, device=str(device), dtype="float32", max_num_seqs=1,
                        max_num_batched_tokens=max(n, 2), block_size=bs, num_kv_blocks=-(-n // bs) + 4,
                        max_model_len=n + 8, enable_prefix_caching=False)
    engine = LLMEngine(cfg, {k: v.detach().clone() for k, v in weights.items()}, ecfg)
    engine.add_request(prompt, SamplingParams(max_tokens=1))
    out = engine.scheduler.schedule()
    (row,) = out.rows
    if row.num_tokens != n or row.is_decode:
        raise RuntimeError(f"engine check: expected one prefill row of {n} tokens, got {row}")
    runner = engine.runner
    assert isinstance(runner.mtp, MTPModule)
    with torch.inference_mode():
        input_ids, batch = runner.build_batch(out, spec=True)
        hidden = engine.model(input_ids, batch)
        mtp_batch = MTPModule.with_kv_caches(batch, engine.pools.mtp_kv_layers())
        nxt = torch.tensor(seq[1:], dtype=torch.int64, device=device)
        mtp_hidden = runner.mtp(hidden, nxt, engine.model.model.embeddings, mtp_batch, step=0)
        return engine.model.logits(hidden).cpu(), engine.model.logits(mtp_hidden).cpu()


def check_against_engine(params: Params, cfg: ModelConfig, seq: list[int], device: torch.device,
                         weights: Params | None = None, tol: float = 1e-3) -> tuple[float, float]:
    """Training forward (fp32, no autocast) vs the engine (fp32) on `seq`, every position, target and MTP.

    `weights`: what the engine loads (default: `params`), e.g. the checkpoint read back from disk.
    Returns the max abs errors relative to the largest |logit|; raises AssertionError above `tol`.
    """
    with exact_fp32():
        e_logits, e_mtp = engine_logits(cfg, params if weights is None else weights, seq, device)
        with torch.no_grad():
            ids = torch.tensor([seq], dtype=torch.int64, device=device)
            t_logits, t_mtp = train_forward({k: v.float() for k, v in params.items()}, cfg, ids)
    t_logits, t_mtp = t_logits[0, :-1].float().cpu(), t_mtp[0].float().cpu()
    errs = []
    for name, ours, ref in (("target", t_logits, e_logits), ("mtp", t_mtp, e_mtp)):
        if ours.shape != ref.shape:
            raise AssertionError(f"engine check ({name}): shapes differ: training {tuple(ours.shape)}, "
                                 f"engine {tuple(ref.shape)}")
        err = ((ours - ref).abs().max() / ref.abs().max().clamp_min(1e-12)).item()
        errs.append(err)
        if not err <= tol:
            pos = int((ours - ref).abs().amax(-1).argmax())
            raise AssertionError(f"engine check ({name} logits): training forward and engine differ by {err:.3g} "
                                 f"(relative to the largest logit; tolerance {tol:g}), worst at position {pos} "
                                 f"of {ref.shape[0]}")
    return errs[0], errs[1]


# ---- the benchmark -----------------------------------------------------------------------------------------

@dataclass
class BenchRow:
    k: int
    seconds: float
    output_tokens: int
    decode_seconds: float
    decode_tokens: int
    steps: int
    graph_steps: int  # of them, replayed as a CUDA graph (decode / whole greedy verify steps)
    mean_acceptance_length: float
    drafted: int
    accepted: int
    outputs: list[list[int]]
    differ: int = 0
    first_divergence: list[tuple[int, int]] = field(default_factory=list)  # (prompt, token index)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_greedy(engine: LLMEngine, prompts: list[list[int]], max_tokens: int, device: torch.device
               ) -> tuple[list[list[int]], float, float, int]:
    """`LLMEngine.generate`'s loop, timed per step: (outputs, wall s, s in pure decode steps, tokens of those)."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    sync(device)
    t0 = time.perf_counter()
    ids = [engine.add_request(p, params) for p in prompts]
    done: dict[str, list[int]] = {}
    decode_s, decode_tok = 0.0, 0
    while engine.has_unfinished():
        ts = time.perf_counter()
        outs = engine.step()
        sync(device)
        dt = time.perf_counter() - ts
        if not engine.last_step_rows:
            raise RuntimeError("engine: no request can be scheduled (a bug)")
        if engine.stats.row_kinds[-1][1] == 0:  # no prefill row this step
            decode_s += dt
            decode_tok += sum(len(o.new_token_ids) for o in outs)
        for o in outs:
            if o.finished:
                done[o.request_id] = list(o.token_ids)
    return [done[i] for i in ids], time.perf_counter() - t0, decode_s, decode_tok


def benchmark(model_dir: Path, prompts: list[list[int]], ks: list[int], max_tokens: int, device: torch.device,
              dtype: str, progress: bool = True) -> list[BenchRow]:
    cfg, weights = load_checkpoint(model_dir, dtype)
    rows: list[BenchRow] = []
    for k in tqdm(ks, desc="benchmark K", disable=not progress):
        engine = make_engine(cfg, weights, device, dtype, len(prompts), max(len(p) for p in prompts) + max_tokens, k)
        # Every CUDA graph size captured first, as a server does before taking traffic (`capture_graphs`): graphs
        # are otherwise captured on a size's first step, and the timed run's batch shrinks as its requests finish
        # at different steps (K > 0: acceptance differs per request), which the warm-up's may not have.
        engine.capture_graphs(sampled_verify=False)  # (greedy: the verify graphs of sampling rows are not used)
        # Warm-up on the same prompts: every Triton kernel shape the timed run uses is compiled here, not inside
        # the timing.
        run_greedy(engine, prompts, min(max_tokens, 16), device)
        engine.stats = EngineStats()
        graphed0 = engine.runner.graph_steps  # (a running count: stats copy it)
        outputs, wall, dec_s, dec_tok = run_greedy(engine, prompts, max_tokens, device)
        st = engine.stats
        rows.append(BenchRow(k=k, seconds=wall, output_tokens=sum(len(o) for o in outputs), decode_seconds=dec_s,
                             decode_tokens=dec_tok, steps=st.steps, graph_steps=engine.runner.graph_steps - graphed0,
                             mean_acceptance_length=st.mean_acceptance_length,
                             drafted=st.spec_drafted, accepted=st.spec_accepted, outputs=outputs))
        del engine
        if device.type == "cuda":
            torch.cuda.empty_cache()
    base = rows[0].outputs
    for r in rows:
        for i, (a, b) in enumerate(zip(base, r.outputs, strict=True)):
            if a != b:
                r.differ += 1
                j = next((t for t, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
                r.first_divergence.append((i, j))
    return rows


def table(rows: list[BenchRow]) -> str:
    base = rows[0].tokens_per_s or 1.0
    lines = ["| K | output tok/s | vs K=0 | decode-step tok/s | mean acceptance length | accepted / drafted "
             "| engine steps (graphed) | outputs ≠ K=0 |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        ratio = f"{r.accepted}/{r.drafted} = {r.accepted / r.drafted:.3f}" if r.drafted else "–"
        mal = f"{r.mean_acceptance_length:.3f}" if r.k else "1 (no drafts)"
        lines.append(f"| {r.k} | {r.tokens_per_s:,.1f} | {r.tokens_per_s / base:.2f}× | {r.decode_tokens_per_s:,.1f} "
                     f"| {mal} | {ratio} | {r.steps} ({r.graph_steps}) | {r.differ}/{len(r.outputs)} |")
    return "\n".join(lines)


# ---- SSM state dtype: the accuracy cost of a low-precision state pool (issue #7 item 1) -------------------

REFERENCE_STATE_DTYPE = "float32"
LOW_STATE_DTYPES = ("bfloat16", "float16")


@dataclass(frozen=True)
class StateDtypeConfig:
    """What the "SSM state dtype" section compares: `dtypes` against an fp32 state pool, the engine itself in
    `engine_dtype` throughout.

    Teacher-forced: `num_windows` held-out windows of `window` tokens; the first `prefix` are prefilled (one
    chunk: fp32 inside, the pool dtype only for its final state), the rest fed one token per decode step,
    whatever the engine would have sampled; the state is rounded to the pool dtype after every such step.
    Free-running: the benchmark's prompts, greedily decoded for `greedy_tokens` tokens.
    """
    dtypes: tuple[str, ...] = LOW_STATE_DTYPES
    engine_dtype: str = "float32"
    num_windows: int = 4
    window: int = 64
    prefix: int = 16
    greedy_tokens: int = 64

    def __post_init__(self) -> None:
        allowed = (REFERENCE_STATE_DTYPE, *LOW_STATE_DTYPES)
        bad = [d for d in self.dtypes if d not in allowed]
        if not self.dtypes or bad or len(set(self.dtypes)) != len(self.dtypes):
            raise ValueError(f"--state-dtypes: expected distinct dtypes among {', '.join(allowed)}, got "
                             f"{','.join(self.dtypes) or 'none'}")
        if self.engine_dtype not in allowed:
            raise ValueError(f"state dtype section: expected an engine dtype among {', '.join(allowed)}, got "
                             f"{self.engine_dtype!r}")
        for name in ("num_windows", "prefix", "greedy_tokens"):
            if getattr(self, name) < 1:
                flag = {"num_windows": "--state-windows", "prefix": "--state-prefix",
                        "greedy_tokens": "--state-greedy-tokens"}[name]
                raise ValueError(f"{flag}: expected >= 1, got {getattr(self, name)}")
        if self.window < self.prefix + 2:
            raise ValueError(f"--state-window: expected >= --state-prefix + 2 = {self.prefix + 2} (at least one "
                             f"forced decode step), got {self.window}")


def parse_state_dtypes(text: str) -> tuple[str, ...]:
    """"bfloat16,float16" -> ("bfloat16", "float16"); validated by `StateDtypeConfig`."""
    return tuple(d.strip() for d in text.split(",") if d.strip())


@dataclass(frozen=True)
class ForcedDivergence:
    """One state dtype against the reference over the same teacher-forced decode positions."""
    dtype: str
    positions: int               # scored decode steps, all windows together
    nll: float                   # mean next-token NLL (nats), this dtype
    ref_nll: float               # the same, reference state dtype
    max_rel_logit_err: float     # worst position's max |Δlogit| / max |reference logit|
    mean_rel_logit_err: float    # the same ratio, averaged over positions
    mean_kl: float               # mean KL(p_ref || p_dtype), nats
    argmax_agreement: float      # fraction of positions with the same argmax

    @property
    def nll_delta(self) -> float:
        return self.nll - self.ref_nll

    @property
    def ppl_increase(self) -> float:
        """Relative perplexity increase: exp(Δ NLL) - 1."""
        return math.expm1(self.nll_delta)


@dataclass(frozen=True)
class GreedyAgreement:
    """One state dtype against the reference, free-running greedy decoding of the same prompts."""
    dtype: str
    prompts: int
    identical: int
    first_differences: tuple[int, ...]  # per differing prompt, the index of its first differing output token

    @property
    def identical_fraction(self) -> float:
        return self.identical / self.prompts

    @property
    def mean_first_difference(self) -> float | None:
        return sum(self.first_differences) / len(self.first_differences) if self.first_differences else None


@dataclass(frozen=True)
class StateDtypeResult:
    reference: str
    forced: tuple[ForcedDivergence, ...]
    greedy: tuple[GreedyAgreement, ...]
    config: StateDtypeConfig
    seconds: float


def make_engine(cfg: ModelConfig, weights: Params, device: torch.device, dtype: str, num_seqs: int, max_len: int,
                k: int = 0, ssm_state_dtype: str | None = None) -> LLMEngine:
    """An engine for `num_seqs` sequences of up to `max_len` tokens decoded together, K drafts per step."""
    bs = 16
    max_len += k + bs
    ecfg = EngineConfig(num_speculative_tokens=k, device=str(device), dtype=dtype, max_num_seqs=num_seqs,
                        max_num_batched_tokens=max(2048, num_seqs * (1 + k)), block_size=bs,
                        num_kv_blocks=num_seqs * (-(-max_len // bs) + k + 2) + 8, max_model_len=max_len,
                        ssm_state_dtype=ssm_state_dtype, enable_prefix_caching=False)  # (timed steps, not hits)
    return LLMEngine(cfg, {k_: v.clone() for k_, v in weights.items()}, ecfg)


def forced_decode_logits(engine: LLMEngine, windows: list[list[int]], prefix: int) -> torch.Tensor:
    """Logits [W, L - prefix - 1, V] (fp32, on the engine's device) of the decode steps that read windows[w]'s
    tokens prefix .. L-2 and predict tokens prefix+1 .. L-1: each window's first `prefix` tokens are its prompt,
    then every decode step is fed the window's next token instead of the sampled one (teacher forcing through
    the decode path). The prefill's own logits (predicting token `prefix`) are left out."""
    length = len(windows[0])
    if any(len(w) != length for w in windows) or length < prefix + 2:
        raise ValueError(f"forced decode: expected windows of one length >= prefix + 2 = {prefix + 2}, got "
                         f"lengths {sorted({len(w) for w in windows})}")
    steps = length - prefix
    params = SamplingParams(max_tokens=steps, ignore_eos=True)
    rows = {engine.add_request(w[:prefix], params): i for i, w in enumerate(windows)}
    emitted = dict.fromkeys(rows, 0)
    out_logits: torch.Tensor | None = None
    while engine.has_unfinished():
        out = engine.scheduler.schedule()
        if not out.rows:
            raise RuntimeError("forced decode: no request can be scheduled (a bug)")
        res = engine.runner.execute(out, return_logits=True)
        forced: dict[str, int] = {}
        for rid, logits in res.logits.items():
            w, j = rows[rid], emitted[rid]
            if j:  # j = 0: the prefill's logits
                if out_logits is None:
                    out_logits = logits.new_empty(len(windows), steps - 1, logits.shape[-1], dtype=torch.float32)
                out_logits[w, j - 1] = logits.float()
            forced[rid] = windows[w][prefix + j]
            emitted[rid] = j + 1
        for req in engine.step_update.update(out, forced):
            engine.runner.remove_request(req.request_id)
    if out_logits is None or any(n != steps for n in emitted.values()):
        raise RuntimeError(f"forced decode: expected {steps} steps per window, got {sorted(set(emitted.values()))}")
    return out_logits


def compare_forced(dtype: str, ref: torch.Tensor, got: torch.Tensor, targets: torch.Tensor) -> ForcedDivergence:
    """ref, got: logits [W, T, V] of the same positions; targets [W, T]: the tokens they predict."""
    ref, got = ref.double(), got.double()
    V = ref.shape[-1]
    t = targets.reshape(-1).to(ref.device)
    ref_lp, got_lp = ref.reshape(-1, V).log_softmax(-1), got.reshape(-1, V).log_softmax(-1)
    rel = ((got - ref).abs().amax(-1) / ref.abs().amax(-1).clamp_min(1e-12)).reshape(-1)
    kl = (ref_lp.exp() * (ref_lp - got_lp)).sum(-1)
    return ForcedDivergence(
        dtype=dtype, positions=t.numel(),
        nll=-got_lp.gather(1, t[:, None]).mean().item(), ref_nll=-ref_lp.gather(1, t[:, None]).mean().item(),
        max_rel_logit_err=rel.max().item(), mean_rel_logit_err=rel.mean().item(), mean_kl=kl.mean().item(),
        argmax_agreement=(ref_lp.argmax(-1) == got_lp.argmax(-1)).double().mean().item())


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token of two outputs (the shorter one's length if one is a prefix of the
    other), None if identical."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def compare_greedy(dtype: str, ref: list[list[int]], got: list[list[int]]) -> GreedyAgreement:
    diffs = [first_difference(a, b) for a, b in zip(ref, got, strict=True)]
    firsts = tuple(d for d in diffs if d is not None)
    return GreedyAgreement(dtype=dtype, prompts=len(ref), identical=len(ref) - len(firsts), first_differences=firsts)


def greedy_outputs(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    outs = engine.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    return [list(o.token_ids) for o in outs]


def state_dtype_runs(cfg: ModelConfig, weights: Params, windows: list[list[int]], prompts: list[list[int]],
                     sc: StateDtypeConfig, device: torch.device, state_dtype: str
                     ) -> tuple[torch.Tensor, list[list[int]]]:
    """One state dtype: (teacher-forced decode logits [W, T, V], greedy outputs per prompt)."""
    longest = max(sc.window, max(len(p) for p in prompts) + sc.greedy_tokens)
    engine = make_engine(cfg, weights, device, sc.engine_dtype, max(len(windows), len(prompts)), longest,
                         ssm_state_dtype=state_dtype)
    if engine.ssm_dtype != TORCH_DTYPES[state_dtype]:
        raise RuntimeError(f"engine: expected an SSM state pool in {state_dtype}, got {engine.ssm_dtype}")
    with torch.inference_mode():
        logits = forced_decode_logits(engine, windows, sc.prefix)
    outputs = greedy_outputs(engine, prompts, sc.greedy_tokens)
    return logits, outputs


def compare_state_dtypes(cfg: ModelConfig, weights: Params, windows: list[list[int]], prompts: list[list[int]],
                         sc: StateDtypeConfig, device: torch.device, reference: str = REFERENCE_STATE_DTYPE,
                         progress: bool = False) -> StateDtypeResult:
    """Every dtype of `sc.dtypes` against `reference` (fp32; pass a dtype of `sc.dtypes` itself for a negative
    control, which must give zero divergence), same windows, same prompts, same engine dtype."""
    t0 = time.perf_counter()
    targets = torch.tensor([w[sc.prefix + 1:] for w in windows], dtype=torch.int64)
    with exact_fp32():
        ref_logits, ref_out = state_dtype_runs(cfg, weights, windows, prompts, sc, device, reference)
        forced, greedy = [], []
        for d in tqdm(sc.dtypes, desc="SSM state dtype", disable=not progress):
            logits, outs = state_dtype_runs(cfg, weights, windows, prompts, sc, device, d)
            forced.append(compare_forced(d, ref_logits, logits, targets))
            greedy.append(compare_greedy(d, ref_out, outs))
            del logits
    sync(device)
    return StateDtypeResult(reference=reference, forced=tuple(forced), greedy=tuple(greedy), config=sc,
                            seconds=time.perf_counter() - t0)


def held_out_windows(held_ids: torch.Tensor, n: int, length: int) -> list[list[int]]:
    """n evenly spaced windows of `length` tokens of the held-out stream."""
    if held_ids.numel() < length:
        raise ValueError(f"--state-window: expected at most the held-out corpus' {held_ids.numel()} tokens, "
                         f"got {length}")
    starts = [i * (held_ids.numel() - length) // n for i in range(n)]
    return [held_ids[s:s + length].tolist() for s in starts]


def state_dtype_table(res: StateDtypeResult) -> str:
    ref = res.reference
    lines = [f"| SSM state | held-out NLL (vs {ref}) | Δ NLL | perplexity | max / mean rel. Δlogit "
             f"| mean KL({ref} ‖ ·) | argmax agree | greedy identical | mean first difference |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for f, g in zip(res.forced, res.greedy, strict=True):
        first = f"{g.mean_first_difference:.1f}" if g.mean_first_difference is not None else "–"
        lines.append(f"| {f.dtype} | {f.nll:.5f} ({f.ref_nll:.5f}) | {f.nll_delta:+.2e} | {f.ppl_increase:+.4%} "
                     f"| {f.max_rel_logit_err:.2e} / {f.mean_rel_logit_err:.2e} | {f.mean_kl:.2e} "
                     f"| {f.argmax_agreement:.4f} | {g.identical}/{g.prompts} = {g.identical_fraction:.2f} "
                     f"| {first} |")
    return "\n".join(lines)


def state_dtype_summary(res: StateDtypeResult) -> dict:
    """The section's numbers for the JSON summary line."""
    return {"reference": res.reference, "config": asdict(res.config), "seconds": round(res.seconds, 2),
            "forced": [{**asdict(f), "nll_delta": f.nll_delta, "ppl_increase": f.ppl_increase} for f in res.forced],
            "greedy": [{**asdict(g), "identical_fraction": g.identical_fraction,
                        "mean_first_difference": g.mean_first_difference} for g in res.greedy]}


# ---- main --------------------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--preset", choices=sorted(MODEL_PRESETS),
                    help="model shape: tiny (hidden 64) or small (8 layers M*M-M*M-, hidden 512, vocab 4096); "
                         "default small on cuda, tiny on cpu")
    ap.add_argument("--mtp-pattern", default="*-", help="mtp_hybrid_override_pattern (M, *, -; no MoE)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="config.json override, as `baton make-model --set` (e.g. hidden_size=768)")
    ap.add_argument("--steps", type=int, help="training steps at most")
    ap.add_argument("--seconds", type=float, help="training time budget (default 180 on cuda, none on cpu)")
    ap.add_argument("--seq-len", type=int)
    ap.add_argument("--batch-size", type=int)
    ap.add_argument("--lr", type=float)
    ap.add_argument("--warmup", type=int, help="linear warm-up steps")
    ap.add_argument("--mtp-weight", type=float, default=0.3, help="weight of the MTP loss")
    ap.add_argument("--corpus-mb", type=float, help="stdlib source bytes to read at most (MB)")
    ap.add_argument("--holdout-every", type=int, default=20, help="hold out every n-th file")
    ap.add_argument("--k-max", type=int, default=4, help="benchmark K = 0..k-max")
    ap.add_argument("--prompts", type=int, help="held-out prompts decoded together")
    ap.add_argument("--prompt-len", type=int, help="tokens per prompt")
    ap.add_argument("--max-tokens", type=int, help="tokens generated per prompt")
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                    help="engine dtype of the benchmark (default bfloat16 on cuda); the check is always fp32")
    ap.add_argument("--check-tol", type=float, default=1e-3)
    ap.add_argument("--log-every", type=int)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("/tmp/baton-mtp-bench"), help="checkpoint directory")
    ap.add_argument("--no-progress", action="store_true", help="no tqdm bars")
    ap.add_argument("--json", type=Path, help="also write the results here as JSON")
    st = ap.add_argument_group("SSM state dtype", "the engine (--dtype) with a float32 SSM state pool against "
                                                  "lower-precision ones, on the trained checkpoint")
    st.add_argument("--no-state-dtype", action="store_true", help="skip this section")
    st.add_argument("--state-dtypes", default=",".join(LOW_STATE_DTYPES), type=parse_state_dtypes,
                    help="comma-separated state dtypes compared against float32 (default %(default)s)")
    st.add_argument("--state-windows", type=int, help="held-out windows decoded teacher-forced (default 32 on "
                                                      "cuda, 4 on cpu)")
    st.add_argument("--state-window", type=int, help="tokens per window, prefix included (default --seq-len)")
    st.add_argument("--state-prefix", type=int, default=16, help="tokens of each window prefilled; the rest are "
                                                                 "fed one per decode step")
    st.add_argument("--state-greedy-tokens", type=int, default=64,
                    help="tokens greedily decoded from each benchmark prompt in every state dtype")
    args = ap.parse_args(argv)
    for name, value in DEFAULTS[args.device].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if not 0 <= args.k_max <= 8:
        ap.error(f"--k-max: expected 0..8, got {args.k_max}")
    if args.seq_len < 3 or args.prompt_len < 1 or args.prompts < 1 or args.max_tokens < 1 or args.steps < 1:
        ap.error("--seq-len >= 3, --prompt-len, --prompts, --max-tokens and --steps >= 1 expected")
    if args.state_window is None:
        args.state_window = args.seq_len
    # Validated here (ValueError, expected vs got) even when the section is skipped.
    args.state_config = StateDtypeConfig(dtypes=args.state_dtypes, engine_dtype=args.dtype,
                                         num_windows=args.state_windows, window=args.state_window,
                                         prefix=args.state_prefix, greedy_tokens=args.state_greedy_tokens)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA device", file=sys.stderr)
        return 2
    torch.manual_seed(args.seed)
    progress = not args.no_progress
    out: Path = args.out
    overrides = {"mtp_hybrid_override_pattern": args.mtp_pattern, **parse_overrides(args.set)}

    # 1. checkpoint skeleton + tokenizer, corpus
    t0 = time.perf_counter()
    cfg, weights = init_checkpoint(out, args.preset, overrides, seed=args.seed)
    tok = load_tokenizer(out)
    if tok is None:
        raise ValueError(f"{out}: make_model wrote no tokenizer (vocab_size {cfg.vocab_size} < 259?)")
    eos = cfg.eos_token_ids[0]
    train_texts, held_texts = stdlib_sources(int(args.corpus_mb * 2**20), args.holdout_every)
    train_ids, held_ids = token_stream(train_texts, tok, eos), token_stream(held_texts, tok, eos)
    n_params = sum(v.numel() for v in weights.values())
    n_mtp = sum(v.numel() for k, v in weights.items() if k.startswith("mtp."))
    print(f"model: {args.preset} pattern {cfg.pattern} + MTP {''.join(cfg.mtp_layer_types)}, hidden "
          f"{cfg.hidden_size}, vocab {cfg.vocab_size}, {n_params / 1e6:.1f}M parameters ({n_mtp / 1e6:.1f}M MTP)")
    print(f"corpus: {sysconfig.get_paths()['stdlib']}: {len(train_texts)} training files, {train_ids.numel():,} "
          f"tokens; {len(held_texts)} held-out files, {held_ids.numel():,} tokens "
          f"({time.perf_counter() - t0:.1f} s)")

    # 2-3. train
    if held_ids.numel() <= max(args.seq_len, args.prompt_len) + 1:
        raise ValueError(f"held-out corpus: {held_ids.numel()} tokens, expected more than --seq-len / --prompt-len "
                         f"+ 1; raise --corpus-mb or lower --holdout-every")
    params = {k: v.to(device).requires_grad_(True) for k, v in weights.items()}
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    if device.type == "cuda":  # training only; the check and the benchmark run with the defaults
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    res = train(params, cfg, train_ids, steps=args.steps, seconds=args.seconds, batch_size=args.batch_size,
                seq_len=args.seq_len, lr=args.lr, warmup=args.warmup, mtp_weight=args.mtp_weight, device=device,
                log_every=args.log_every, seed=args.seed, progress=progress)
    ev = evaluate(params, cfg, held_ids, args.seq_len, args.batch_size, device)
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
    print(f"trained {res.steps} steps in {res.seconds:.1f} s ({res.tokens / max(res.seconds, 1e-9):,.0f} tok/s); "
          f"held-out: loss {ev[0]:.4f}, mtp loss {ev[1]:.4f}, MTP argmax = target argmax {ev[2]:.3f}")

    # 4. save, load back, check the engine computes what was trained
    save_weights(out, params)
    cfg_loaded, loaded = load_checkpoint(out, "float32")
    check_len = min(args.seq_len, held_ids.numel() - 1)
    seq = held_ids[held_ids.numel() // 2 - check_len // 2:][:check_len + 1].tolist()
    err_t, err_m = check_against_engine(params, cfg_loaded, seq, device, weights=loaded, tol=args.check_tol)
    print(f"engine check ({len(seq) - 1} positions, fp32): max |Δlogit| / max |logit| target {err_t:.2e}, "
          f"mtp {err_m:.2e} (tolerance {args.check_tol:g}): OK")
    del params

    # 5. benchmark
    n, pl = args.prompts, args.prompt_len
    if held_ids.numel() < pl + 1:
        raise ValueError(f"held-out corpus has {held_ids.numel()} tokens, fewer than --prompt-len {pl}")
    starts = [i * (held_ids.numel() - pl) // n for i in range(n)]
    prompts = [held_ids[s:s + pl].tolist() for s in starts]
    rows = benchmark(out, prompts, list(range(args.k_max + 1)), args.max_tokens, device, args.dtype, progress)

    bad = [r for r in rows if r.differ]
    # Greedy decoding must not depend on K; bit-exact only where every path rounds alike (fp32 on the CPU).
    strict = device.type == "cpu" and args.dtype == "float32"
    print()
    print(f"## MTP speculative decoding — {device_name(device)}, commit {git_commit()}, torch {torch.__version__}")
    print()
    print(f"`{' '.join(['python benchmarks/mtp_bench.py', *(sys.argv[1:] if argv is None else argv)])}`")
    print()
    print(f"Model `{args.preset}` ({cfg.pattern} + MTP {''.join(cfg.mtp_layer_types)}, hidden {cfg.hidden_size}, "
          f"vocab {cfg.vocab_size}, {n_params / 1e6:.1f}M params) trained {res.steps} steps × {args.batch_size}×"
          f"{args.seq_len} tokens ({res.seconds:.0f} s) on {len(train_texts)} stdlib files; held-out loss "
          f"{ev[0]:.3f}, MTP loss {ev[1]:.3f}, MTP/target argmax agreement {ev[2]:.3f}. Engine check (fp32, "
          f"max |Δlogit| / max |logit|): target {err_t:.1e}, MTP {err_m:.1e}. Greedy, {n} held-out prompts × {pl} "
          f"tokens → {args.max_tokens} tokens each, decoded together, engine dtype {args.dtype}.")
    for r in bad:
        print(f"\n{'ERROR' if strict else 'Note'}: K={r.k}: {r.differ} of {len(r.outputs)} greedy outputs differ "
              f"from K=0 (prompt, first differing token): {r.first_divergence[:8]}")
    print()
    print(table(rows))

    # 6. SSM state dtype
    state = None
    if not args.no_state_dtype:
        sc: StateDtypeConfig = args.state_config
        cfg_b, weights_b = load_checkpoint(out, args.dtype)
        windows = held_out_windows(held_ids, sc.num_windows, sc.window)
        state = compare_state_dtypes(cfg_b, weights_b, windows, prompts, sc, device, progress=progress)
        print()
        print(f"### SSM state dtype — engine dtype {args.dtype}, {REFERENCE_STATE_DTYPE} state pool as the "
              f"reference ({state.seconds:.1f} s)")
        print()
        print(f"Teacher-forced: {sc.num_windows} held-out windows × {sc.window} tokens, {sc.prefix} prefilled "
              f"(fp32 inside the chunk), then {sc.window - sc.prefix - 1} scored decode steps each, fed the "
              f"held-out tokens (the state is rounded to the pool dtype after every step). Greedy: the {n} "
              f"prompts above × {sc.greedy_tokens} tokens; first difference = mean index of the first "
              f"differing output token over the prompts that differ.")
        print()
        print(state_dtype_table(state))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "device": device_name(device), "commit": git_commit(), "torch": torch.__version__,
            "preset": args.preset, "train_steps": res.steps, "held_out_loss": ev[0], "dtype": args.dtype,
            "mtp": [{"k": r.k, "tokens_per_s": r.tokens_per_s, "decode_tokens_per_s": r.decode_tokens_per_s,
                     "mean_acceptance_length": r.mean_acceptance_length, "drafted": r.drafted,
                     "accepted": r.accepted, "differ": r.differ, "steps": r.steps, "graph_steps": r.graph_steps}
                    for r in rows],
            "ssm_state_dtype": state_dtype_summary(state) if state is not None else None,
        }, indent=1) + "\n")
    return 1 if bad and strict else 0


if __name__ == "__main__":
    sys.exit(main())
