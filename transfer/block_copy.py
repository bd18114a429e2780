"""Copy many same-size blocks between two pools in ONE kernel launch: the CUDA IPC reader's path for the KV blocks
of a request whose ids are scattered.

Why: a prefill pool that has served a while hands out scattered block ids, so a long request is many runs, and
one `copy_` call per run through the IPC mapping is bound by the host time per call, not by the link. Here program p copies block `local_ids[p]` from block `remote_ids[p]`, loads and
stores of 8-byte words by SMs, and the host only uploads the two id lists (no descriptor plan in between).

`copy_blocks_reference` is the torch reference (one `copy_` per block); `copy_blocks` is the Triton kernel. Both
take `dst` and `src` as flat uint8 tensors on one device (an IPC mapping counts as the local device), the block
size in bytes (a multiple of 8) and the ids as int64 arrays; ids are checked against both pools before anything
is queued. Distinct local ids are the caller's contract (two blocks copied onto one would race).
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl
from torch import Tensor

WORD = 8              # bytes per load/store lane (int64)
BLOCK_WORDS = 2048    # words per loop iteration of a program (16 KiB)
NUM_WARPS = 8         # the copy is bound by the link; tile and warp settings hardly matter


# The block count varies per request: specialized (== 1, divisible by 16) it would compile inside a request's read.
@triton.jit(do_not_specialize=["n"])
def _copy_blocks_kernel(dst_ptr, src_ptr, ids_ptr, n, item_words, BLOCK: tl.constexpr):
    """Program p copies the item_words words of block ids[n + p] (src) into block ids[p] (dst)."""
    p = tl.program_id(0).to(tl.int64)
    d0 = tl.load(ids_ptr + p) * item_words
    s0 = tl.load(ids_ptr + n + p) * item_words
    for start in range(0, item_words, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < item_words
        tl.store(dst_ptr + d0 + offs, tl.load(src_ptr + s0 + offs, mask=mask), mask=mask)


def check_blocks(dst: Tensor, src: Tensor, local_ids: np.ndarray, remote_ids: np.ndarray, item_bytes: int) -> None:
    if dst.dtype != torch.uint8 or src.dtype != torch.uint8 or dst.dim() != 1 or src.dim() != 1:
        raise ValueError(f"block copy: expected flat uint8 tensors, got {dst.dtype} {tuple(dst.shape)} and "
                         f"{src.dtype} {tuple(src.shape)}")
    if dst.device != src.device:
        raise ValueError(f"block copy: expected both tensors on one device, got {dst.device} and {src.device}")
    if item_bytes <= 0 or item_bytes % WORD:
        raise ValueError(f"block copy: expected a block size that is a positive multiple of {WORD} B, got {item_bytes}")
    if local_ids.shape != remote_ids.shape or local_ids.ndim != 1:
        raise ValueError(f"block ids: expected as many local as remote ids, got shapes {local_ids.shape} and "
                         f"{remote_ids.shape}")
    for side, ids, t in (("local", local_ids, dst), ("remote", remote_ids, src)):
        n = t.numel() // item_bytes
        if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= n):
            bad = ids[(ids < 0) | (ids >= n)][0]
            raise ValueError(f"block copy: expected {side} block ids in [0, {n}), got {int(bad)}")


def copy_blocks_reference(dst: Tensor, src: Tensor, local_ids: np.ndarray, remote_ids: np.ndarray,
                          item_bytes: int) -> None:
    """The reference: one `copy_` per block, on the current stream."""
    check_blocks(dst, src, local_ids, remote_ids, item_bytes)
    for d, s in zip(local_ids.tolist(), remote_ids.tolist(), strict=True):
        dst[d * item_bytes:(d + 1) * item_bytes].copy_(src[s * item_bytes:(s + 1) * item_bytes], non_blocking=True)


class TableStage:
    """The id table's way to the GPU, reused launch after launch on one stream: a ring of pinned host buffers
    (one is rewritten only once its upload has finished) and one device table (rewritten by an upload queued on
    the same stream as the kernel that read it, so after it). No allocation per launch: a fresh pinned buffer
    costs a `cudaHostAlloc` whenever the caching allocator has none free."""

    def __init__(self, device: torch.device, size: int = 8192, ring: int = 4) -> None:
        self.device, self.ring = device, ring
        self._alloc(size)

    def _alloc(self, size: int) -> None:
        self.size = size
        self._host = [torch.empty(size, dtype=torch.int64).pin_memory() for _ in range(self.ring)]
        self._uploaded: list[torch.cuda.Event | None] = [None] * self.ring
        self._table = torch.empty(size, dtype=torch.int64, device=self.device)
        self._next = 0

    def upload(self, *parts: np.ndarray) -> Tensor:
        """The parts end to end on the device, queued on the current stream; valid for launches queued after it."""
        n = sum(len(p) for p in parts)
        if n > self.size:
            self._table.record_stream(torch.cuda.current_stream(self.device))  # launches queued may still read it
            self._alloc(1 << (n - 1).bit_length())
        i, self._next = self._next, (self._next + 1) % self.ring
        if self._uploaded[i] is not None:
            self._uploaded[i].synchronize()  # normally long done: `ring` uploads ago
        host = self._host[i].numpy()
        at = 0
        for p in parts:
            host[at:at + len(p)] = p
            at += len(p)
        dev = self._table[:n]
        dev.copy_(self._host[i][:n], non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._uploaded[i] = event
        return dev


def copy_blocks(dst: Tensor, src: Tensor, local_ids: np.ndarray, remote_ids: np.ndarray, item_bytes: int,
                stage: TableStage | None = None, block_words: int = BLOCK_WORDS, num_warps: int = NUM_WARPS,
                checked: bool = False) -> None:
    """One launch on the current stream copies every block (same effect as the reference). On a GPU, `stage`
    (else a fresh pinned buffer) brings the ids over. `checked=True`: the caller has checked the tensors and ids
    (`IpcCopier`: the pools once, the ids in the READ's plan) and they are not checked again."""
    if not checked:
        check_blocks(dst, src, local_ids, remote_ids, item_bytes)
    n = len(local_ids)
    if n == 0:
        return
    if dst.is_cuda and stage is not None:
        ids = stage.upload(local_ids, remote_ids)
    else:
        ids = torch.from_numpy(np.concatenate([local_ids, remote_ids]).astype(np.int64))
        if dst.is_cuda:  # pinned, so that the upload is ordered on the stream and the host does not wait
            ids = ids.pin_memory().to(dst.device, non_blocking=True)
    _copy_blocks_kernel[(n,)](dst.view(torch.int64), src.view(torch.int64), ids, n, item_bytes // WORD,
                              BLOCK=block_words, num_warps=num_warps)
