"""Copy many byte ranges between two pools in ONE kernel launch: the CUDA IPC reader's path for scattered blocks.

Why: a READ's plan is one descriptor per run of consecutive block ids. A prefill pool that has served a while hands
out scattered ids, so a 16k-token request is ~1,000 descriptors; as ~1,000 `copy_` calls through the IPC mapping
it took 15.7 ms (24 GB/s) against 1.1 ms for the same bytes in three ranges (2 x H200, benchmarks/RESULTS.md,
issue #7 session 9): the host's ~15 us per call, not the link, set the time. Here the ranges become a table of
pieces of at most `PIECE_BYTES` (one program each, loads and stores of 8-byte words by SMs) and one launch moves
them all.

`copy_ranges_reference` is the torch reference (one `copy_` per range); `copy_ranges` is the Triton kernel. Both
take `dst` and `src` as flat uint8 tensors on one device (an IPC mapping counts as the local device) and ranges
as (dst offset, src offset, bytes). Offsets and lengths must be multiples of 8 (pool items are); ranges must not
overlap (a READ's plan never does).
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl
from torch import Tensor

WORD = 8                    # bytes per load/store lane (int64)
PIECE_BYTES = 256 << 10     # a program's share: one 8b-like KV block (all 4 layers)
BLOCK_WORDS = 2048          # words per loop iteration of a program (16 KiB)
NUM_WARPS = 8


@triton.jit
def _copy_pieces_kernel(dst_ptr, src_ptr, table_ptr, BLOCK: tl.constexpr):
    """Program p copies its piece: table row p = (dst word offset, src word offset, words)."""
    p = tl.program_id(0).to(tl.int64)
    d0 = tl.load(table_ptr + 3 * p)
    s0 = tl.load(table_ptr + 3 * p + 1)
    n = tl.load(table_ptr + 3 * p + 2)
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(dst_ptr + d0 + offs, tl.load(src_ptr + s0 + offs, mask=mask), mask=mask)


def check_ranges(dst: Tensor, src: Tensor, ranges: np.ndarray) -> None:
    if dst.dtype != torch.uint8 or src.dtype != torch.uint8 or dst.dim() != 1 or src.dim() != 1:
        raise ValueError(f"range copy: expected flat uint8 tensors, got {dst.dtype} {tuple(dst.shape)} and "
                         f"{src.dtype} {tuple(src.shape)}")
    if dst.device != src.device:
        raise ValueError(f"range copy: expected both tensors on one device, got {dst.device} and {src.device}")
    if ranges.ndim != 2 or ranges.shape[1] != 3:
        raise ValueError(f"range copy: expected ranges as [n, 3] (dst offset, src offset, bytes), got shape "
                         f"{ranges.shape}")
    if len(ranges) == 0:
        return
    if (ranges % WORD).any():
        raise ValueError(f"range copy: expected offsets and lengths that are multiples of {WORD} B, got "
                         f"{ranges[(ranges % WORD).any(axis=1)][0].tolist()}")
    d, s, n = ranges[:, 0], ranges[:, 1], ranges[:, 2]
    if (n <= 0).any() or (d < 0).any() or (s < 0).any() or (d + n > dst.numel()).any() or (s + n > src.numel()).any():
        raise ValueError(f"range copy: expected ranges inside dst ({dst.numel()} B) and src ({src.numel()} B), "
                         f"got one outside or empty among {len(ranges)}")


def copy_ranges_reference(dst: Tensor, src: Tensor, ranges: np.ndarray) -> None:
    """The reference: one `copy_` per range, on the current stream."""
    check_ranges(dst, src, ranges)
    for d, s, n in ranges.tolist():
        dst[d:d + n].copy_(src[s:s + n], non_blocking=True)


def pieces(ranges: np.ndarray, piece_bytes: int = PIECE_BYTES) -> np.ndarray:
    """The ranges cut into pieces of at most `piece_bytes`, as int64 rows (dst word, src word, words)."""
    n = ranges[:, 2]
    per = -(-n // piece_bytes)                      # pieces per range
    first = np.repeat(np.cumsum(per) - per, per)    # index of each piece's first sibling
    k = np.arange(int(per.sum()), dtype=np.int64) - first
    at = np.repeat(np.arange(len(ranges)), per)
    off = k * piece_bytes
    out = np.empty((len(at), 3), dtype=np.int64)
    out[:, 0] = ranges[at, 0] + off
    out[:, 1] = ranges[at, 1] + off
    out[:, 2] = np.minimum(n[at] - off, piece_bytes)
    return out // WORD


class TableStage:
    """The piece table's way to the GPU, reused launch after launch on one stream: a ring of pinned host buffers
    (one is rewritten only once its upload has finished) and one device table (rewritten by an upload queued on
    the same stream as the kernel that read it, so after it). No allocation per launch: a fresh pinned buffer
    costs a `cudaHostAlloc` whenever the caching allocator has none free."""

    def __init__(self, device: torch.device, rows: int = 4096, ring: int = 4) -> None:
        self.device, self.ring = device, ring
        self._alloc(rows)

    def _alloc(self, rows: int) -> None:
        self.rows = rows
        self._host = [torch.empty((rows, 3), dtype=torch.int64).pin_memory() for _ in range(self.ring)]
        self._uploaded: list[torch.cuda.Event | None] = [None] * self.ring
        self._table = torch.empty((rows, 3), dtype=torch.int64, device=self.device)
        self._next = 0

    def upload(self, table: np.ndarray) -> Tensor:
        """`table` on the device, queued on the current stream; valid for launches queued after it there."""
        if len(table) > self.rows:
            self._table.record_stream(torch.cuda.current_stream(self.device))  # launches queued may still read it
            self._alloc(1 << (len(table) - 1).bit_length())
        i, self._next = self._next, (self._next + 1) % self.ring
        if self._uploaded[i] is not None:
            self._uploaded[i].synchronize()  # normally long done: `ring` uploads ago
        host = self._host[i][:len(table)]
        host.numpy()[:] = table
        dev = self._table[:len(table)]
        dev.copy_(host, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._uploaded[i] = event
        return dev


def copy_ranges(dst: Tensor, src: Tensor, ranges: np.ndarray, piece_bytes: int = PIECE_BYTES,
                block_words: int = BLOCK_WORDS, num_warps: int = NUM_WARPS, stage: TableStage | None = None) -> None:
    """One launch on the current stream copies every range (same effect as the reference). On a GPU, `stage`
    (else a fresh pinned buffer) brings the piece table over."""
    check_ranges(dst, src, ranges)
    if len(ranges) == 0:
        return
    rows = pieces(ranges, piece_bytes)
    if not dst.is_cuda:
        table = torch.from_numpy(rows)
    elif stage is not None:
        table = stage.upload(rows)
    else:  # pinned, so that the upload is ordered on the stream and the host does not wait
        table = torch.from_numpy(rows).pin_memory().to(dst.device, non_blocking=True)
    _copy_pieces_kernel[(table.shape[0],)](dst.view(torch.int64), src.view(torch.int64), table, BLOCK=block_words,
                                           num_warps=num_warps)
