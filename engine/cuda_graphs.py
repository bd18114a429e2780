"""CUDA graphs of decode and verify steps: the target's forward, one graph per padded batch size.

A decode step launches a few kernels per layer (hundreds in all); at small batches launching them costs
more than running them. A graph replays the whole forward with one launch. Graphs need fixed shapes and
fixed addresses, so:

- every row has the same number of tokens T: 1 for a decode step, 1+K for a verify step (the last token
  and K drafts). A verify row with fewer drafts (near its max_tokens, or a transferred request's first step)
  is padded to T: its padding tokens write only the scratch KV block, and its token count, a per-row input,
  keeps them out of the state ops and the accept test;
- every input lives in a static device buffer, sliced to the graph's row count; a step writes its rows'
  metadata into a pinned host buffer (two, used in turn, so that the next step's inputs never overwrite a
  copy still queued) and moves it with ONE asynchronous copy (no pageable copy: that would wait for the
  stream); input tokens not known on the host yet (async scheduling: sampled by the step in flight) are
  copied on the device from that step's tokens;
- a step of R rows runs the graph captured for the smallest size >= R; the spare rows are padding: they
  read and write only the pools' scratch KV block and scratch state slot, which no request ever owns
  (`CachePools.scratch_block` / `scratch_slot`), and their outputs are dropped;
- block tables are [rows, max_blocks] for the longest sequence the engine allows; a row's entries past
  its last block are never read;
- a verify graph reads how many recorded positions each row replays from the runner's `replay` tensor
  on the device, inside the graph (R3: never from a host copy);
- with a `step_fn` (the spec runner's verify step) the graph holds the whole step, not only the target's
  forward: rejection sampling, the replay counts it writes, the drafter's catch-up and its K-1 chained steps;
  more inputs then travel with the step: each position's host-known successor token, each row's position of
  its last token, and its temperature, noise seed, top-k and top-p. Each size has three verify graphs: greedy
  rows only; rows that sample at a temperature (greedy ones among them), one Triton launch deciding them; and
  rows with top-k / top-p among them too, whose filters one more launch of the same kernel applies (its cuts found
  by a search, not a sort). The graph holds every row's accept tests and draw (`RejectionSampler.verify_tempered`).
  Each of the three has a processed twin (`graph_processing`: penalties from the runner's resident counts, and
  min_p), whose rows' penalties, min_p and penalty-table rows travel with the step too, captured at its first use;
- a verify step can also be chained on the one before it while that one's tokens are not read yet
  (`run_chained`, async scheduling with drafts): each row's inputs come from the previous run's packed
  results on the device (its last emitted token, its drafts: K, or fewer near a length limit, its position
  advanced by its emitted count, the KV slots there from its block table; `ops.chain_inputs.reference`); only state
  slots, output rooms, row indices and block tables travel from the host.

On a CPU device the same static, padded layout runs eagerly (no capture): the tests check the padding and
the static inputs there, against steps built the usual way.

Graphs are captured lazily, the first time a size is needed (that step pays the Triton compilation and the
capture), into one memory pool shared by all sizes. Prefill chunks, whose shapes vary with every prompt,
run eagerly.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator

import torch

from baton.engine.cache_pools import CachePools
from baton.engine.causal_lm import CausalLM
from baton.engine.forward_batch import ForwardBatch
from baton.engine.graph_processing import RowProcessing
from baton.engine.host_copy import float_bits, host_tensor
from baton.engine.pending_step import device_mark, fill_pending

# Verify graph variants, by the rows a step holds: greedy only; some sampling at a temperature; some with top-k or
# top-p too. Each variant decides the rows of the ones before it as they do. PROCESSED added to one: its processed
# twin (`graph_processing`).
GREEDY, TEMPERED, FILTERED = 0, 1, 2
PROCESSED = 3


def sampling_variant(temperature: list[float] | None, top_k: list[int] | None, top_p: list[float] | None) -> int:
    """The verify graph variant a step's rows need (temperature 0: greedy; top_k 0 and top_p 1: no filter)."""
    if temperature is None:
        return GREEDY
    if top_k is not None and top_p is not None and any(
            t > 0 and (k > 0 or p < 1.0) for t, k, p in zip(temperature, top_k, top_p, strict=True)):
        return FILTERED
    return TEMPERED if any(t > 0 for t in temperature) else GREEDY


