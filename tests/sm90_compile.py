"""Compile the engine's Triton kernels for an H100/H200 (sm_90) on a machine without a GPU.

The interpreter tests run the kernels' Python on CPU tensors; they do not compile them, so a kernel that the
interpreter runs can still fail to compile (a loop-carried value changing type, an int64 where an int32 is
carried, a GPU-only branch such as the 16-bit `tl.dot` or PDL). Here each op's wrapper is called on small CPU
tensors shaped like the engine's (the paths a GPU step takes: 16-bit dots, PDL, decode / verify / prefill tiles),
with Triton's driver replaced by one that reports an sm_90 device, and every launch compiled to a cubin for it
(Triton's own ptxas) instead of run. Nothing is executed: the outputs are not computed.

Run it in a process of its own, without TRITON_INTERPRET (`test_triton_sm90_compile.py` does, in two shards side by
side: `--shard 1/2`, `--shard 2/2`); prints one line per compiled kernel specialization and exits 1 when any case
fails.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from collections.abc import Callable

if os.environ.get("TRITON_INTERPRET"):
    raise SystemExit("sm90_compile: expected TRITON_INTERPRET unset (the kernels are compiled, not interpreted)")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
MAX_SHARED = 227 * 1024  # bytes of shared memory one block may take on an H100 / H200 (opt-in maximum)


class _Sm90Driver:
    """What JITFunction.run asks the driver for, answered for one sm_90 device (no launch follows)."""

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self) -> GPUTarget:
        return TARGET

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")


COMPILED: list[str] = []


def _compile_only(self, *args, grid, warmup, **kwargs):
    kernel = _RUN(self, *args, grid=grid, warmup=True, **kwargs)
    consts = {k: v for k, v in kwargs.items() if k.isupper() and not isinstance(v, torch.Tensor)}
    if kernel.metadata.shared > MAX_SHARED:
        raise RuntimeError(f"{self.fn.__name__} {consts}: expected at most {MAX_SHARED} bytes of shared memory, got "
                           f"{kernel.metadata.shared} (the launch would fail: out of resources)")
    COMPILED.append(f"{self.fn.__name__} {consts} warps={kernel.metadata.num_warps} "
                    f"shared={kernel.metadata.shared}")
    return kernel


_RUN = JITFunction.run


def _g(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.randn(*shape).to(dtype)


def _idx(values: list[int], dtype: torch.dtype = torch.int32) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype)


def _with_pdl(fn: Callable[[], object]) -> Callable[[], object]:
    """Run `fn` with every op module's `pdl()` on (as on an sm_90 device for few rows)."""
    def run():
        from baton.engine.ops.attention import kernel as triton_attention
        from baton.engine.ops.conv import kernel as triton_conv
        from baton.engine.ops.gated_delta import kernel as triton_gdn
        from baton.engine.ops.linear import kernel as triton_gemv
        from baton.engine.ops.norm import kernel as triton_norm
        from baton.engine.ops.rope import kernel as triton_rope
        from baton.engine.ops.ssm_update import kernel as triton_ssu
        modules = [m for m in (triton_attention, triton_conv, triton_gdn, triton_gemv, triton_norm, triton_rope,
                               triton_ssu)
                   if hasattr(m, "pdl")]
        saved = [m.pdl for m in modules]
        for m in modules:
            m.pdl = lambda t: {"PDL": True, "launch_pdl": True}
        try:
            return fn()
        finally:
            for m, p in zip(modules, saved, strict=True):
                m.pdl = p
    return run


# Layer sizes: Mamba heads of 64 with d_state 128 in 2 groups (the 8b-like head and state sizes), attention heads
# of 128 in groups of 4 over blocks of 16, hidden 256.
H, P, N, G = 4, 64, 128, 2
CONV = H * P + 2 * G * N
HQ, HKV, D, BLOCK = 8, 2, 128, 16
HIDDEN = 256


def _conv_varlen():
    from baton.engine.ops.conv.kernel_varlen import causal_conv1d_varlen_triton
    x = _g(96, CONV)
    causal_conv1d_varlen_triton(x, _g(CONV, 4), _g(CONV), _g(6, CONV, 3), _idx([0, 40, 41, 96]), _idx([1, 4, 2]),
                                torch.tensor([True, False, True]))


