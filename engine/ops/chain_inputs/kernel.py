"""Triton kernel for `chain_inputs` (the torch reference, with the layout): a chained verify step's inputs in one
launch instead of the reference's ~20 small ops, whose launches are host time on every chained step.

One program per tile of ROWS rows (padding rows included): it gathers its rows' results from the previous step's
packed tensor and writes their inputs. Graph-capturable; no host reads.
"""

import triton
import triton.language as tl
from torch import Tensor

from baton.engine.ops.chain_inputs.reference import check_chain_inputs
from baton.engine.ops.chain_inputs.tuning import ROWS
from baton.engine.ops.triton_common import cdiv, next_power_of_2


@triton.jit
def _chain_inputs_kernel(packed_ptr, src_ptr, rooms_ptr, base_src_ptr, tables_ptr, ids_ptr, slot_ptr, seq_ptr,
                         vbase_ptr, ntok_ptr, m, rows, n, table_stride, block_size, scratch_slot,
                         T: tl.constexpr, TP: tl.constexpr, ROWS: tl.constexpr):
    K: tl.constexpr = T - 1
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    t = tl.arange(0, TP)
    live = r < rows
    in_n = r < n  # live rows, then padding rows up to the graph size
    j = tl.load(src_ptr + r, mask=live, other=0)
    c = tl.load(packed_ptr + j, mask=live, other=1)  # emitted count (>= 1)
    base = tl.load(base_src_ptr + j, mask=live, other=0) + c
    k = tl.minimum(tl.maximum(tl.load(rooms_ptr + r, mask=live, other=0) - c, 0), K)
    last = tl.load(packed_ptr + m + j * T + c - 1, mask=live, other=0)
    r2, t2 = r[:, None], t[None, :]
    real = live[:, None] & (t2 <= k[:, None])
    draft = tl.load(packed_ptr + m + m * T + j[:, None] * K + t2 - 1, mask=real & (t2 >= 1), other=0)
    tok = tl.where(real, tl.where(t2 == 0, last[:, None], draft), 0)
    pos = base[:, None] + t2
    blk = tl.load(tables_ptr + r2 * table_stride + pos // block_size, mask=real, other=0)
    slot = tl.where(real, blk * block_size + pos % block_size, scratch_slot)
    token = in_n[:, None] & (t2 < T)
    tl.store(ids_ptr + r2 * T + t2, tok, mask=token)
    tl.store(slot_ptr + r2 * T + t2, slot, mask=token)
    tl.store(seq_ptr + r, tl.where(live, base + T, T), mask=in_n)
    tl.store(vbase_ptr + r, tl.where(live, base, 0), mask=in_n)
    tl.store(ntok_ptr + r, tl.where(live, k + 1, T), mask=in_n)


def chain_inputs_triton(packed: Tensor, m: int, src: Tensor, rooms: Tensor, base_src: Tensor, tables: Tensor,
                        ids: Tensor, slot_mapping: Tensor, seq_lens: Tensor, verify_base: Tensor, num_tokens: Tensor,
                        n: int, T: int, block_size: int, scratch_block: int) -> None:
    """`chain_inputs.chain_inputs`, one launch."""
    rows = check_chain_inputs("chain_inputs_triton", packed, m, src, rooms, tables, ids, n, T)
    if tables.stride(1) != 1 or src.stride(0) != 1 or rooms.stride(0) != 1:
        raise ValueError("chain_inputs_triton: expected unit-stride src, rooms and block table rows")
    _chain_inputs_kernel[(cdiv(n, ROWS),)](
        packed, src, rooms, base_src, tables, ids, slot_mapping, seq_lens, verify_base, num_tokens, m, rows, n,
        tables.stride(0), block_size, scratch_block * block_size, T=T, TP=next_power_of_2(T), ROWS=ROWS,
        num_warps=1,
    )
