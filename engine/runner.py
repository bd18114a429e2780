"""The model runner: the only place where the scheduler's ints become tensors.

`execute(out)` builds the varlen `ForwardBatch`, runs the model once over all rows (decode rows and prefill
chunks together), gathers the last token of every row that samples, and samples one token per such row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from baton.engine.cache_pools import CachePools
from baton.engine.forward_batch import ForwardBatch
from baton.engine.model import NemotronHForCausalLM
from baton.engine.sampling import Sampler, make_generator
from baton.engine.sampling_params import SamplingParams
from baton.engine.scheduler import SchedulerOutput


@dataclass
class StepOutput:
    sampled: dict[str, int]                      # request id -> next token
    logits: dict[str, torch.Tensor] | None = None  # request id -> [V] float32, when asked for


class ModelRunner:
    def __init__(self, model: NemotronHForCausalLM, pools: CachePools, block_size: int,
                 device: torch.device | str) -> None:
        self.model = model
        self.pools = pools
        self.block_size = block_size
        self.device = torch.device(device)
        self.sampler = Sampler()
        self._sampling: dict[str, tuple[SamplingParams, torch.Generator]] = {}
        self._kv, self._conv, self._ssm = pools.kv_layers(), pools.conv_layers(), pools.ssm_layers()

    # ---- per-request sampling state -------------------------------------------------------------
    def add_request(self, request_id: str, params: SamplingParams) -> None:
        self._sampling[request_id] = (params, make_generator(params.seed, self.device))

    def remove_request(self, request_id: str) -> None:
        self._sampling.pop(request_id, None)

    # ---- one step ---------------------------------------------------------------------------------
    def build_batch(self, out: SchedulerOutput) -> tuple[torch.Tensor, ForwardBatch]:
        bs = self.block_size
        input_ids: list[int] = []
        qsl = [0]
        slot_mapping: list[int] = []
        max_blocks = max(len(r.block_ids) for r in out.rows)
        block_tables = []
        for row in out.rows:
            input_ids.extend(row.token_ids)
            qsl.append(qsl[-1] + row.num_tokens)
            for pos in range(row.num_computed_tokens, row.num_computed_tokens + row.num_tokens):
                slot_mapping.append(row.block_ids[pos // bs] * bs + pos % bs)
            block_tables.append(list(row.block_ids) + [0] * (max_blocks - len(row.block_ids)))

        def t(x: list, dtype: torch.dtype = torch.int64) -> torch.Tensor:
            return torch.tensor(x, dtype=dtype, device=self.device)

        batch = ForwardBatch(
            num_decodes=out.num_decodes,
            query_start_loc=t(qsl),
            seq_lens=t([r.num_computed_tokens + r.num_tokens for r in out.rows]),
            block_tables=t(block_tables),
            slot_mapping=t(slot_mapping),
            state_slots=t([r.state_slot for r in out.rows]),
            has_initial_state=t([r.has_initial_state for r in out.rows], torch.bool),
            kv_caches=self._kv,
            conv_states=self._conv,
            ssm_states=self._ssm,
        )
        return t(input_ids), batch

    @torch.inference_mode()
    def forward_hidden(self, out: SchedulerOutput) -> tuple[torch.Tensor, ForwardBatch]:
        input_ids, batch = self.build_batch(out)
        return self.model(input_ids, batch), batch

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, return_logits: bool = False) -> StepOutput:
        if not out.rows:
            return StepOutput(sampled={})
        hidden, batch = self.forward_hidden(out)
        sample_rows = [i for i, r in enumerate(out.rows) if r.sample]
        if not sample_rows:
            return StepOutput(sampled={}, logits={} if return_logits else None)
        # The logits gather: the last token of every row that samples (R5).
        last = batch.query_start_loc[1:][sample_rows] - 1
        logits = self.model.logits(hidden[last])  # [R_s, V] float32
        ids = [out.rows[i].request_id for i in sample_rows]
        params = [self._sampling[r][0] for r in ids]
        gens = [self._sampling[r][1] for r in ids]
        tokens = self.sampler.sample(logits, params, gens).tolist()
        return StepOutput(
            sampled=dict(zip(ids, tokens, strict=True)),
            logits={r: logits[i] for i, r in enumerate(ids)} if return_logits else None,
        )