def _conv_update():
    from baton.engine.ops.conv.kernel import causal_conv1d_update_triton, causal_conv1d_update_verify_triton
    causal_conv1d_update_triton(_g(8, CONV), _g(CONV, 4), _g(CONV), _g(10, CONV, 3), _idx(list(range(8))))
    pending = _g(10, 3, CONV)
    causal_conv1d_update_verify_triton(_g(2, 3, CONV), _g(CONV, 4), _g(CONV), _g(10, CONV, 3), pending,
                                       _idx([3, 7]), _idx([1, 3]), _idx([3, 2]))


def _attention():
    from baton.engine.ops.attention.kernel import paged_attention_triton
    rows = [(40, 100), (0, 70), (5, 1)]
    blocks = 40
    kv = _g(blocks, 2, BLOCK, HKV, D)
    table = torch.arange(blocks, dtype=torch.int32)[:36].reshape(3, 12)
    qsl = _idx([0, 100, 170, 171])
    seq_lens = _idx([c + n for c, n in rows])
    paged_attention_triton(_g(171, HQ, D), kv, qsl, seq_lens, table, D**-0.5, max_query_len=100)
    decode_lens = _idx([130, 7, 64])
    for splits in (1, 4):
        paged_attention_triton(_g(3, HQ, D), kv, _idx([0, 1, 2, 3]), decode_lens, table, D**-0.5, max_query_len=1,
                               num_splits=splits)
        # A verify step's rows of 1+K queries: short tiles (K = 1 and 4 at the group of 4: 16 and 32 rows).
        for t in (2, 5):
            paged_attention_triton(_g(3 * t, HQ, D), kv, _idx([0, t, 2 * t, 3 * t]), decode_lens, table, D**-0.5,
                                   max_query_len=t, num_splits=splits)


def _kv_write():
    from baton.engine.ops.attention.kernel_kv_write import write_kv_triton
    write_kv_triton(_g(20, HKV, D), _g(20, HKV, D), _g(8, 2, BLOCK, HKV, D), torch.arange(20, dtype=torch.int64))


def _chain_inputs():
    from baton.engine.ops.chain_inputs.kernel import chain_inputs_triton
    n, T = 40, 3  # a verify step of K = 2 drafts, 37 rows chained on a 40-row graph (two programs of rows)
    i64 = dict(dtype=torch.int64)
    chain_inputs_triton(torch.zeros(2 * T * n, **i64), n, torch.arange(37, **i64), torch.zeros(37, **i64),
                        torch.zeros(n, **i64), torch.zeros(n, 8, **i64), torch.zeros(n * T, **i64),
                        torch.zeros(n * T, **i64), torch.zeros(n, **i64), torch.zeros(n, **i64), torch.zeros(n, **i64),
                        n, T, BLOCK, 0)


def _tempered_verify():
    from baton.engine.ops.tempered_verify.kernel import tempered_decisions_triton
    R, K, V = 8, 2, 1000  # bf16 logits of K = 2 verify rows, one program a row and split (the shared passes)
    i64 = dict(dtype=torch.int64)
    for splits in (0, 1):
        tempered_decisions_triton(_g(R, K + 1, V), torch.zeros(R, K, **i64), torch.full((R,), K, **i64),
                                  torch.ones(R), torch.zeros(R, **i64), torch.zeros(R, **i64), splits=splits)


def _filtered_verify():
    from baton.engine.ops.tempered_verify.kernel import filtered_decisions_triton
    R, K, V = 8, 1, 1000  # bf16 logits of K = 1 verify rows with top-k / top-p, split (the shared passes), and
    i64 = dict(dtype=torch.int64)  # fp32 rows without drafts, one program a row
    filtered_decisions_triton(_g(R, K + 1, V), torch.zeros(R, K, **i64), torch.full((R,), K, **i64), torch.ones(R),
                              torch.zeros(R, **i64), torch.ones(R), torch.zeros(R, **i64), torch.zeros(R, **i64),
                              splits=1)
    filtered_decisions_triton(torch.zeros(R, 1, V), torch.zeros(R, 0, **i64), torch.zeros(R, **i64), torch.ones(R),
                              torch.zeros(R, **i64), torch.ones(R), torch.zeros(R, **i64), torch.zeros(R, **i64))


