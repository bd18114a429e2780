"""Logits processing inside a whole-step verify graph (`cuda_graphs.StepGraphs`' processed variants).

A graph holds fixed shapes and addresses, so it takes the processing whose inputs are a few numbers per row and
tables that never move: the presence, frequency and repetition penalties, read from the runner's resident counts
and prompt bits (`penalty_counts`, allocated once, at fixed addresses), and min_p. A row with a logit_bias, a
min_tokens not reached yet or a grammar needs per-token lists or a host-built mask each step, so its steps run
eagerly, as do steps whose rows ask for logprobs.

In the graph every row is processed: a row without penalties reads the tables' zero row (one past the plan's state
slots, the scratch slot's index, which the padding rows take too) with presence 0, frequency 0, repetition 1 and,
without min_p, a threshold of -inf, which leave its logits exactly as they were (x - 0 * c - 0 * s = x, x / 1 = x).
The penalised rows' decided tokens are added to their counts in the graph (`count_decided`); the others' are masked
out, so the zero row stays zero.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from .logits_processing import LogitsInputs, RowHistory, count_decided, needs_processing
from .sampling_params import SamplingParams


def graph_processable(params: SamplingParams, history: RowHistory | None) -> bool:
    """Whether a row's processing (if any) is what a verify graph holds: penalties and min_p alone."""
    if history is None or not needs_processing(params, len(history.outputs)):
        return True
    return (not params.logit_bias and len(history.outputs) >= params.min_tokens
            and params.structured_output is None)


@dataclass(frozen=True)
class RowProcessing:
    """A graph step's per-row processing inputs, as `StepGraphs.run` stages them: the penalties, min_p (0 on greedy
    rows, as `logits_inputs` sets it) and the row of the penalty tables each row reads (the zero row where it has no
    penalties)."""

    presence: list[float]
    frequency: list[float]
    repetition: list[float]
    min_p: list[float]
    count_rows: list[int]

    @classmethod
    def of(cls, params: Sequence[SamplingParams], slots: Sequence[int], zero_row: int) -> RowProcessing:
        return cls([p.presence_penalty for p in params], [p.frequency_penalty for p in params],
                   [p.repetition_penalty for p in params], [0.0 if p.greedy else p.min_p for p in params],
                   [s if p.penalised else zero_row for p, s in zip(params, slots, strict=True)])


def graph_inputs(presence: Tensor, frequency: Tensor, repetition: Tensor, min_p: Tensor, temperature: Tensor,
                 count_rows: Tensor, counts: Tensor, prompt_bits: Tensor) -> LogitsInputs:
    """The `LogitsInputs` of a graph's n rows, every one processed, from its static per-row tensors [n] and the
    resident tables; built inside the capture (a few small device ops), no host read."""
    n, dev = presence.shape[0], presence.device
    rows = torch.arange(n, device=dev)
    none = torch.zeros(n, dtype=torch.int64, device=dev)
    no_pairs = torch.zeros(2, 0, dtype=torch.int64, device=dev)
    starts = torch.zeros(n + 1, dtype=torch.int64, device=dev)
    return LogitsInputs(
        rows=rows, batch_rows=tuple(range(n)), num_rows=n, anchor=none, anchor_counts=none, min_left=none,
        presence=presence, frequency=frequency, repetition=repetition, min_p=min_p, temperature=temperature,
        gen=no_pairs, prompt=no_pairs, bias=no_pairs, bias_values=torch.zeros(0, dtype=torch.float32, device=dev),
        stop=no_pairs, grammar=None, penalised=True, repetition_used=True, biased=False, min_tokens=False,
        min_p_used=True, counts=counts, prompt_bits=prompt_bits, count_rows=count_rows, record_rows=rows,
        record_slots=count_rows, index=rows, bias_start=starts, stop_start=starts)


def count_graph_decided(inputs: LogitsInputs, tokens: Tensor, zero_row: int) -> None:
    """`count_decided` for a graph's rows (tokens [n, T], -1 past the emitted ones): only the rows that read a
    slot's counts (not the zero row) count theirs."""
    count_decided(inputs, torch.where((inputs.count_rows != zero_row)[:, None], tokens, -1))
