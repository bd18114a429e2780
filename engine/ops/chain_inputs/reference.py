"""The inputs of a verify step chained on the one before it, built on the device from that step's results (torch
reference; `kernel.py` is the kernel).

A whole greedy verify step (`SpecRunner.graph_step_fn`) packs its results as [m counts | m*T emitted | m*K drafts]
for its graph size m (T = 1 + K). The next step's row i continues the previous step's row src[i]: with c its
emitted count and p its last-token position, row i feeds its last emitted token then its first k drafts at positions
p+c .. p+c+k, with k = min(K, max(0, rooms[i] - c)) (the scheduler's draft count near a length limit, once c is
known), and K - k padding tokens (token 0, the scratch block's first slot) as `ModelRunner._decode_graph` pads them.
Rows past the step's own up to its graph size n become padding rows.

Every array is int64 on one device. `base_src` must not share memory with an output (the kernel's programs read
and write rows in no set order): the caller copies the previous step's positions out first.
"""

from __future__ import annotations

import torch


def check_chain_inputs(fn: str, packed: torch.Tensor, m: int, src: torch.Tensor, rooms: torch.Tensor,
                       tables: torch.Tensor, ids: torch.Tensor, n: int, T: int) -> int:
    """Shapes and dtypes (no values: those are on the device); returns the row count."""
    rows = src.shape[0]
    for name, t in (("packed", packed), ("src", src), ("rooms", rooms), ("tables", tables), ("ids", ids)):
        if t.dtype != torch.int64:
            raise ValueError(f"{fn}: {name} expected int64, got {t.dtype}")
    if packed.numel() < m * (2 * T):
        raise ValueError(f"{fn}: packed expected at least {m * 2 * T} results for graph size {m}, got {packed.numel()}")
    if not 0 < rows <= n or rooms.shape != (rows,) or tables.dim() != 2 or tables.shape[0] < n:
        raise ValueError(f"{fn}: expected 1..{n} rows with a room each and [>= {n}, width] block tables, got src "
                         f"{tuple(src.shape)}, rooms {tuple(rooms.shape)}, tables {tuple(tables.shape)}")
    if ids.numel() < n * T:
        raise ValueError(f"{fn}: expected room for {n * T} input ids, got {ids.numel()}")
    return rows


def chain_inputs(packed: torch.Tensor, m: int, src: torch.Tensor, rooms: torch.Tensor, base_src: torch.Tensor,
                 tables: torch.Tensor, ids: torch.Tensor, slot_mapping: torch.Tensor, seq_lens: torch.Tensor,
                 verify_base: torch.Tensor, num_tokens: torch.Tensor, n: int, T: int, block_size: int,
                 scratch_block: int) -> None:
    """Write rows 0..n-1 of ids / slot_mapping ([n*T]) and seq_lens / verify_base / num_tokens ([n]) in place: the
    rows of src from the previous step's `packed` results (graph size m) and its last-token positions `base_src`,
    block tables `tables` [n, width], then padding rows."""
    rows = check_chain_inputs("chain_inputs", packed, m, src, rooms, tables, ids, n, T)
    K = T - 1
    counts = packed[:m][src]
    base = base_src[:m][src] + counts
    emitted = packed[m:m + m * T].view(m, T)[src]
    drafts = packed[m + m * T:m + m * T + m * K].view(m, K)[src]
    last = emitted.gather(1, (counts - 1).clamp_min(0).unsqueeze(1))  # [rows, 1]
    ntok = 1 + (rooms - counts).clamp(0, K)
    offsets = torch.arange(T, device=ids.device)
    real = offsets < ntok.unsqueeze(1)  # [rows, T]
    pos = base.unsqueeze(1) + offsets
    slots = tables[:rows].gather(1, pos // block_size) * block_size + pos % block_size
    ids[:rows * T] = torch.cat([last, drafts], dim=1).masked_fill_(~real, 0).view(-1)
    slot_mapping[:rows * T] = slots.masked_fill_(~real, scratch_block * block_size).view(-1)
    seq_lens[:rows] = base + T
    verify_base[:rows] = base
    num_tokens[:rows] = ntok
    ids[rows * T:n * T] = 0
    slot_mapping[rows * T:n * T] = scratch_block * block_size
    seq_lens[rows:n] = T
    verify_base[rows:n] = 0
    num_tokens[rows:n] = T
