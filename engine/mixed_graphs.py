"""CUDA graphs of mixed steps: R decode rows (one token each, K = 0) and one prompt chunk of at most Q tokens.

A step with prompt tokens cannot replay a decode graph, and run eagerly it is bound by the host: its launches take
far longer than its kernels (`benchmarks/engine_bench.py`'s mixed steps). With `EngineConfig.mixed_graph_tokens` = Q the scheduler gives a step with decode rows at most one
prompt chunk of at most Q tokens, and such a step replays one of these graphs:

- tokens: the decode rows' first (row i's token is token i, padded to the graph's size n as decode graphs pad),
  then the chunk's, padded to Q. Only the chunk's real length L changes from step to step, and it is a device
  input: the query starts are [0, 1, ..., n, n + L], the recurrent mixer's prefill metadata is rewritten from it
  (`RecurrentMixer.load_graph_prefill_meta`; Mamba2: the scan's chunk lengths and the row's chunk count), and
  every kernel bounds the row by them. The padding tokens past L belong to no row: their
  KV goes to the scratch block (slot mapping), attention gives them no program, the conv and the scan write no
  state from them, and their outputs (unused) stay in their own rows of every activation (row-wise ops);
- the attention kernel's program map is built once per size for a chunk of Q tokens (spare programs past L
  read and write nothing), the mixer's prefill metadata once for Q tokens (Mamba2: chunks past L have length 0);
- the logits are gathered on the device from the decode rows and the chunk's last real token (n + L - 1).

Inputs go in one non-blocking copy from pinned memory (`host_copy.to_device`), then into the static buffers; a
decode row's PENDING token (async scheduling) is taken on the device from the step in flight, as for decode
graphs. On a CPU device the same static, padded layout runs eagerly (no capture), which the tests compare with
steps built the usual way. Graphs are captured lazily, the first time a size is needed, or all at once by
`capture_all`, into one memory pool. The engine keeps these for several chunk sizes (`mixed_graph_buckets.py`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from baton.engine.cache_pools import CachePools
from baton.engine.causal_lm import CausalLM
from baton.engine.cuda_graphs import capture_graph, capture_missing, graph_sizes
from baton.engine.forward_batch import ForwardBatch
from baton.engine.host_copy import to_device
from baton.engine.pending_step import device_mark, fill_pending


@dataclass(frozen=True)
class DecodeRows:
    """A mixed step's decode rows as host ints, one entry per row: its token, KV slot, sequence length (context + 1),
    state slot and block table."""
    ids: Sequence[int]
    slot_mapping: Sequence[int]
    seq_lens: Sequence[int]
    state_slots: Sequence[int]
    block_tables: Sequence[Sequence[int]]


@dataclass(frozen=True)
class PromptChunk:
    """A mixed step's prompt chunk as host ints: its L tokens and their KV slots, the row's sequence length
    (context + L), state slot, whether it starts from that slot's state, and its block table."""
    ids: Sequence[int]
    slot_mapping: Sequence[int]
    seq_len: int
    state_slot: int
    has_initial_state: bool
    block_table: Sequence[int]


_NO_ROWS = DecodeRows((), (), (), (), ())


