"""Same-host GPU to GPU READs through CUDA IPC mappings, beside NIXL (opt-in: `TransferAgent(cuda_ipc=True)`).

Why: UCX's cuda_ipc lane moves a request well below the GPUs' peer copy rate, while a plain copy through a CUDA IPC
mapping opened in another process runs at the link's rate (`benchmarks/RESULTS.md`). When both nodes run on one
host with their pools on GPUs, the reader maps the holder's pools once, at the handshake, and copies each READ's
items (state slot, KV blocks) itself on a stream of its own (`IpcCopier`).

What stays NIXL's: the handshake, and the notification that tells the holder a request was read (`send_notif`
with the request id, the message a NIXL READ carries), so the holder's lease handling does not change.

The holder publishes one `IpcRegion` per VRAM pool: its CUDA IPC handle, as torch shares a storage
(`UntypedStorage._share_cuda_`), and where the pool starts in it. Nothing is pickled: these are plain fields.
A peer on another host (`host_id`), a pool in host memory, or a mapping that fails to open: NIXL reads.
"""

from __future__ import annotations

import socket
from pathlib import Path

import msgspec
import numpy as np
import torch

from baton.transfer.layout import RegionLayout
from baton.transfer.plan import runs


class IpcRegion(msgspec.Struct, frozen=True):
    """A VRAM pool as CUDA IPC exports it: the fields of torch's `_share_cuda_`, plus the pool's offset."""
    handle: bytes                 # the cudaIpcMemHandle of the allocation holding the storage
    storage_size_bytes: int
    storage_offset_bytes: int     # the storage's offset in that allocation
    ref_counter_handle: bytes     # torch's producer-side reference counter (a shared-memory file)
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    tensor_offset_bytes: int      # where the pool starts in its storage


def host_id() -> str:
    """Names this host (and boot): CUDA IPC maps memory only between processes of one machine."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def export_regions(pools: dict[str, torch.Tensor]) -> dict[str, IpcRegion]:
    """IPC exports of the CUDA pools (the ones with bytes); {} when any pool with bytes is not on a GPU."""
    live = {name: t for name, t in pools.items() if t.numel()}
    if not live or any(not t.is_cuda for t in live.values()):
        return {}
    out = {}
    for name, t in live.items():
        (_dev, handle, size, offset, rc_handle, rc_offset, ev_handle, ev_sync) = t.untyped_storage()._share_cuda_()
        out[name] = IpcRegion(bytes(handle), int(size), int(offset), bytes(rc_handle), int(rc_offset),
                              bytes(ev_handle or b""), bool(ev_sync), t.storage_offset() * t.element_size())
    return out


class IpcPeer:
    """One holder's pools mapped into this process (on the device of the local pools), as byte tensors."""

    def __init__(self, regions: dict[str, IpcRegion], layouts: dict[str, RegionLayout], device: torch.device) -> None:
        self.pools: dict[str, torch.Tensor] = {}
        for name, r in regions.items():
            storage = torch.UntypedStorage._new_shared_cuda(
                device.index or 0, r.handle, r.storage_size_bytes, r.storage_offset_bytes, r.ref_counter_handle,
                r.ref_counter_offset, r.event_handle, r.event_sync_required)
            nbytes = layouts[name].num_items * layouts[name].item_bytes
            if r.tensor_offset_bytes + nbytes > r.storage_size_bytes:
                raise ValueError(f"{name} IPC region: expected {nbytes} B from offset {r.tensor_offset_bytes} "
                                 f"inside a storage of {r.storage_size_bytes} B")
            whole = torch.empty(0, dtype=torch.uint8, device=device).set_(storage)
            self.pools[name] = whole[r.tensor_offset_bytes:r.tensor_offset_bytes + nbytes]


class IpcCopier:
    """Copies items (KV blocks, state slots) from a mapped peer into the local pools on its own stream.

    A pool's items go as one `copy_` per run of consecutive ids (the copy engines) when the runs are few, else as
    one launch of the block-copy kernel (`transfer.block_copy`, SM loads), because the host time per `copy_` would
    dominate a scattered request's many runs."""

    FEW_RUNS = 4

    def __init__(self, pools: dict[str, torch.Tensor]) -> None:
        self.device = next(t.device for t in pools.values() if t.numel())
        self.local = {name: t.view(-1).view(torch.uint8) for name, t in pools.items() if t.numel()}
        self.stream = torch.cuda.Stream(self.device)
        from baton.transfer import block_copy  # Triton: imported only where a GPU copies

        self._kernel = block_copy.copy_blocks
        self._word = block_copy.WORD
        self._stage = block_copy.TableStage(self.device)
        with torch.cuda.stream(self.stream):  # compile it now, at the handshake, not in the first READ
            # Both specializations a pool's item size can take (a word count divisible by 16 or not; never 1).
            for words in (16, 17):
                scratch = torch.zeros(2 * words * self._word, dtype=torch.uint8, device=self.device)
                one, zero = np.ones(1, dtype=np.int64), np.zeros(1, dtype=np.int64)
                self._kernel(scratch, scratch, one, zero, words * self._word, stage=self._stage)
        self.stream.synchronize()

    def copy(self, peer: IpcPeer, name: str, local_ids: np.ndarray, remote_ids: np.ndarray, item_bytes: int) -> None:
        """Queue the copy of items remote_ids -> local_ids of pool `name` on the copier's stream, in order after what
        was queued before. The ids must be checked against both pools (`plan.block_ids` does): the kernel does not."""
        dst, src = self.local[name], peer.pools[name]
        starts, counts = runs(local_ids, remote_ids, True)
        with torch.cuda.stream(self.stream):
            if len(starts) > self.FEW_RUNS and self._word_aligned(dst, src, item_bytes):
                self._kernel(dst, src, local_ids, remote_ids, item_bytes, stage=self._stage, checked=True)
                return
            for lo, ro, n in zip((local_ids[starts] * item_bytes).tolist(), (remote_ids[starts] * item_bytes).tolist(),
                                 (counts * item_bytes).tolist(), strict=True):
                dst[lo:lo + n].copy_(src[ro:ro + n], non_blocking=True)

    def copy_item(self, peer: IpcPeer, name: str, local_offset: int, remote_offset: int, nbytes: int) -> None:
        """Queue one range's copy (a state slot: offsets checked by the caller) on the copier's stream."""
        with torch.cuda.stream(self.stream):
            self.local[name][local_offset:local_offset + nbytes].copy_(
                peer.pools[name][remote_offset:remote_offset + nbytes], non_blocking=True)

    def done(self) -> torch.cuda.Event:
        """An event that completes when every copy queued so far has landed."""
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def wait_idle(self) -> None:
        """Block until every queued copy has landed (before a failed read's caller frees its slot)."""
        self.stream.synchronize()

    def _word_aligned(self, dst: torch.Tensor, src: torch.Tensor, item_bytes: int) -> bool:
        """Whether the kernel can copy these pools' items in 8-byte words (every real pool's can)."""
        w = self._word
        return dst.data_ptr() % w == 0 and src.data_ptr() % w == 0 and dst.numel() % w == 0 \
            and src.numel() % w == 0 and item_bytes % w == 0
