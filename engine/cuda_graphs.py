"""CUDA graphs of the decode step: the target's forward and its logits, one graph per padded batch size.

A decode step launches a few kernels per layer (hundreds in all); at small batches launching them costs
more than running them. A graph replays the whole forward with one launch. Graphs need fixed shapes and
fixed addresses, so:

- every input lives in a static device buffer, sliced to the graph's row count; a step writes its rows'
  metadata into one pinned host buffer and moves it with ONE asynchronous copy (no pageable copy: that
  would wait for the stream);
- a step of R decode rows runs the graph captured for the smallest size >= R; the spare rows are
  padding: they read and write only the pools' scratch KV block and scratch state slot, which no request
  ever owns (`CachePools.scratch_block` / `scratch_slot`), and their logits are dropped;
- block tables are [rows, max_blocks] for the longest sequence the engine allows; a row's entries past
  its last block are never read.

Graphs are captured lazily, the first time a size is needed (that step pays the Triton compilation and the
capture), into one memory pool shared by all sizes. Only pure decode steps without speculative decoding
use them; prefill chunks (whose shapes vary with every prompt) and verify steps run eagerly.
"""

from __future__ import annotations

import torch

from baton.engine.cache_pools import CachePools
from baton.engine.forward_batch import ForwardBatch
from baton.engine.model import NemotronHForCausalLM

# Fields of the packed int64 host buffer, each [rows]; the block table follows, [rows, width].
_IDS, _SEQ_LENS, _SLOT_MAPPING, _STATE_SLOTS = range(4)
_FIELDS = 4


def graph_sizes(max_rows: int) -> list[int]:
    """Batch sizes that get a graph: 1, 2, 4, 8, then every multiple of 8 up to max_rows (and max_rows)."""
    sizes = [n for n in (1, 2, 4) if n < max_rows] + list(range(8, max_rows, 8))
    return [*sizes, max_rows]


class DecodeGraphs:
    def __init__(self, model: NemotronHForCausalLM, pools: CachePools, block_size: int, max_rows: int,
                 max_blocks: int, device: torch.device) -> None:
        self.model = model
        self.pools = pools
        self.block_size = block_size
        self.max_rows = max_rows
        self.max_blocks = max_blocks
        self.device = device
        self.sizes = graph_sizes(max_rows)
        n, dev = max_rows, device
        # Static inputs (padding until a step writes its rows).
        self.ints = torch.zeros(_FIELDS, n, dtype=torch.int64, device=dev)
        self.block_tables = torch.empty(n, max_blocks, dtype=torch.int64, device=dev)
        self._pad(n)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int64, device=dev)
        self.has_initial_state = torch.ones(n, dtype=torch.bool, device=dev)
        self.staging = torch.empty(_FIELDS * n + n * max_blocks, dtype=torch.int64, device=dev)
        self.host = torch.empty(self.staging.shape, dtype=torch.int64, pin_memory=True)
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def size_for(self, rows: int) -> int | None:
        """The graph size a step of `rows` decode rows runs in, or None when it is larger than any."""
        return next((s for s in self.sizes if s >= rows), None)

    def _pad(self, n: int) -> None:
        """Make the first n rows padding: scratch block and slot, one token of context."""
        self.ints[_IDS, :n] = 0
        self.ints[_SEQ_LENS, :n] = 1
        self.ints[_SLOT_MAPPING, :n] = self.pools.scratch_block * self.block_size
        self.ints[_STATE_SLOTS, :n] = self.pools.scratch_slot
        self.block_tables[:n] = self.pools.scratch_block

    def _batch(self, n: int) -> ForwardBatch:
        return ForwardBatch(
            num_decodes=n,
            query_start_loc=self.query_start_loc[:n + 1],
            seq_lens=self.ints[_SEQ_LENS, :n],
            block_tables=self.block_tables[:n],
            slot_mapping=self.ints[_SLOT_MAPPING, :n],
            state_slots=self.ints[_STATE_SLOTS, :n],
            has_initial_state=self.has_initial_state[:n],
            kv_caches=self.pools.kv_layers(),
            conv_states=self.pools.conv_layers(),
            ssm_states=self.pools.ssm_layers(),
        )

    def _forward(self, n: int) -> torch.Tensor:
        return self.model.logits(self.model(self.ints[_IDS, :n], self._batch(n)))

    def _capture(self, n: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        # The warm-up runs really execute: on padding rows only, they touch nothing but the scratch caches.
        self._pad(n)
        # Warm up on a side stream first (Triton compiles, cuBLAS picks its kernels), as capture requires.
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self._forward(n)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = self._forward(n)
        return graph, logits

    @torch.inference_mode()
    def run(self, input_ids: list[int], seq_lens: list[int], slot_mapping: list[int], state_slots: list[int],
            block_tables: list[list[int]]) -> torch.Tensor:
        """Logits [R, V] float32 of R decode rows (one token each), by replaying the graph of their size."""
        rows = len(input_ids)
        n = self.size_for(rows)
        if n is None:
            raise ValueError(f"decode graphs: expected at most {self.max_rows} rows, got {rows}")
        width = max(len(b) for b in block_tables)
        if width > self.max_blocks:
            raise ValueError(f"decode graphs: expected block tables of at most {self.max_blocks} blocks, "
                             f"got {width}")
        if n not in self.graphs:
            self.graphs[n] = self._capture(n)
        pad = n - rows
        bs, scratch = self.block_size, self.pools
        host = self.host
        fields = (
            input_ids + [0] * pad,
            seq_lens + [1] * pad,
            slot_mapping + [scratch.scratch_block * bs] * pad,
            state_slots + [scratch.scratch_slot] * pad,
        )
        for f, values in enumerate(fields):
            host[f * n:(f + 1) * n] = torch.tensor(values, dtype=torch.int64)
        table = [b + [scratch.scratch_block] * (width - len(b)) for b in block_tables]
        table += [[scratch.scratch_block] * width] * pad
        end = _FIELDS * n + n * width
        host[_FIELDS * n:end] = torch.tensor(table, dtype=torch.int64).view(-1)
        # One copy from pinned memory: asynchronous, it does not wait for the GPU.
        self.staging[:end].copy_(host[:end], non_blocking=True)
        self.ints[:, :n] = self.staging[:_FIELDS * n].view(_FIELDS, n)
        self.block_tables[:n, :width] = self.staging[_FIELDS * n:end].view(n, width)
        graph, logits = self.graphs[n]
        graph.replay()
        return logits[:rows]
