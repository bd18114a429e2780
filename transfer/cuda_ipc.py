"""Same-host GPU to GPU READs through CUDA IPC mappings, beside NIXL (opt-in: `TransferAgent(cuda_ipc=True)`).

Why: on 2 x H200, UCX's cuda_ipc lane moved a 353 MiB request at 47-63 % of the peer copy, while a plain copy
through a CUDA IPC mapping opened in another process ran at 388-395 GB/s, the link's rate (benchmarks/RESULTS.md,
issue #3). When both nodes run on one host with their pools on GPUs, the reader maps the holder's pools once, at
the handshake, and copies each READ's planned byte ranges itself on a stream of its own.

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
from baton.transfer.plan import TransferPlan


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


def byte_ranges(plan: TransferPlan, local: dict[str, RegionLayout],
                remote: dict[str, RegionLayout]) -> dict[str, np.ndarray]:
    """The plan's descriptors by pool, as int64 rows (local offset, remote offset, bytes) from each pool's start.

    A descriptor lies inside one pool on both sides (plans are built per pool); one that does not is refused.
    Vectorized: a scattered 16k-token request has ~1,000 descriptors.
    """
    la, n, ra = plan.local[:, 0], plan.local[:, 1], plan.remote[:, 0]
    out: dict[str, np.ndarray] = {}
    placed = np.zeros(len(la), dtype=bool)
    for name, lo in local.items():
        re = remote[name]
        in_l = (la >= lo.base_addr) & (la + n <= lo.base_addr + lo.num_items * lo.item_bytes)
        in_r = (ra >= re.base_addr) & (ra + n <= re.base_addr + re.num_items * re.item_bytes)
        if (in_l != in_r).any():
            i = int(np.flatnonzero(in_l != in_r)[0])
            raise ValueError(f"transfer plan: expected a descriptor within one pool on both sides, got local "
                             f"[{int(la[i]):#x}, +{int(n[i])}) and remote [{int(ra[i]):#x}, +{int(n[i])}), only "
                             f"one of them in {name!r}")
        if in_l.any():
            out[name] = np.stack([la[in_l] - lo.base_addr, ra[in_l] - re.base_addr, n[in_l]], axis=1)
        placed |= in_l
    if not placed.all():
        i = int(np.flatnonzero(~placed)[0])
        raise ValueError(f"transfer plan: expected [{int(la[i]):#x}, +{int(n[i])}) inside a registered pool, got "
                         f"none holding it")
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
    """Copies planned byte ranges from a mapped peer into the local pools on its own stream.

    A pool's ranges go as `copy_` calls (the copy engines) when they are few, else as one launch of the range-copy
    kernel (`transfer.range_copy`): ~15 us of host time per `copy_` made a scattered request's ~1,000 ranges
    take 15.7 ms where its bytes need ~1 ms."""

    FEW_RANGES = 4

    def __init__(self, pools: dict[str, torch.Tensor]) -> None:
        self.device = next(t.device for t in pools.values() if t.numel())
        self.local = {name: t.view(-1).view(torch.uint8) for name, t in pools.items() if t.numel()}
        self.stream = torch.cuda.Stream(self.device)
        from baton.transfer import range_copy  # Triton: imported only where a GPU copies

        self._kernel = range_copy.copy_ranges
        self._word = range_copy.WORD
        self._stage = range_copy.TableStage(self.device)
        with torch.cuda.stream(self.stream):  # compile it now, at the handshake, not in the first READ
            scratch = torch.zeros(2 * self._word, dtype=torch.uint8, device=self.device)
            self._kernel(scratch, scratch, np.array([[0, self._word, self._word]], dtype=np.int64), stage=self._stage)
        self.stream.synchronize()

    def copy(self, peer: IpcPeer, ranges: dict[str, np.ndarray]) -> None:
        """Queue copies of these ranges on the copier's stream (in order, after those queued before)."""
        with torch.cuda.stream(self.stream):
            for name, rows in ranges.items():
                dst, src = self.local[name], peer.pools[name]
                if len(rows) <= self.FEW_RANGES or not self._word_aligned(dst, src, rows):
                    for lo, ro, n in rows.tolist():
                        dst[lo:lo + n].copy_(src[ro:ro + n], non_blocking=True)
                else:
                    self._kernel(dst, src, rows, stage=self._stage)

    def done(self) -> torch.cuda.Event:
        """An event that completes when every copy queued so far has landed."""
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def wait_idle(self) -> None:
        """Block until every queued copy has landed (before a failed read's caller frees its slot)."""
        self.stream.synchronize()

    def _word_aligned(self, dst: torch.Tensor, src: torch.Tensor, rows: np.ndarray) -> bool:
        """Whether the kernel can copy these ranges in 8-byte words (every real pool's blocks can)."""
        w = self._word
        return dst.data_ptr() % w == 0 and src.data_ptr() % w == 0 and dst.numel() % w == 0 \
            and src.numel() % w == 0 and not (rows % w).any()