def _logits_process():
    from baton.engine.logits_processing import RowHistory, logits_inputs
    from baton.engine.ops.logits_process.kernel import apply_processing_triton
    from baton.engine.penalty_counts import PenaltyCounts
    from baton.engine.sampling_params import SamplingParams
    R, K, V = 3, 2, 1000  # bf16 logits of K = 2 verify rows, every op on, counts resident and from the host lists
    cpu = torch.device("cpu")
    rows = [SamplingParams(max_tokens=8, min_tokens=2, repetition_penalty=1.2, frequency_penalty=0.5, min_p=0.1,
                           temperature=0.7, logit_bias={3: 1.0}),
            SamplingParams(max_tokens=8, presence_penalty=0.5), SamplingParams(max_tokens=8)]
    hist = [RowHistory([1, 2], [4], frozenset({0}))] * R
    drafts, nd = torch.zeros(R, K, dtype=torch.int64), torch.full((R,), K, dtype=torch.int64)
    masks = {0: np.full((K + 1, -(-V // 32)), -1, dtype=np.int32)}
    apply_processing_triton(_g(R, K + 1, V), drafts, nd, logits_inputs(rows, hist, cpu, grammar=masks))
    resident = PenaltyCounts(4, V, cpu).resident([0, 1, 2], [0, 1, None], hist, [True, False, False])
    apply_processing_triton(_g(R, K + 1, V), drafts, nd, logits_inputs(rows, hist, cpu, resident=resident))


def _logprob_topk():
    from baton.engine.ops.logprob_topk.kernel import pack_triton
    L, V = 8, 3000  # bf16 logits split in 3, with k = 20 and k = 0
    pack_triton(_g(L, V), torch.zeros(L, dtype=torch.int64), 20, splits=3)
    pack_triton(_g(L, V).float(), torch.zeros(L, dtype=torch.int64), 0)


def _norms():
    from baton.engine.ops.norm.kernel import add_rms_norm_triton, gated_rms_norm_triton, rms_norm_triton
    rms_norm_triton(_g(32, HIDDEN), _g(HIDDEN), 1e-5)
    add_rms_norm_triton(_g(32, HIDDEN), _g(32, HIDDEN), _g(HIDDEN), 1e-5)
    gated_rms_norm_triton(_g(32, H * P), _g(32, H * P), _g(H * P), H * P // G, 1e-5)


def _relu2():
    from baton.engine.ops.act.kernel import relu2_triton
    relu2_triton(_g(32, 4 * HIDDEN))


def _rope():
    from baton.engine.ops.rope.kernel import apply_rope_triton
    from baton.engine.ops.rope.reference import rope_inv_freq
    # Qwen3.5's attention heads (a quarter of 256 channels rotary, q sliced from q_proj's output), and full rotary
    qg, k, positions = _g(20, 6, 2 * 256), _g(20, 2, 256), torch.arange(20)
    apply_rope_triton(qg[..., :256], k, positions, rope_inv_freq(1e7, 64))
    apply_rope_triton(_g(20, HQ, D, dtype=torch.float32), _g(20, HKV, D, dtype=torch.float32), positions,
                      rope_inv_freq(1e4, D))


def _gemv():
    from baton.engine.ops.linear.kernel import default_tiles, fused_linear_triton
    for m, n, k in ((1, 512, HIDDEN), (8, 512, HIDDEN), (8, HIDDEN, 8192 + 512), (40, 512, HIDDEN), (40, 9216, HIDDEN),
                    (40, 33280, HIDDEN), (40, HIDDEN, 8192)):
        tiles = default_tiles(m, n, k, True)
        a, w = _g(m, k), _g(n, k)
        fused_linear_triton(a, w, tiles=tiles)
        if not tiles.cublas:
            fused_linear_triton(a, w, prologue="relu2", tiles=tiles)
    for m in (1, 8):
        tiles = default_tiles(m, 512, HIDDEN, True)
        fused_linear_triton(_g(m, HIDDEN), _g(512, HIDDEN), prologue="add_norm", residual=_g(m, HIDDEN),
                            norm_weight=_g(HIDDEN), tiles=tiles)
        fused_linear_triton(_g(m, HIDDEN), _g(512, HIDDEN), prologue="gated_norm", gate=_g(m, HIDDEN),
                            norm_weight=_g(HIDDEN), group_size=HIDDEN // G, tiles=tiles)


def _gemv_fp8():
    from baton.engine.ops.fp8_linear.reference import FP8_DTYPE
    from baton.engine.ops.linear.kernel import default_tiles, fused_linear_triton
    for block in ((128, 128), None):
        for m, n, k, prologue in ((1, 512, HIDDEN, "add_norm"), (1, 512, 8192 + 512, "relu2"), (8, 512, HIDDEN, "norm"),
                                  (8, HIDDEN, 8192 + 512, "none"), (40, 9216, HIDDEN, "add_norm")):
            scale = torch.rand(()) if block is None else torch.rand(-(-n // 128), -(-k // 128))
            extra = {"residual": _g(m, k), "norm_weight": _g(k)} if prologue == "add_norm" else \
                {"norm_weight": _g(k)} if prologue == "norm" else {}
            fused_linear_triton(_g(m, k), _g(n, k).to(FP8_DTYPE), prologue=prologue, weight_scale=scale, block=block,
                                tiles=default_tiles(m, n, k, True), **extra)


def _fp8_gemm():
    from baton.engine.ops.fp8_linear.kernel import fp8_linear_blockwise
    from baton.engine.ops.fp8_linear.reference import FP8_DTYPE
    from baton.engine.ops.fp8_linear.tuning import GEMM_TILES, SWEEP
    w, scale = _g(1024, HIDDEN).to(FP8_DTYPE), torch.rand(8, HIDDEN // 128)
    for rows, tiles in [(min(rows, 4096), t) for rows, t, _ in GEMM_TILES] + [(4096, t) for t in SWEEP]:
        fp8_linear_blockwise(_g(rows, HIDDEN), w, scale, (128, 128), tiles=tiles)


def _moe_cases(fp8: bool):
    """The fused-MoE path (align, both grouped GEMMs, the top-k sum) at Nemotron-3-Nano's expert shapes (relu2) and
    Qwen3-Next's (gated SiLU), few experts (the compiled code does not depend on their count), both tilings; `fp8`:
    e4m3 stacks with per-expert and with 128 x 128 block scales."""
    from baton.engine.ops.fp8_linear.reference import FP8_DTYPE
    from baton.engine.ops.moe.kernel import moe_experts_triton
    from baton.engine.ops.moe.reference import expert_scale_shape
    from baton.engine.ops.moe.tuning import LARGE, SMALL
    e = 4
    for hidden, inter, top_k, gated in ((2688, 1856, 3, False), (2048, 512, 3, True)):
        up_shape, down_shape = (e, (2 if gated else 1) * inter, hidden), (e, hidden, inter)
        for block in ((None, (128, 128)) if fp8 else (None,)):
            kw = {}
            if fp8:
                kw = {"w_up_scale": torch.rand(expert_scale_shape(up_shape, block, 2 if gated else 1)),
                      "w_down_scale": torch.rand(expert_scale_shape(down_shape, block, 1)), "block": block}
            w_up, w_down = _g(*up_shape), _g(*down_shape)
            if fp8:
                w_up, w_down = w_up.to(FP8_DTYPE), w_down.to(FP8_DTYPE)
            for tiles, t in ((SMALL, 4), (LARGE, 256)):
                ids = torch.randint(0, e, (t, top_k))
                weights = _g(t, top_k) if gated else torch.rand(t, top_k)
                moe_experts_triton(_g(t, hidden), w_up, w_down, ids, weights, activation="silu" if gated else "relu2",
                                   gated=gated, tiles=tiles, **kw)


def _moe():
    _moe_cases(False)


def _moe_fp8():
    _moe_cases(True)


def _scan():
    from baton.engine.ops.chunk_scan.kernel import build_chunk_meta, mamba_chunk_scan_varlen_triton
    starts = [0, 300, 301, 361]  # rows of 300 (three chunks), 1 and 60 tokens
    T = starts[-1]
    for pool in (torch.float32, torch.bfloat16):
        meta = build_chunk_meta(starts, 128, "cpu")
        mamba_chunk_scan_varlen_triton(
            _g(T, H, P), _g(T, H), -torch.rand(H), _g(T, G, N), _g(T, G, N), torch.ones(H), torch.zeros(H),
            _idx(starts), _g(6, H, P, N, dtype=pool), _idx([0, 3, 5]), torch.tensor([True, False, True]), 128,
            1e-3, meta)


def _ssu():
    from baton.engine.ops.ssm_update.kernel import (
        selective_state_update_triton,
        selective_state_update_verify_triton,
    )
    for pool in (torch.float32, torch.bfloat16):
        for batch in (1, 64):
            selective_state_update_triton(_g(80, H, P, N, dtype=pool), _g(batch, H, P), _g(batch, H),
                                          -torch.rand(H), _g(batch, G, N), _g(batch, G, N), torch.ones(H),
                                          torch.zeros(H), _idx(list(range(batch))), 1e-3)
        L, T, B = 4, 3, 2
        selective_state_update_verify_triton(
            _g(10, H, P, N, dtype=pool), _g(10, L, H, P), _g(10, L, G, N), _g(10, L, H), _g(B, T, H, P),
            _g(B, T, H), -torch.rand(H), _g(B, T, G, N), _g(B, T, G, N), torch.ones(H), torch.zeros(H),
            _idx([2, 7]), _idx([1, 4]), 1e-3, _idx([3, 2]))


# Gated DeltaNet heads: two key heads of 128 each read by two value heads of 128 (the 27B layer's head sizes).
GK, GV, GD = 2, 4, 128


def _gdn_inputs(*lead: int, dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, ...]:
    return (_g(*lead, GK, GD, dtype=dtype), _g(*lead, GK, GD, dtype=dtype), _g(*lead, GV, GD, dtype=dtype),
            _g(*lead, GV, dtype=dtype), _g(*lead, GV, dtype=dtype))


def _gdn_decode():
    from baton.engine.ops.gated_delta.kernel import gated_delta_decode_triton
    for pool in (torch.float32, torch.bfloat16):
        for batch in (1, 64, 256):
            gated_delta_decode_triton(_g(300, GV, GD, GD, dtype=pool), *_gdn_inputs(batch), -torch.rand(GV),
                                      torch.zeros(GV), _idx(list(range(batch))))


def _gdn_verify():
    from baton.engine.ops.gated_delta.kernel import gated_delta_verify_triton
    L, T, B = 4, 3, 2
    for pool in (torch.float32, torch.bfloat16):
        gated_delta_verify_triton(_g(10, GV, GD, GD, dtype=pool), _g(10, L, GK, GD), _g(10, L, GV, GD), _g(10, L, GV),
                                  _g(10, L, GV), *_gdn_inputs(B, T), -torch.rand(GV), torch.zeros(GV), _idx([2, 7]),
                                  _idx([1, 4]), _idx([3, 2]))


def _gdn_prefill():
    """The chunk-parallel prefill with 16-bit inputs (tensor-core dots the interpreter never builds), both second
    stages, and the solve's doubling inversion."""
    from baton.engine.ops.gated_delta import kernel_chunk_wy, kernel_prefill
    starts = [0, 300, 301, 361]  # rows of 300 (five chunks of 64), 1 and 60 tokens
    split_tuned, doubling_tuned = kernel_prefill.WY_SPLIT_SCAN, kernel_chunk_wy.WY_SOLVE_DOUBLING
    for split, doubling in ((False, False), (True, False), (False, True)):
        kernel_prefill.WY_SPLIT_SCAN, kernel_chunk_wy.WY_SOLVE_DOUBLING = split, doubling
        try:
            kernel_prefill.gated_delta_prefill_varlen_triton(
                _g(6, GV, GD, GD, dtype=torch.float32), *_gdn_inputs(starts[-1], dtype=torch.bfloat16),
                -torch.rand(GV), torch.zeros(GV), _idx(starts), _idx([0, 3, 5]), torch.tensor([True, False, True]), 64)
        finally:
            kernel_prefill.WY_SPLIT_SCAN, kernel_chunk_wy.WY_SOLVE_DOUBLING = split_tuned, doubling_tuned


@triton.jit
def _broken_kernel(x_ptr, n, STEPS: tl.constexpr):
    # Runs under the interpreter; does not compile: `pos` is int32 on one side of a runtime branch and int64 on the
    # other (the kind of slip an int64 metadata load makes).
    offs = tl.arange(0, 16)
    if n > STEPS:  # noqa: SIM108 (a runtime branch: the point of this kernel)
        pos = offs
    else:
        pos = offs.to(tl.int64) + n
    tl.store(x_ptr + pos, pos.to(tl.float32))


def _broken():
    x = torch.zeros(64)
    _broken_kernel[(1,)](x, 2, STEPS=1)


# Not among the cases run by default: it must fail (`test_triton_sm90_compile.py` checks that the harness says so).
BROKEN = {"broken": _broken}

CASES: dict[str, Callable[[], object]] = {
    "conv varlen": _conv_varlen, "conv update": _conv_update, "conv update (PDL)": _with_pdl(_conv_update),
    "attention": _attention, "attention (PDL)": _with_pdl(_attention), "kv write": _kv_write, "norms": _norms,
    "norms (PDL)": _with_pdl(_norms), "relu2": _relu2, "gemv": _gemv, "gemv (PDL)": _with_pdl(_gemv),
    "gemv fp8": _gemv_fp8, "gemv fp8 (PDL)": _with_pdl(_gemv_fp8), "fp8 gemm": _fp8_gemm,
    "scan": _scan, "state update": _ssu, "state update (PDL)": _with_pdl(_ssu), "chain inputs": _chain_inputs,
    "tempered verify": _tempered_verify, "filtered verify": _filtered_verify, "rope": _rope,
    "rope (PDL)": _with_pdl(_rope), "logits process": _logits_process, "logprob topk": _logprob_topk,
    # (ordered so that the two shards, every other case each, take about the same time)
    "gdn prefill": _gdn_prefill, "gdn decode": _gdn_decode, "moe fp8": _moe_fp8,
    "gdn decode (PDL)": _with_pdl(_gdn_decode), "gdn verify": _gdn_verify, "moe": _moe,
}


def _shard(args: list[str]) -> tuple[list[str], tuple[int, int] | None]:
    """`--shard I/N` (1 <= I <= N): the I-th of every N cases, so that N processes compile them side by side."""
    if "--shard" not in args:
        return args, None
    i = args.index("--shard")
    spec = args[i + 1] if i + 1 < len(args) else ""
    part, _, total = spec.partition("/")
    if not (part.isdigit() and total.isdigit() and 1 <= int(part) <= int(total)):
        raise SystemExit(f"sm90_compile: --shard expected I/N with 1 <= I <= N, got {spec!r}")
    return args[:i] + args[i + 2:], (int(part), int(total))


def main(argv: list[str] | None = None) -> int:
    args, shard = _shard(list(argv if argv is not None else sys.argv[1:]))
    names = args or list(CASES)
    if shard:
        names = names[shard[0] - 1::shard[1]]
    cases = CASES | BROKEN
    unknown = [n for n in names if n not in cases]
    if unknown:
        raise SystemExit(f"sm90_compile: expected cases among {', '.join(cases)}, got {', '.join(unknown)}")
    driver.set_active(_Sm90Driver())
    JITFunction.run = _compile_only
    torch.manual_seed(0)
    failed = []
    for name in names:
        t0, before = time.perf_counter(), len(COMPILED)
        try:
            cases[name]()
        except Exception:  # noqa: BLE001 (every case is reported, then the exit code says)
            failed.append(name)
            print(f"FAIL {name}:\n{traceback.format_exc()}", flush=True)
            continue
        print(f"ok   {name}: {len(COMPILED) - before} launches compiled in {time.perf_counter() - t0:.1f} s",
              flush=True)
        for line in COMPILED[before:]:
            print(f"       {line}")
    print(f"{len(names) - len(failed)} of {len(names)} cases compiled for sm_90"
          + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