class MixedStepGraphs:
    def __init__(self, model: CausalLM, pools: CachePools, block_size: int, max_rows: int,
                 max_blocks: int, device: torch.device, chunk_tokens: int, pool: tuple | None = None) -> None:
        if chunk_tokens < 1:
            raise ValueError(f"mixed step graphs: expected chunk_tokens >= 1, got {chunk_tokens}")
        self.model = model
        self.pools = pools
        self.block_size = block_size
        self.max_rows = max_rows
        self.device = device
        self.Q = Q = chunk_tokens
        # Room for the padding chunk of Q tokens the graphs are captured on, which may be longer than any real
        # sequence (max_model_len < Q): its block table covers all Q.
        self.max_blocks = max_blocks = max(max_blocks, -(-Q // block_size))
        self.sizes = graph_sizes(max_rows)
        # The last run's start mark (`pending_step.device_mark`), recorded before its first GPU work.
        self.started: torch.cuda.Event | None = None
        n, dev = max_rows, device
        # Static inputs, sized for the largest graph; a graph of n decode rows uses the first n + Q tokens and
        # n + 1 rows (the chunk's row last).
        self.ids = torch.zeros(n + Q, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.zeros(n + Q, dtype=torch.int64, device=dev)
        self.seq_lens = torch.zeros(n + 1, dtype=torch.int64, device=dev)
        self.state_slots = torch.zeros(n + 1, dtype=torch.int64, device=dev)
        self.has_initial_state = torch.ones(n + 1, dtype=torch.bool, device=dev)
        self.last = torch.zeros(n + 1, dtype=torch.int64, device=dev)  # rows' last tokens, for the logits
        self.block_tables = torch.zeros(n + 1, max_blocks, dtype=torch.int64, device=dev)
        # Per size: its query starts [0..n, n + L] (their own tensor: the attention map is tied to it) and the map.
        self._starts: dict[int, tuple[torch.Tensor, object | None]] = {}
        self.chunk_meta = None
        cfg = model.cfg
        if pools.plan.state.num_layers:
            self.chunk_meta = model.recurrent_mixer.prefill_meta(cfg, [0, Q], model.kernels, dev)
        self.capture = device.type == "cuda"
        # Graphs' memory: `pool` (shared with other graphs replayed one at a time), or a pool of their own.
        self.pool = (pool if pool is not None else torch.cuda.graph_pool_handle()) if self.capture else None
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def size_for(self, rows: int) -> int | None:
        """The graph size a step of `rows` decode rows runs in, or None when it is larger than any."""
        return next((s for s in self.sizes if s >= rows), None)

    def _query_starts(self, n: int) -> tuple[torch.Tensor, object | None]:
        if n not in self._starts:
            host = [*range(n + 1), n + self.Q]
            qsl, meta = to_device(host, torch.int64, self.device), None
            cfg = self.model.cfg
            if cfg.attention_layer_ids and self.model.kernels.triton:
                from baton.engine.ops.attention.kernel import build_attention_meta
                meta = build_attention_meta(host, qsl, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
            self._starts[n] = (qsl, meta)
        return self._starts[n]

    def _batch(self, n: int) -> ForwardBatch:
        qsl, attention_meta = self._query_starts(n)
        return ForwardBatch(
            num_decodes=n,
            query_start_loc=qsl,
            seq_lens=self.seq_lens[:n + 1],
            block_tables=self.block_tables[:n + 1],
            slot_mapping=self.slot_mapping[:n + self.Q],
            state_slots=self.state_slots[:n + 1],
            has_initial_state=self.has_initial_state[:n + 1],
            kv_caches=self.pools.kv_layers(),
            mixer_states=self.pools.state_layers(),
            num_decode_tokens=n,
            prefill_chunk_meta=self.chunk_meta,
            attention_meta=attention_meta,
        )

    def _forward(self, n: int) -> torch.Tensor:
        # Only the rows' last tokens run past the last cache-writing layer (`pre_norm_stack`'s keep).
        hidden = self.model(self.ids[:n + self.Q], self._batch(n), keep=self.last[:n + 1])
        return self.model.logits(hidden, upcast=False)

    def _write(self, n: int, flat: list[int], width: int, meta_len: int) -> None:
        """The step's inputs from host ints into the static buffers: one copy to the device, then slices."""
        Q = self.Q
        staged = to_device(flat, torch.int64, self.device)
        at = 0
        for dst, size in ((self.ids, n + Q), (self.slot_mapping, n + Q), (self.seq_lens, n + 1),
                          (self.state_slots, n + 1), (self.has_initial_state, n + 1), (self.last, n + 1)):
            dst[:size] = staged[at:at + size]
            at += size
        qsl, _ = self._query_starts(n)
        qsl[n + 1] = staged[at]
        at += 1
        if self.chunk_meta is not None:
            self.model.recurrent_mixer.load_graph_prefill_meta(self.chunk_meta, staged[at:at + meta_len])
        at += meta_len
        self.block_tables[:n + 1, :width] = staged[at:].view(n + 1, width)

    def _inputs(self, n: int, dec: DecodeRows, chunk: PromptChunk) -> tuple[list[int], int, int]:
        """Host ints of a step (see `run`), padded to size n: (flat list, block-table width, prefill-metadata
        entries)."""
        Q, bs = self.Q, self.block_size
        scratch_block, scratch_slot = self.pools.scratch_block, self.pools.scratch_slot
        rows = len(dec.state_slots)
        pad = n - rows
        L = len(chunk.ids)
        width = max(1, *(len(b) for b in (*dec.block_tables, chunk.block_table)))
        meta = ([] if self.chunk_meta is None else
                self.model.recurrent_mixer.graph_prefill_meta_ints(self.chunk_meta, L))
        flat = [
            *dec.ids, *[0] * pad, *chunk.ids, *[0] * (Q - L),
            *dec.slot_mapping, *[scratch_block * bs] * pad, *chunk.slot_mapping, *[scratch_block * bs] * (Q - L),
            *dec.seq_lens, *[1] * pad, chunk.seq_len,
            *dec.state_slots, *[scratch_slot] * pad, chunk.state_slot,
            *[1] * n, int(chunk.has_initial_state),
            *range(n), n + L - 1,
            n + L,
            *meta,
        ]
        for b in (*dec.block_tables, *[()] * pad, chunk.block_table):
            flat += b
            flat += [scratch_block] * (width - len(b))
        return flat, width, len(meta)

    def _capture(self, n: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        # Warm-up and capture on padding only: every row on the scratch block and slot, a chunk of Q tokens from zeros.
        self._pad(n)
        return capture_graph(lambda: self._forward(n), self.device, self.pool)

    def _pad(self, n: int) -> None:
        bs, scratch_block = self.block_size, self.pools.scratch_block
        chunk = PromptChunk(ids=[0] * self.Q, slot_mapping=[scratch_block * bs] * self.Q, seq_len=self.Q,
                            state_slot=self.pools.scratch_slot, has_initial_state=False,
                            block_table=(scratch_block,) * -(-self.Q // bs))
        self._write(n, *self._inputs(n, _NO_ROWS, chunk))

    @torch.inference_mode()
    def capture_all(self) -> int:
        """Capture every size now (largest first); returns how many were captured."""
        return capture_missing(self.graphs, self.sizes, self._capture) if self.capture else 0

    @torch.inference_mode()
    def run(self, dec: DecodeRows, chunk: PromptChunk, fill: tuple | None = None) -> tuple[torch.Tensor, int]:
        """Replay the graph for R decode rows and one chunk of L tokens (1 <= L <= Q). fill: PENDING decode tokens
        taken on the device (`pending_step.fill_pending`). Returns (logits [n + 1, V] in the model's dtype: the
        decode rows (then padding) and last the chunk's last token, n)."""
        rows, L = len(dec.state_slots), len(chunk.ids)
        n = self.size_for(rows)
        if n is None or not 1 <= L <= self.Q:
            raise ValueError(f"mixed step graphs: expected at most {self.max_rows} decode rows and a chunk of 1.."
                             f"{self.Q} tokens, got {rows} rows and {L} tokens")
        width = max(len(b) for b in (*dec.block_tables, chunk.block_table))
        if width > self.max_blocks:
            raise ValueError(f"mixed step graphs: expected block tables of at most {self.max_blocks} blocks, got "
                             f"{width}")
        if self.capture and n not in self.graphs:
            self.graphs[n] = self._capture(n)
        flat, width, meta_len = self._inputs(n, dec, chunk)
        self.started = device_mark(self.device)  # the step's first GPU work: the host's part is done
        self._write(n, flat, width, meta_len)
        if fill is not None:
            fill_pending(self.ids, *fill)
        if self.capture:
            graph, out = self.graphs[n]
            graph.replay()
        else:
            out = self._forward(n)
        return out, n
