"""Triton kernels for `logits_processing.apply_processing` (the torch reference): a step's processed logits in two
launches instead of the reference's dozen-odd passes over [P, K+1, V] float32 (upcast copy, dense bias and stop
masks, counts, their cumulative sums over the drafts, each penalty, the maximum, the min_p mask).

`_process_kernel`: one program per (batch row, position, slice of V). A row that is not processed is copied; a
processed one reads its raw logits once and, block by block, applies what the reference applies in its order: the
grammar's bits, the row's logit_bias and (at positions before min_tokens is reached) its stop ids, both walked as
sorted runs of (row, token) pairs alongside the blocks, then the penalties from the row's counts (resident by slot,
or built from the host lists) plus, at position j, drafts 0..j-1, and its prompt's bits. It writes the result,
rounded to the logits' dtype, and the slice's maximum of the rounded values. `_min_p_kernel` (only when a row has
min_p) combines a row's slice maxima and sets the ids under its threshold to -inf.

Every op is the reference's, elementwise in float32 with the same rounding points (IEEE division, no fused
multiply-add, one rounding to the logits' dtype before min_p), so the logits equal the reference's bit for bit,
save min_p's threshold: x_max + t * log(min_p), whose log is Triton's (on a GPU libdevice's logf, as torch's; in
the interpreter numpy's, which may differ by an ulp). Graph-capturable; no host reads.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from baton.engine.logits_processing import LogitsInputs, host_list_counts, pair_mask
from baton.engine.ops.logits_process.tuning import BLOCK, MAX_SPLITS, MIN_BLOCKS_PER_SPLIT, PROGRAMS_PER_SM
from baton.engine.ops.triton_common import cdiv, next_power_of_2, round_to, sm_count

_NO_TOKEN = tl.constexpr(2 ** 62)  # (past every vocabulary: ends a walk)


@triton.jit
def _walk(tok_ptr, ptr, end, lim):
    """The first pair index in [ptr, end) whose token is >= lim (the pairs' tokens ascend)."""
    t = tl.load(tok_ptr + ptr, mask=ptr < end, other=_NO_TOKEN)
    while t < lim:
        ptr += 1
        t = tl.load(tok_ptr + ptr, mask=ptr < end, other=_NO_TOKEN)
    return ptr


@triton.jit
def _process_kernel(x_ptr, out_ptr, pmax_ptr, index_ptr, drafts_ptr, nd_ptr, counts_ptr, crow_ptr, prompt_ptr,
                    grammar_ptr, pres_ptr, freq_ptr, rep_ptr, left_ptr, btok_ptr, bval_ptr, bstart_ptr, stok_ptr,
                    sstart_ptr, V, K1, S, span, x_row, x_pos, c_row, p_row, g_words, p_words,
                    K: tl.constexpr, GRAMMAR: tl.constexpr, BIASED: tl.constexpr, MIN_TOKENS: tl.constexpr,
                    PENALISED: tl.constexpr, REPETITION: tl.constexpr, PROMPT_BITS: tl.constexpr,
                    BLOCK: tl.constexpr):
    rp = tl.program_id(0)  # r * K1 + j
    q = tl.program_id(1)
    r = rp // K1
    j = rp % K1
    v0 = q * span
    v1 = tl.minimum(v0 + span, V)
    offs = tl.arange(0, BLOCK)
    src = x_ptr + r.to(tl.int64) * x_row + j * x_pos
    dst = out_ptr + rp.to(tl.int64) * V
    p = tl.load(index_ptr + r)
    if p < 0:  # not processed: the copy alone
        for off in range(v0, v1, BLOCK):
            i = off + offs
            tl.store(dst + i, tl.load(src + i, mask=i < v1).to(dst.dtype.element_ty), mask=i < v1)
    else:
        _process_row(src, dst, pmax_ptr + rp * S + q, p, r, j, v0, v1, drafts_ptr, nd_ptr, counts_ptr, crow_ptr,
                     prompt_ptr, grammar_ptr, pres_ptr, freq_ptr, rep_ptr, left_ptr, btok_ptr, bval_ptr, bstart_ptr,
                     stok_ptr, sstart_ptr, K1, c_row, p_row, g_words, p_words, K, GRAMMAR, BIASED, MIN_TOKENS,
                     PENALISED, REPETITION, PROMPT_BITS, BLOCK)


@triton.jit
def _process_row(src, dst, pmax_at, p, r, j, v0, v1, drafts_ptr, nd_ptr, counts_ptr, crow_ptr, prompt_ptr,
                 grammar_ptr, pres_ptr, freq_ptr, rep_ptr, left_ptr, btok_ptr, bval_ptr, bstart_ptr, stok_ptr,
                 sstart_ptr, K1, c_row, p_row, g_words, p_words, K: tl.constexpr, GRAMMAR: tl.constexpr,
                 BIASED: tl.constexpr, MIN_TOKENS: tl.constexpr, PENALISED: tl.constexpr, REPETITION: tl.constexpr,
                 PROMPT_BITS: tl.constexpr, BLOCK: tl.constexpr):
    """One processed (row, position)'s slice [v0, v1): processed logits to dst, their maximum to pmax_at."""
    offs = tl.arange(0, BLOCK)
    nd = tl.load(nd_ptr + r)
    early = j < tl.load(left_ptr + p)
    b_ptr = _walk(btok_ptr, tl.load(bstart_ptr + p), tl.load(bstart_ptr + p + 1), v0)
    b_end = tl.load(bstart_ptr + p + 1)
    s_ptr = _walk(stok_ptr, tl.load(sstart_ptr + p), tl.load(sstart_ptr + p + 1), v0)
    s_end = tl.load(sstart_ptr + p + 1)
    crow = tl.load(crow_ptr + p).to(tl.int64)
    pres = tl.load(pres_ptr + p)
    freq = tl.load(freq_ptr + p)
    rep = tl.load(rep_ptr + p)
    mx = tl.full([BLOCK], float("-inf"), tl.float32)
    for off in range(v0, v1, BLOCK):
        i = off + offs
        live = i < v1
        z = tl.load(src + i, mask=live, other=0.0).to(tl.float32)
        if GRAMMAR:
            word = tl.load(grammar_ptr + (p * K1 + j).to(tl.int64) * g_words + i // 32,
                           mask=live & (i // 32 < g_words), other=0)
            z = tl.where(((word >> (i % 32)) & 1) != 0, z, float("-inf"))
        if BIASED:
            add = tl.zeros([BLOCK], tl.float32)
            t = tl.load(btok_ptr + b_ptr, mask=b_ptr < b_end, other=_NO_TOKEN)
            while t < off + BLOCK:
                add = tl.where(i == t, tl.load(bval_ptr + b_ptr), add)
                b_ptr += 1
                t = tl.load(btok_ptr + b_ptr, mask=b_ptr < b_end, other=_NO_TOKEN)
            z = z + add  # (every processed row adds, as the reference's dense bias does)
        if MIN_TOKENS:  # noqa: SIM102  (a compile-time flag, then a runtime one)
            if early:
                t = tl.load(stok_ptr + s_ptr, mask=s_ptr < s_end, other=_NO_TOKEN)
                while t < off + BLOCK:
                    z = tl.where(i == t, float("-inf"), z)
                    s_ptr += 1
                    t = tl.load(stok_ptr + s_ptr, mask=s_ptr < s_end, other=_NO_TOKEN)
        if PENALISED:
            c = tl.load(counts_ptr + crow * c_row + i, mask=live, other=0).to(tl.float32)
            for k in tl.static_range(K):  # drafts 0..j-1 are generated before position j
                d = tl.load(drafts_ptr + r * K + k)
                c += ((i == d) & (k < j) & (k < nd)).to(tl.float32)
            seen = c > 0
            if REPETITION:
                if PROMPT_BITS:
                    word = tl.load(prompt_ptr + crow * p_row + i // 32, mask=live & (i // 32 < p_words), other=0)
                    in_prompt = ((word >> (i % 32)) & 1) != 0
                else:
                    in_prompt = tl.load(prompt_ptr + p.to(tl.int64) * p_row + i, mask=live, other=0) != 0
                z = tl.where(seen | in_prompt, tl.where(z > 0, tl.math.div_rn(z, rep), z * rep), z)
            z = z - freq * c
            z = z - pres * seen.to(tl.float32)
        z = round_to(z, dst.dtype.element_ty)
        tl.store(dst + i, z, mask=live)
        mx = tl.maximum(mx, tl.where(live, z.to(tl.float32), float("-inf")))
    tl.store(pmax_at, tl.max(mx, axis=0))


@triton.jit
def _min_p_kernel(out_ptr, pmax_ptr, index_ptr, min_p_ptr, temp_ptr, V, K1, S, span, SP: tl.constexpr,
                  BLOCK: tl.constexpr):
    rp = tl.program_id(0)
    q = tl.program_id(1)
    p = tl.load(index_ptr + rp // K1)
    min_p = tl.load(min_p_ptr + p, mask=p >= 0, other=0.0)
    if min_p > 0:  # (a row without min_p, or not processed, keeps everything)
        s = tl.arange(0, SP)
        zmax = tl.max(tl.load(pmax_ptr + rp * S + s, mask=s < S, other=float("-inf")), axis=0)
        thr = zmax + tl.load(temp_ptr + p, mask=p >= 0, other=0.0) * tl.log(min_p)
        v0 = q * span
        v1 = tl.minimum(v0 + span, V)
        dst = out_ptr + rp.to(tl.int64) * V
        offs = tl.arange(0, BLOCK)
        for off in range(v0, v1, BLOCK):
            i = off + offs
            z = tl.load(dst + i, mask=i < v1, other=0.0).to(tl.float32)
            tl.store(dst + i, tl.full([BLOCK], float("-inf"), dst.dtype.element_ty), mask=(i < v1) & (z < thr))


def auto_splits(rows: int, V: int, device: torch.device) -> int:
    """Slices of V per (row, position): enough programs to fill the GPU, none shorter than a few blocks."""
    most = max(1, min(MAX_SPLITS, V // (BLOCK * MIN_BLOCKS_PER_SPLIT)))
    if device.type != "cuda":
        return 1
    return max(1, min(most, cdiv(PROGRAMS_PER_SM * sm_count(device), rows)))


def apply_processing_triton(logits: Tensor, drafts: Tensor, num_draft: Tensor, inputs: LogitsInputs,
                            splits: int | None = None) -> Tensor:
    """`logits_processing.apply_processing`, in two launches (one without min_p): logits [R, K+1, V] (any float
    dtype), drafts [R, K] (padding: any value), num_draft [R] -> [R, K+1, V] in the logits' dtype. `splits`: slices
    of V per row and position (None: enough to fill the device)."""
    R, K1, V = logits.shape
    if inputs.num_rows != R:
        raise ValueError(f"logits: expected the {inputs.num_rows} rows the inputs were built for, got {R}")
    if tuple(drafts.shape) != (R, K1 - 1):
        raise ValueError(f"drafts: expected shape [R, K] = {(R, K1 - 1)}, got {tuple(drafts.shape)}")
    if inputs.index is None or inputs.bias_start is None or inputs.stop_start is None:
        raise ValueError("inputs: expected `logits_inputs`' index, bias_start and stop_start, got None")
    dev = logits.device
    if logits.stride(2) != 1:
        logits = logits.contiguous()
    drafts = drafts.to(dev, torch.int64).contiguous()
    num_draft = num_draft.to(device=dev, dtype=torch.int64)
    S = splits if splits is not None else auto_splits(R * K1, V, dev)
    if not 1 <= S <= MAX_SPLITS:
        raise ValueError(f"splits: expected 1..{MAX_SPLITS}, got {S}")
    span = cdiv(cdiv(V, S), BLOCK) * BLOCK
    S = cdiv(V, span)
    out = torch.empty(R, K1, V, dtype=logits.dtype, device=dev)
    pmax = torch.empty(R * K1 * S, dtype=torch.float32, device=dev)
    counts, crow, c_row = out, inputs.index, 0  # (unread without penalties)
    prompt, p_row, bits = out, 0, True
    if inputs.penalised:
        if inputs.counts is not None:
            counts, crow, c_row = inputs.counts, inputs.count_rows, inputs.counts.stride(0)
        else:
            counts = host_list_counts(inputs, V, dev)
            crow, c_row = torch.arange(counts.shape[0], device=dev), V
        if inputs.repetition_used:
            if inputs.prompt_bits is not None:
                prompt, p_row = inputs.prompt_bits, inputs.prompt_bits.stride(0)
            else:
                prompt, p_row, bits = pair_mask(inputs.prompt, counts.shape[0], V, dev).view(torch.uint8), V, False
    grammar = inputs.grammar if inputs.grammar is not None else out
    g_words = 0 if inputs.grammar is None else inputs.grammar.shape[-1]
    p_words = 0 if inputs.prompt_bits is None else inputs.prompt_bits.shape[-1]
    _process_kernel[(R * K1, S)](
        logits, out, pmax, inputs.index, drafts, num_draft, counts, crow, prompt, grammar, inputs.presence,
        inputs.frequency, inputs.repetition, inputs.min_left, inputs.bias[1], inputs.bias_values, inputs.bias_start,
        inputs.stop[1], inputs.stop_start, V, K1, S, span, logits.stride(0), logits.stride(1), c_row, p_row, g_words,
        p_words,
        K=K1 - 1, GRAMMAR=inputs.grammar is not None, BIASED=inputs.biased, MIN_TOKENS=inputs.min_tokens,
        PENALISED=inputs.penalised, REPETITION=inputs.penalised and inputs.repetition_used, PROMPT_BITS=bits,
        BLOCK=BLOCK, num_warps=4, enable_fp_fusion=False)
    if inputs.min_p_used:
        _min_p_kernel[(R * K1, S)](out, pmax, inputs.index, inputs.min_p, inputs.temperature, V, K1, S, span,
                                   SP=max(2, next_power_of_2(S)), BLOCK=BLOCK, num_warps=4,
                                   enable_fp_fusion=False)
    return out
