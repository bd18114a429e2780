"""Conversions between the `baton.v1` protobuf messages and the engine's types (torch-free: the router
uses them too)."""

from __future__ import annotations

from collections.abc import Sequence

from baton.engine.sampling_params import SamplingParams
from baton.engine.structured_output import StructuredOutput
from baton.engine.token_logprob import TokenLogprob
from baton.proto.v1 import generation_pb2 as gen

FINISH_TO_PROTO = {
    None: gen.FINISH_REASON_UNSPECIFIED,
    "stop": gen.FINISH_REASON_STOP,
    "length": gen.FINISH_REASON_LENGTH,
    "abort": gen.FINISH_REASON_ABORT,
}
FINISH_FROM_PROTO = {v: k for k, v in FINISH_TO_PROTO.items()}


def sampling_from_proto(p: gen.SamplingParams) -> SamplingParams:
    """Proto defaults follow `SamplingParams`; invalid values raise ValueError naming the field."""
    d = SamplingParams()
    return SamplingParams(
        max_tokens=p.max_tokens if p.HasField("max_tokens") else d.max_tokens,
        temperature=p.temperature if p.HasField("temperature") else d.temperature,
        top_p=p.top_p if p.HasField("top_p") else d.top_p,
        top_k=p.top_k if p.HasField("top_k") else d.top_k,
        seed=p.seed if p.HasField("seed") else None,
        stop_token_ids=tuple(p.stop_token_ids),
        ignore_eos=p.ignore_eos,
        min_p=p.min_p if p.HasField("min_p") else d.min_p,
        presence_penalty=p.presence_penalty if p.HasField("presence_penalty") else d.presence_penalty,
        frequency_penalty=p.frequency_penalty if p.HasField("frequency_penalty") else d.frequency_penalty,
        repetition_penalty=p.repetition_penalty if p.HasField("repetition_penalty") else d.repetition_penalty,
        logit_bias=dict(p.logit_bias),
        min_tokens=p.min_tokens if p.HasField("min_tokens") else d.min_tokens,
        logprobs=p.logprobs if p.HasField("logprobs") else None,
        prompt_logprobs=p.prompt_logprobs if p.HasField("prompt_logprobs") else None,
        structured_output=structured_from_proto(p.structured_output) if p.HasField("structured_output") else None,
    )


def structured_from_proto(p: gen.StructuredOutput) -> StructuredOutput:
    kind = p.WhichOneof("kind")
    if kind is None:
        raise ValueError("sampling field 'structured_output': expected one of json_object, json_schema, regex, lark "
                         "set, got none")
    if kind == "json_object":
        if not p.json_object:
            raise ValueError("sampling field 'structured_output.json_object': expected true, got false")
        return StructuredOutput(kind)
    return StructuredOutput(kind, getattr(p, kind))


def structured_to_proto(s: StructuredOutput) -> gen.StructuredOutput:
    if s.kind == "json_object":
        return gen.StructuredOutput(json_object=True)
    return gen.StructuredOutput(**{s.kind: s.value})


def sampling_to_proto(s: SamplingParams) -> gen.SamplingParams:
    p = gen.SamplingParams(max_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                           stop_token_ids=list(s.stop_token_ids), ignore_eos=s.ignore_eos)
    if s.seed is not None:
        p.seed = s.seed
    d = SamplingParams()
    for name in ("min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens"):
        if getattr(s, name) != getattr(d, name):
            setattr(p, name, getattr(s, name))
    p.logit_bias.update(dict(s.logit_bias))
    for name in ("logprobs", "prompt_logprobs"):
        if getattr(s, name) is not None:
            setattr(p, name, getattr(s, name))
    if s.structured_output is not None:
        p.structured_output.CopyFrom(structured_to_proto(s.structured_output))
    return p


def logprobs_to_proto(items: Sequence[TokenLogprob | None]) -> list[gen.TokenLogprob]:
    """The engine's logprobs as messages (a prompt's first entry, None, is left out: it has no context)."""
    return [gen.TokenLogprob(token_id=it.token_id, logprob=it.logprob,
                             top=[gen.TopLogprob(token_id=t, logprob=v) for t, v in it.top])
            for it in items if it is not None]