def sampling_parts(variant: int, pad: int, temperature: list[float] | None, seeds: list[int] | None,
                   top_k: list[int] | None, top_p: list[float] | None) -> tuple[list[int], ...]:
    """What a variant stages of its rows' sampling (the greedy graph reads none of it), padded by `pad` rows:
    temperatures (float32 bits) and seeds, then (FILTERED) top-k and top-p (float32 bits)."""
    if variant == GREEDY:
        return ()
    assert temperature is not None and seeds is not None
    parts = (float_bits(temperature) + [0] * pad, seeds + [0] * pad)
    if variant == FILTERED:
        assert top_k is not None and top_p is not None
        parts += (top_k + [0] * pad, float_bits(top_p) + float_bits([1.0]) * pad)
    return parts


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Python's garbage collector off (after one collection) for the block, then back as it was. A collection
    inside a capture can finalize objects that make CUDA calls a capturing stream forbids: an old CUDAGraph's
    reset (an engine's graphs in a reference cycle), a Triton kernel's module unload. The capture then fails
    (cudaErrorStreamCaptureInvalidated). torch collected before each
    capture up to 2.8 only (pytorch/pytorch#161037)."""
    if not gc.isenabled():  # already paused (`capture_missing` around its captures) or off by the caller's choice
        yield
        return
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def capture_graph(forward: Callable[[], torch.Tensor], device: torch.device,
                  pool: object) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """Capture `forward()` into a CUDA graph in `pool`: (the graph, its output tensor). It runs twice first on a side
    stream (Triton compiles, cuBLAS picks its kernels), as capture requires; those runs really execute. The
    garbage collector is paused over the capture (`gc_paused`)."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(2):
            forward()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with gc_paused(), torch.cuda.graph(graph, pool=pool):
        out = forward()
    return graph, out


def capture_missing(graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]], sizes: list[int],
                    capture: Callable[[int], tuple[torch.cuda.CUDAGraph, torch.Tensor]]) -> int:
    """Capture every size not in `graphs` yet, largest first (so that the smaller ones reuse its memory pool);
    returns how many were captured."""
    todo = [n for n in reversed(sizes) if n not in graphs]
    with gc_paused():  # one collection for all of them
        for n in todo:
            graphs[n] = capture(n)
    return len(todo)


# Decode (verify) graphs come every FINE_STEP rows up to FINE_UP_TO rows, then every 8, because a padding row costs
# about what a real row's state update does and a serving decode node's batches sit in that range; the price is more
# captures at start-up (a verify engine captures each size three times, for its sampling variants). Mixed graphs (a
# capture per size and chunk bucket) keep every 8.
FINE_STEP, FINE_UP_TO = 2, 64


def graph_sizes(max_rows: int, fine: bool = False) -> list[int]:
    """Batch sizes that get a graph: 1, 2, 4, 8, then every multiple of 8 up to max_rows (and max_rows); `fine`:
    every multiple of FINE_STEP from 8 below FINE_UP_TO."""
    sizes = [n for n in (1, 2, 4) if n < max_rows]
    sizes += [n for n in range(8, max_rows) if n % (FINE_STEP if fine and n < FINE_UP_TO else 8) == 0]
    return [*sizes, max_rows]


class StepGraphs:
    """Graphs of steps whose R rows each feed `tokens_per_row` tokens (T) from their state and KV prefix.

    T = 1: decode steps; the graph's output is the logits [R, V]. T = 1+K: verify steps, whose whole step
    `step_fn` captures (the layers run the verify state ops with `replay`, the runner's per-slot tensor, read on
    the device), in three variants (GREEDY, TEMPERED, FILTERED: the rows' sampling); the output is step_fn's
    packed results.
    """

    def __init__(self, model: CausalLM, pools: CachePools, block_size: int, max_rows: int,
                 max_blocks: int, device: torch.device, tokens_per_row: int = 1,
                 replay: torch.Tensor | None = None, step_fn: Callable | None = None) -> None:
        """step_fn(input_ids, batch, next_ids, verify_base, sampling) -> packed tensor: a whole verify step to
        capture instead of the forward alone (its output is returned unsliced; see `SpecRunner.graph_step_fn`);
        sampling: None (greedy rows only) or the rows' (temperature [R] float32, seeds [R] int64)."""
        if tokens_per_row > 1 and (replay is None or step_fn is None):
            raise ValueError("step graphs: expected the runner's replay tensor and a step_fn for verify steps "
                             f"(tokens_per_row = {tokens_per_row} > 1)")
        self.model = model
        self.pools = pools
        self.block_size = block_size
        self.max_rows = max_rows
        self.max_blocks = max_blocks
        self.device = device
        self.T = T = tokens_per_row
        self.replay = replay
        self.step_fn = step_fn
        self.sizes = graph_sizes(max_rows, fine=True)
        # The last run's start mark (`pending_step.device_mark`), recorded before its first GPU work.
        self.started: torch.cuda.Event | None = None
        # Sizes of at most this many tokens capture the fused-prologue GEMVs (EngineConfig.fused_gemv_max_tokens).
        self.fused_gemv_max_tokens = 0
        n, dev = max_rows, device
        # Static inputs (padding until a step writes its rows): per token ids and KV slots, per row the
        # sequence length (context + T) and state slot, and the block tables.
        self.ids = torch.zeros(n * T, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.zeros(n * T, dtype=torch.int64, device=dev)
        self.seq_lens = torch.zeros(n, dtype=torch.int64, device=dev)
        self.state_slots = torch.zeros(n, dtype=torch.int64, device=dev)
        self.block_tables = torch.empty(n, max_blocks, dtype=torch.int64, device=dev)
        self.query_start_loc = torch.arange(0, n * T + 1, T, dtype=torch.int64, device=dev)
        self.has_initial_state = torch.ones(n, dtype=torch.bool, device=dev)
        self.token_index = torch.arange(n * T, dtype=torch.int64, device=dev)
        self.num_tokens = torch.full((n,), T, dtype=torch.int64, device=dev)  # per row: 1 + its drafts
        self.next_ids = torch.zeros(n * T, dtype=torch.int64, device=dev)
        self.verify_base = torch.zeros(n, dtype=torch.int64, device=dev)
        self.temperature = torch.zeros(n, dtype=torch.float32, device=dev)  # 0: a greedy row
        self.seeds = torch.zeros(n, dtype=torch.int64, device=dev)  # noise seeds (`counter_noise`)
        self.top_k = torch.zeros(n, dtype=torch.int64, device=dev)  # 0: none
        self.top_p = torch.ones(n, dtype=torch.float32, device=dev)  # 1: none
        # Processed variants (`graph_processing`): per row its penalties, min_p and penalty-table row (the scratch
        # slot's: the tables' zero row, for a row without penalties).
        self.presence = torch.zeros(n, dtype=torch.float32, device=dev)
        self.frequency = torch.zeros(n, dtype=torch.float32, device=dev)
        self.repetition = torch.ones(n, dtype=torch.float32, device=dev)
        self.min_p = torch.zeros(n, dtype=torch.float32, device=dev)
        self.count_rows = torch.full((n,), pools.scratch_slot, dtype=torch.int64, device=dev)
        # Per graph size: its rows' query starts (one view, reused) and the attention kernel's program map for
        # them, fixed like the starts themselves, so a captured step does not rebuild it in every attention layer.
        self._starts: dict[int, tuple[torch.Tensor, object | None]] = {}
        self._pad(n)
        # The host side of one step's inputs: ids, slot mapping, successors (n*T each), seq lens, state slots,
        # last-token positions, token counts, with rows that sample their temperatures (float32 bits) and seeds, and
        # with filtering rows their top-k and top-p (float32 bits), with processed rows their penalties and min_p
        # (float32 bits) and penalty-table rows (n each), then the block table [n, width].
        self.staging = torch.empty(3 * n * T + 13 * n + n * max_blocks, dtype=torch.int64, device=dev)
        self.capture = device.type == "cuda"
        # Two pinned host buffers, used in turn, each with the event of the last copy queued from it: with async
        # scheduling the next step's inputs are written while this step's copy may not have run yet (R5: a
        # host buffer that feeds an async copy is not rewritten before that copy completes).
        self.host = [torch.empty(self.staging.shape, dtype=torch.int64, pin_memory=self.capture) for _ in range(2)]
        self._host_copied: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0
        self.pool = torch.cuda.graph_pool_handle() if self.capture else None
        # Per variant (GREEDY: decode graphs too, TEMPERED, FILTERED, then their PROCESSED twins), per size: the
        # graph and its output.
        self.variants: tuple[dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]], ...] = tuple(
            {} for _ in range(2 * PROCESSED))
        self.graphs = self.variants[GREEDY]
        self._prev_base = torch.zeros(n, dtype=torch.int64, device=dev)  # run_chained's copy of verify_base
        # Runs so far, and the last one's (number, graph size, rows, output): what `run_chained` reads from.
        self.runs = 0
        self._last: tuple[int, int, int, torch.Tensor] | None = None

    def size_for(self, rows: int) -> int | None:
        """The graph size a step of `rows` rows runs in, or None when it is larger than any."""
        return next((s for s in self.sizes if s >= rows), None)

    def _pad(self, n: int) -> None:
        """Make the first n rows padding: scratch block and slot, T tokens of context."""
        T = self.T
        self.ids[:n * T] = 0
        self.next_ids[:n * T] = 0
        self.verify_base[:n] = 0
        self.temperature[:n] = 0.0
        self.seeds[:n] = 0
        self.top_k[:n] = 0
        self.top_p[:n] = 1.0
        self.presence[:n] = 0.0
        self.frequency[:n] = 0.0
        self.repetition[:n] = 1.0
        self.min_p[:n] = 0.0
        self.count_rows[:n] = self.pools.scratch_slot
        self.num_tokens[:n] = T
        self.slot_mapping[:n * T] = self.pools.scratch_block * self.block_size
        self.seq_lens[:n] = T
        self.state_slots[:n] = self.pools.scratch_slot
        self.block_tables[:n] = self.pools.scratch_block

    def _query_starts(self, n: int) -> tuple[torch.Tensor, object | None]:
        if n not in self._starts:
            qsl, meta = self.query_start_loc[:n + 1], None
            cfg = self.model.cfg
            if cfg.attention_layer_ids and self.model.kernels.triton:
                from baton.engine.ops.attention.kernel import build_attention_meta
                meta = build_attention_meta(list(range(0, n * self.T + 1, self.T)), qsl, cfg.num_attention_heads,
                                            cfg.num_key_value_heads, cfg.head_dim)
            self._starts[n] = (qsl, meta)
        return self._starts[n]

    def _batch(self, n: int) -> ForwardBatch:
        T = self.T
        qsl, attention_meta = self._query_starts(n)
        batch = ForwardBatch(
            num_decodes=n,
            query_start_loc=qsl,
            seq_lens=self.seq_lens[:n],
            block_tables=self.block_tables[:n],
            slot_mapping=self.slot_mapping[:n * T],
            state_slots=self.state_slots[:n],
            has_initial_state=self.has_initial_state[:n],
            kv_caches=self.pools.kv_layers(),
            mixer_states=self.pools.state_layers(),
            num_decode_tokens=n * T,
            attention_meta=attention_meta,
            fused_gemv=n * T <= self.fused_gemv_max_tokens and self.model.kernels.triton,
        )
        if T > 1:
            batch.spec_num_tokens = self.num_tokens[:n]
            batch.spec_replay = self.replay[self.state_slots[:n]]  # read on the device, inside the graph (R3)
            batch.spec_token_index = self.token_index[:n * T].view(n, T)
            batch.spec_flat_index = self.token_index[:n * T]
            batch.spec_uniform = True  # a graph's rows all hold T tokens, padded (`ModelRunner._decode_graph`)
            batch.verify_inputs = self.pools.verify_layers()
        return batch

    def _forward(self, n: int, variant: int = GREEDY) -> torch.Tensor:
        if self.step_fn is not None:
            kind = variant % PROCESSED
            sampling = ((self.temperature[:n], self.seeds[:n]) if kind == TEMPERED else
                        (self.temperature[:n], self.seeds[:n], self.top_k[:n], self.top_p[:n]) if kind == FILTERED
                        else None)
            processing = None if variant < PROCESSED else (
                self.presence[:n], self.frequency[:n], self.repetition[:n], self.min_p[:n], self.temperature[:n],
                self.count_rows[:n])
            return self.step_fn(self.ids[:n * self.T], self._batch(n), self.next_ids[:n * self.T],
                                self.verify_base[:n], sampling, processing)
        batch = self._batch(n)
        return self.model.logits(self.model(self.ids[:n * self.T], batch), fused=batch.fused_gemv, upcast=False)

    def _capture(self, n: int, variant: int = GREEDY) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        # The warm-up runs really execute: on padding rows only, they touch nothing but the scratch caches.
        self._pad(n)
        return capture_graph(lambda: self._forward(n, variant), self.device, self.pool)

    @torch.inference_mode()
    def capture_all(self, sampled: bool = True) -> int:
        """Capture every size now (largest first, so that the smaller ones reuse its memory pool), every verify
        variant (`sampled`: those of rows that sample too), rather than at each size's first step; returns how
        many were captured."""
        if not self.capture:
            return 0
        n = capture_missing(self.graphs, self.sizes, self._capture)
        if self.step_fn is not None and sampled:
            for v in (TEMPERED, FILTERED):
                n += capture_missing(self.variants[v], self.sizes, lambda size, v=v: self._capture(size, v))
        return n

    @torch.inference_mode()
    def run(self, input_ids: list[int], slot_mapping: list[int], seq_lens: list[int], state_slots: list[int],
            block_tables: list[list[int]], next_ids: list[int] | None = None,
            verify_base: list[int] | None = None, num_tokens: list[int] | None = None,
            fill: tuple | None = None, temperature: list[float] | None = None,
            seeds: list[int] | None = None, top_k: list[int] | None = None,
            top_p: list[float] | None = None, processing: RowProcessing | None = None) -> torch.Tensor:
        """Replay the graph for R rows of T tokens each: input_ids, slot_mapping (and next_ids) [R*T], the rest
        per row; num_tokens: each verify row's real tokens (1 + its drafts, default T), the rest padding.
        fill = (flat token positions, indices, tokens): input ids taken on the device from a step in
        flight (`pending_step.fill_pending`), written over input_ids' PENDING entries before the replay.
        temperature / seeds / top_k / top_p (verify graphs): per row, temperature 0.0 for a greedy row, top_k 0 and
        top_p 1.0 for none; the step runs the variant its rows need (GREEDY, TEMPERED, FILTERED; with `processing`,
        the rows' penalties and min_p, its PROCESSED twin).
        Returns the logits [R, V] in the model's dtype (decode), or with a step_fn (verify) its whole packed
        output for the graph's padded size."""
        T, rows = self.T, len(state_slots)
        n = self.size_for(rows)
        if n is None:
            raise ValueError(f"step graphs: expected at most {self.max_rows} rows, got {rows}")
        if len(input_ids) != rows * T or len(slot_mapping) != rows * T:
            raise ValueError(f"step graphs: expected {T} tokens per row ({rows * T}), got {len(input_ids)} ids "
                             f"and {len(slot_mapping)} KV slots")
        if num_tokens is not None and (len(num_tokens) != rows or not all(1 <= k <= T for k in num_tokens)):
            raise ValueError(f"step graphs: expected {rows} token counts in 1..{T}, got {num_tokens}")
        width = max(len(b) for b in block_tables)
        if width > self.max_blocks:
            raise ValueError(f"step graphs: expected block tables of at most {self.max_blocks} blocks, got {width}")
        variant = self._variant(rows, temperature, seeds, top_k, top_p, processing)
        graphs = self.variants[variant]
        if self.capture and n not in graphs:
            graphs[n] = self._capture(n, variant)
        pad = n - rows
        scratch_block, scratch_slot = self.pools.scratch_block, self.pools.scratch_slot
        parts = (
            input_ids + [0] * (pad * T),
            slot_mapping + [scratch_block * self.block_size] * (pad * T),
            (next_ids or [0] * (rows * T)) + [0] * (pad * T),
            seq_lens + [T] * pad,
            state_slots + [scratch_slot] * pad,
            (verify_base or [0] * rows) + [0] * pad,
            (num_tokens or [T] * rows) + [T] * pad,
        )
        parts += sampling_parts(variant % PROCESSED, pad, temperature, seeds, top_k, top_p)
        if processing is not None:
            parts += self._processing_parts(processing, pad)
        flat = [v for p in parts for v in p]
        for b in block_tables:
            flat += b
            flat += [scratch_block] * (width - len(b))
        flat += [scratch_block] * (pad * width)
        end = self._stage(flat)
        at = 0
        for dst, size in ((self.ids, n * T), (self.slot_mapping, n * T), (self.next_ids, n * T), (self.seq_lens, n),
                          (self.state_slots, n), (self.verify_base, n), (self.num_tokens, n)):
            dst[:size] = self.staging[at:at + size]
            at += size
        at = self._stage_processing(self._stage_sampling(at, n, variant % PROCESSED), n, variant)
        self.block_tables[:n, :width] = self.staging[at:end].view(n, width)
        if fill is not None:
            fill_pending(self.ids, *fill)
        out = self._replay(n, rows, variant)
        return out if self.step_fn is not None else out[:rows]

    def _variant(self, rows: int, temperature: list[float] | None, seeds: list[int] | None,
                 top_k: list[int] | None, top_p: list[float] | None, processing: RowProcessing | None = None) -> int:
        """Check a step's sampling (and processing) inputs; which verify graph variant its rows need."""
        if processing is not None:
            lists = (processing.presence, processing.frequency, processing.repetition, processing.min_p,
                     processing.count_rows)
            if self.step_fn is None or any(len(v) != rows for v in lists):
                raise ValueError(f"step graphs: expected the processing inputs of {rows} verify rows, got "
                                 f"{[len(v) for v in lists]}" + ("" if self.step_fn else " (decode graphs take none)"))
            return PROCESSED + self._variant(rows, temperature, seeds, top_k, top_p)
        if temperature is None and seeds is None and top_k is None and top_p is None:
            return GREEDY
        lists = (temperature, seeds) + ((top_k, top_p) if top_k is not None or top_p is not None else ())
        if self.step_fn is None or any(v is None or len(v) != rows for v in lists):
            raise ValueError(f"step graphs: expected a temperature and a seed (and with a top_k a top_p) for each "
                             f"of {rows} verify rows, got {temperature}, {seeds}, {top_k} and {top_p}"
                             + ("" if self.step_fn else " (decode graphs take none)"))
        return sampling_variant(temperature, top_k, top_p)

    def _stage_sampling(self, at: int, n: int, variant: int) -> int:
        """Copy the staged sampling inputs of n rows (`sampling_parts`) into place; returns the offset after."""
        if variant == GREEDY:
            return at
        self.temperature[:n] = self.staging[at:at + n].to(torch.int32).view(torch.float32)
        self.seeds[:n] = self.staging[at + n:at + 2 * n]
        if variant == TEMPERED:
            return at + 2 * n
        self.top_k[:n] = self.staging[at + 2 * n:at + 3 * n]
        self.top_p[:n] = self.staging[at + 3 * n:at + 4 * n].to(torch.int32).view(torch.float32)
        return at + 4 * n

    def _processing_parts(self, processing: RowProcessing, pad: int) -> tuple[list[int], ...]:
        """The staged processing inputs (`_stage_processing`), padded by `pad` neutral rows."""
        p = processing
        return (float_bits(p.presence + [0.0] * pad), float_bits(p.frequency + [0.0] * pad),
                float_bits(p.repetition + [1.0] * pad), float_bits(p.min_p + [0.0] * pad),
                p.count_rows + [self.pools.scratch_slot] * pad)

    def _stage_processing(self, at: int, n: int, variant: int) -> int:
        """Copy a processed variant's staged inputs of n rows into place; returns the offset after."""
        if variant < PROCESSED:
            return at
        for i, dst in enumerate((self.presence, self.frequency, self.repetition, self.min_p)):
            dst[:n] = self.staging[at + i * n:at + (i + 1) * n].to(torch.int32).view(torch.float32)
        self.count_rows[:n] = self.staging[at + 4 * n:at + 5 * n]
        return at + 5 * n

    def _stage(self, flat: list[int]) -> int:
        """Move `flat` into `staging` with one asynchronous copy from a pinned buffer (two, used in turn); marks the
        step's start (`started`) first. Returns its length."""
        end = len(flat)
        turn = self._turn = 1 - self._turn
        host, copied = self.host[turn], self._host_copied[turn]
        if copied is not None:
            copied.synchronize()  # the copy of two steps ago: long done unless the host runs far ahead
        host[:end] = host_tensor(flat, torch.int64)
        self.started = device_mark(self.device)  # the step's first GPU work: the host's part is done
        # One copy from pinned memory: asynchronous, it does not wait for the GPU.
        self.staging[:end].copy_(host[:end], non_blocking=True)
        if self.capture:
            copied = self._host_copied[turn] = torch.cuda.Event()
            copied.record()
        return end

    def _replay(self, n: int, rows: int, variant: int = GREEDY) -> torch.Tensor:
        if self.capture:
            graph, out = self.variants[variant][n]
            graph.replay()
        else:
            out = self._forward(n, variant)
        self.runs += 1
        self._last = (self.runs, n, rows, out)
        return out

    @torch.inference_mode()
    def run_chained(self, prev_run: int, src: list[int], state_slots: list[int], rooms: list[int],
                    block_tables: list[list[int]], temperature: list[float] | None = None,
                    seeds: list[int] | None = None, top_k: list[int] | None = None,
                    top_p: list[float] | None = None) -> torch.Tensor:
        """Replay the verify graph for a step chained on run `prev_run` (the last run, its tokens maybe not read
        yet): row i continues that run's row src[i]. Its inputs are taken on the device from that run's packed
        results: the row's last emitted token then its first k drafts, at its last-token position advanced by its
        emitted count c (the KV slots there from `block_tables`, which must already cover 1+K tokens there and the
        drafter's lookahead), with k = min(K, max(0, rooms[i] - c)): rooms[i] is the row's output room before that
        run (tokens it may still emit, minus one), so k is what the scheduler gives it once c is known; its
        other K - k tokens are padding. state_slots / rooms / block_tables (and the sampling lists, as in `run`):
        per row, from the host. Returns the packed results."""
        if self.step_fn is None:
            raise RuntimeError("step graphs: run_chained needs verify graphs (a step_fn)")
        if self._last is None or self._last[0] != prev_run:
            raise ValueError(f"step graphs: expected a step chained on the last run ({self.runs}), got run {prev_run}")
        _, m, prev_rows, prev = self._last
        T, rows = self.T, len(src)
        if not rows or len(state_slots) != rows or len(rooms) != rows or len(block_tables) != rows:
            raise ValueError(f"step graphs: expected as many state slots, rooms and block tables as rows ({rows}), "
                             f"got {len(state_slots)}, {len(rooms)} and {len(block_tables)}")
        if not all(0 <= j < prev_rows for j in src):
            raise ValueError(f"step graphs: expected rows of the last run (0..{prev_rows - 1}), got {src}")
        n = self.size_for(rows)
        width = max(len(b) for b in block_tables)
        if width > self.max_blocks:
            raise ValueError(f"step graphs: expected block tables of at most {self.max_blocks} blocks, got {width}")
        # The previous run's last-token positions, copied out: this step's inputs (and a capture's padding, next)
        # overwrite that buffer.
        self._prev_base[:m].copy_(self.verify_base[:m])
        variant = self._variant(rows, temperature, seeds, top_k, top_p)
        graphs = self.variants[variant]
        if self.capture and n not in graphs:
            graphs[n] = self._capture(n, variant)
        scratch_block, scratch_slot = self.pools.scratch_block, self.pools.scratch_slot
        flat = state_slots + [scratch_slot] * (n - rows)
        for part in sampling_parts(variant, n - rows, temperature, seeds, top_k, top_p):
            flat += part
        flat += src + rooms
        for b in block_tables:
            flat += b
            flat += [scratch_block] * (width - len(b))
        flat += [scratch_block] * ((n - rows) * width)
        end = self._stage(flat)
        self.state_slots[:n] = self.staging[:n]
        lists = self._stage_sampling(n, n, variant)  # where src, then rooms, start
        at = lists + 2 * rows
        self.block_tables[:n, :width] = self.staging[at:end].view(n, width)
        # Each row's inputs from the previous run's packed results [m counts | m*T emitted | m*K drafts]; rows past
        # this step's up to its graph size become padding (`ops.chain_inputs.reference`).
        self.model.kernels.chain_inputs(
            prev, m, self.staging[lists:lists + rows], self.staging[lists + rows:at], self._prev_base,
            self.block_tables[:n],
            self.ids, self.slot_mapping, self.seq_lens, self.verify_base, self.num_tokens, n, T, self.block_size,
            scratch_block)
        return self._replay(n, rows, variant)
