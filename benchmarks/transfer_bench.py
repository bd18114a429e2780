"""Transfer benchmark: move one realistic request between two processes with NIXL, three ways, against a
plain torch copy of the same bytes measured in the same run.

The request: `--tokens` (16k) of the `8b-like` preset (Nemotron-H-8B shape, bf16): its KV blocks in all
4 attention layers plus the conv and SSM state of all 24 Mamba layers (fp32 SSM state). A "prefill"
process holds it in real engine cache pools; this process, the "decode" side, READs it into its own.

Ways (each a NIXL read of the whole request: the state slot's READ posted first, then the blocks' as the agent
does by default; `--read-order one-read`: one READ of both):
- coalesced: Baton's plan; with id-major pools the request's blocks are runs (1 descriptor per run, for all
  layers) + 1 conv + 1 SSM descriptor.
- per block: one descriptor per KV block.
- per block per layer: one per block and attention layer (how peers with per-layer caches transfer).
With --cuda-ipc there is one way: the state slot, then each run of blocks as a copy when the runs are few, else all
blocks in one kernel launch (`transfer/cuda_ipc.py`); `descs` is then the plan's runs + 2.
Block ids (`--layouts`): `contiguous` (fresh pools), `scattered` (the prefill side's from a shuffled free list),
`served` / `served-lowest`: where a request of `--tokens` lands on both nodes amid serving traffic, the two
nodes' allocators being the engine's `FreeList` / lowest-free-id first (`alloc_bench.served_request`: two real
schedulers under its default workload), renumbered into the bench's pools with their runs kept
(`alloc_bench.compact`).

  python benchmarks/transfer_bench.py --device cpu        # DRAM <-> DRAM between two processes (UCX cma)
  python benchmarks/transfer_bench.py --device cuda       # cuda:0 -> cuda:1 (VRAM registration), 2 GPUs
  python benchmarks/transfer_bench.py --device cuda --read-order one-read  # the same, blocks and state in one READ
  python benchmarks/transfer_bench.py --device cuda --cuda-ipc  # the same, copied through CUDA IPC mappings
                                                                # (transfer/cuda_ipc.py) instead of UCX

Baseline: cpu = `dst.copy_(src)` in one process; cuda = a peer copy cuda:0 -> cuda:1 of the same bytes, timed
once after every READ; `vs copy` = the way's median copy time / its median READ time (same stretch of the run).
Host columns: `plan ms` = planning the descriptors alone, `post ms` = until start_read returned (plan included).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import random
import statistics
import sys
import time

import torch
from tqdm import tqdm

from baton.engine.cache_pools import CachePools, plan_cache
from baton.engine.config import ModelConfig
from baton.engine.engine_config import EngineConfig
from baton.engine.make_model import build_config
from baton.engine.model import NemotronHForCausalLM
from baton.engine.weights import TORCH_DTYPES
from baton.transfer.agent import DEFAULT_PROGRESS_DELAY_US, READ_ORDERS
from baton.transfer.plan import plan_request

LAYOUTS = ("contiguous", "scattered", "served", "served-lowest")


def make_pools(args, device: str) -> tuple[ModelConfig, CachePools]:
    cfg = ModelConfig.from_hf_dict(build_config(args.preset))
    blocks = 2 * -(-args.tokens // args.block_size)  # room for two such requests
    ecfg = EngineConfig(block_size=args.block_size, max_num_seqs=4, max_num_batched_tokens=512,
                        num_kv_blocks=blocks)
    dtype = TORCH_DTYPES[cfg.torch_dtype]
    plan = plan_cache(cfg, NemotronHForCausalLM.state_spec(cfg), ecfg, dtype, torch.float32)
    return cfg, CachePools(cfg, plan, args.block_size, dtype, torch.float32, device)


def request_ids(args, num_blocks: int) -> tuple[list[int], list[int]]:
    """(prefill-side ids, decode-side ids) of the request's blocks for `args.layout`."""
    n = -(-args.tokens // args.block_size)
    if args.layout == "contiguous":
        return list(range(n)), list(range(n))
    if args.layout == "scattered":
        ids = list(range(num_blocks))
        random.Random(0).shuffle(ids)
        return ids[:n], list(range(n))
    from dataclasses import replace

    import alloc_bench  # benchmarks/ is the script's directory

    allocator = {"served": "FreeList", "served-lowest": "LowestFirst"}[args.layout]
    remote, local = alloc_bench.served_request(replace(alloc_bench.DEFAULTS, block_size=args.block_size),
                                               allocator, args.tokens)
    remote, local = alloc_bench.compact(remote), alloc_bench.compact(local)
    if max(remote + local) >= num_blocks:
        raise ValueError(f"{args.layout}: expected block ids below the pool's {num_blocks}, got "
                         f"{max(remote + local)}")
    return remote, local


def fill(pools: CachePools, device: str) -> None:
    """The holder's data: seeded, so the reader can rebuild it on its own device to check every byte."""
    g = torch.Generator(device=device).manual_seed(1)
    for t in pools.by_name().values():
        t.copy_(torch.randn(t.shape, generator=g, device=device, dtype=torch.float32))


def verify(pools: CachePools, args, device: str, local: list[int], remote: list[int]) -> bool:
    """The request's blocks and state slot arrived bit-identical (slot 1 remote -> slot 0 local)."""
    _, expected = make_pools(args, device)
    fill(expected, device)
    return (torch.equal(pools.kv[local].view(torch.uint8), expected.kv[remote].view(torch.uint8))
            and all(torch.equal(t[0].view(torch.uint8), expected.states[n][1].view(torch.uint8))
                    for n, t in pools.states.items()))


def holder(conn, args, device: str) -> None:
    """The prefill side: pools filled with data, registered once, metadata on a side channel."""
    from baton.transfer.agent import TransferAgent
    from baton.transfer.side_channel import SideChannelServer

    cfg, pools = make_pools(args, device)
    fill(pools, device)
    agent = TransferAgent("bench-prefill", cfg, pools.by_name(),
                          args.block_size, progress_thread=not args.no_progress_thread,
                          num_threads=args.nixl_threads, cuda_ipc=args.cuda_ipc,
                          progress_delay_us=args.nixl_progress_delay_us)
    server = SideChannelServer(lambda: agent.metadata, lambda *_: 0.0)
    conn.send(server.address)
    while not conn.poll(0.01):
        agent.notifications()  # drain
    conn.recv()
    server.close()
    agent.close()


class PeerCopy:
    """The same bytes with a plain torch copy (in-process on CPU, cuda:0 -> cuda:1 on GPUs), timed once after each
    READ: READs and baseline see the same machine state, so drift between the two does not bias the ratio."""

    def __init__(self, nbytes: int, device: str) -> None:
        self.device = device
        self.src = torch.randn(nbytes // 4, device="cuda:0" if device == "cuda" else "cpu")
        self.dst = torch.empty_like(self.src, device="cuda:1" if device == "cuda" else "cpu")
        self.time_once()  # warm-up

    def time_once(self) -> float:
        if self.device == "cuda":
            torch.cuda.synchronize("cuda:0")
            torch.cuda.synchronize("cuda:1")
        t0 = time.perf_counter()
        self.dst.copy_(self.src)
        if self.device == "cuda":
            torch.cuda.synchronize("cuda:1")
        return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--preset", default="8b-like")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--layouts", default="contiguous,scattered",
                    help="comma-separated, of " + ", ".join(LAYOUTS))
    ap.add_argument("--no-progress-thread", action="store_true", help="NIXL progresses only when polled")
    ap.add_argument("--nixl-threads", type=int, default=0, help="UCX backend worker threads (0: NIXL's default)")
    ap.add_argument("--nixl-progress-delay-us", type=int, default=DEFAULT_PROGRESS_DELAY_US,
                    help="longest sleep of NIXL's progress thread between passes (0: it spins; default "
                         f"{DEFAULT_PROGRESS_DELAY_US})")
    ap.add_argument("--read-order", choices=READ_ORDERS, default="state-first",
                    help="NIXL: the state slot's READ posted before the blocks are planned (TransferAgent's default), "
                         "or one READ of both")
    ap.add_argument("--cuda-ipc", action="store_true",
                    help="read through CUDA IPC mappings of the holder's pools (GPU pools on one host)")
    args = ap.parse_args()
    for layout in args.layouts.split(","):
        if layout not in LAYOUTS:
            raise SystemExit(f"transfer_bench: --layouts: expected names from {', '.join(LAYOUTS)}, got {layout!r}")
    if args.device == "cuda" and torch.cuda.device_count() < 2:
        print("transfer_bench: --device cuda needs 2 GPUs, found", torch.cuda.device_count(), file=sys.stderr)
        return 2
    from baton.transfer.agent import TransferAgent
    from baton.transfer.side_channel import SideChannelClient

    rows = []
    baseline: PeerCopy | None = None
    all_copies: list[float] = []
    for layout in args.layouts.split(","):
        args.layout = layout
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=holder, args=(child, args, "cuda:0" if args.device == "cuda" else "cpu"))
        proc.start()
        address = parent.recv()
        cfg, pools = make_pools(args, "cuda:1" if args.device == "cuda" else "cpu")
        agent = TransferAgent("bench-decode", cfg, pools.by_name(),
                              args.block_size, progress_thread=not args.no_progress_thread,
                              num_threads=args.nixl_threads, cuda_ipc=args.cuda_ipc,
                              progress_delay_us=args.nixl_progress_delay_us,
                              state_first=args.read_order == "state-first")
        meta = SideChannelClient(*address).metadata()
        agent.connect(meta)
        path = ("CUDA IPC copy" if agent.reads_by_cuda_ipc(meta.engine_id)
                else "NIXL READ, state slot first" if args.read_order == "state-first" else "NIXL READ, one READ")
        if args.cuda_ipc and path != "CUDA IPC copy":
            print("transfer_bench: --cuda-ipc given, but the peer is read through NIXL (host memory, or the "
                  "mapping failed: see the warning above)", file=sys.stderr)
        remote, local = request_ids(args, meta.regions["kv"].num_items)
        ways = [("coalesced", True, False), ("per block", False, False), ("per block per layer", False, True)]
        if path == "CUDA IPC copy":  # descriptor lists are NIXL's; the copier moves runs or blocks by id
            ways = ways[:1]
        for name, coalesced, split in tqdm(ways, desc=f"transfer {layout}", file=sys.stderr):
            times, posts, copies = [], [], []
            for i in range(args.reps + 1):
                t0 = time.perf_counter()
                p = agent.start_read(f"{layout}-{name}-{i}", meta.engine_id, local, remote, 0, 1,
                                     timeout=120.0, coalesced=coalesced, split_layers=split)
                posts.append(time.perf_counter() - t0)
                agent.wait(p)
                times.append(time.perf_counter() - t0)
                if baseline is None:
                    baseline = PeerCopy(p.plan.num_bytes, args.device)
                copies.append(baseline.time_once())
            plan_s = []  # the host's part of each READ: planning the descriptors (inside start_read above)
            for _ in range(args.reps):
                t0 = time.perf_counter()
                plan_request(agent.regions, meta.regions, local, remote, 0, 1, coalesced=coalesced,
                             split_layers=split)
                plan_s.append(time.perf_counter() - t0)
            rows.append((layout, name, p.plan.num_descriptors, p.plan.num_bytes, statistics.median(times[1:]),
                         min(times[1:]), statistics.median(plan_s), statistics.median(posts[1:]),
                         statistics.median(copies[1:])))
            all_copies += copies[1:]
        exact = verify(pools, args, "cuda:1" if args.device == "cuda" else "cpu", local, remote)
        print(f"{layout}: the request arrived bit-identical: {exact}", file=sys.stderr)
        if not exact:
            raise SystemExit(f"transfer_bench: {layout} READ delivered wrong bytes")
        agent.close()
        parent.send("stop")
        proc.join(60)
    nbytes = rows[0][3]
    base, base_best = nbytes / statistics.median(all_copies) / 1e9, nbytes / min(all_copies) / 1e9
    card = torch.cuda.get_device_name(0) if args.device == "cuda" else "CPU"
    print(f"\ntransfer_bench: {args.preset}, {args.tokens} tokens = {nbytes / 2**20:.1f} MiB "
          f"(KV + conv + SSM state), device {args.device} ({card}), {path}, median (and best) of {args.reps}")
    print(f"{'block ids':<13} {'plan':<21} {'descs':>6} {'ms':>8} {'GB/s':>7} {'best':>7} {'vs copy':>8} "
          f"{'plan ms':>8} {'post ms':>8}")
    for layout, name, descs, b, t, best, plan_t, post_t, copy_t in rows:
        print(f"{layout:<13} {name:<21} {descs:>6} {1e3 * t:>8.2f} {b / t / 1e9:>7.1f} {b / best / 1e9:>7.1f} "
              f"{copy_t / t:>7.0%} {1e3 * plan_t:>8.3f} {1e3 * post_t:>8.3f}")
    print(f"{'baseline':<13} {'torch copy':<21} {'':>6} {1e3 * nbytes / base / 1e9:>8.2f} {base:>7.1f} "
          f"{base_best:>7.1f} {'100%':>8}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
