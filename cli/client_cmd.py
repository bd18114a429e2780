"""`baton client generate`: send prompts to a running router, all in flight at once, and print the completions
in input order, as `baton generate` prints them."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

from baton.client import AsyncClient, BatonError, Completion
from baton.node.engine_args import add_sampling_args, parse_ids, sampling_options

PROG = "baton client generate"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("client", help="talk to a running Baton router over gRPC")
    client_sub = p.add_subparsers(dest="client_command", required=True, metavar="COMMAND")
    g = client_sub.add_parser("generate", help="generate through a router; one line per prompt, in input order")
    g.add_argument("--addr", required=True, help="the router's gRPC address, HOST:PORT")
    # Both prompt flags append to one list so that mixed token-id and text prompts keep their input order.
    g.add_argument("--prompt-ids", dest="prompts", type=parse_ids, action="append", default=[],
                   help='a prompt as token ids, e.g. "1 2 3"; repeat for more prompts (sent concurrently)')
    g.add_argument("--prompt", dest="prompts", action="append", default=[],
                   help="a text prompt (the model needs a tokenizer); repeatable, mixable with --prompt-ids")
    g.add_argument("--json", action="store_true", help="one JSON object per prompt, in input order")
    add_sampling_args(g)
    c = g.add_argument_group("connection")
    c.add_argument("--timeout", type=float, default=None, help="deadline of each request in seconds")
    c.add_argument("--api-key", default=os.environ.get("BATON_API_KEY"),
                   help="sent as a bearer token (default: $BATON_API_KEY)")
    c.add_argument("--tls", action="store_true", help="connect over TLS with the system's root certificates")
    c.add_argument("--root-certificates", type=Path, default=None, help="PEM file of root certificates (implies --tls)")
    g.set_defaults(run=run)


def run(a: argparse.Namespace) -> int:
    if not a.prompts:
        return _fail("give at least one --prompt-ids or --prompt", 2)
    try:
        roots = a.root_certificates.read_bytes() if a.root_certificates else None
    except OSError as e:
        return _fail(f"cannot read --root-certificates: {e}", 2)
    t0 = time.perf_counter()
    try:
        outs = asyncio.run(_generate_all(a, roots))
    except BatonError as e:
        return _fail(f"{e.code}: {e.message}", 2 if e.code == "INVALID_ARGUMENT" else 1)
    except ValueError as e:
        # A token id outside uint32 is refused while the request is built, before anything is sent.
        return _fail(str(e), 2)
    dt = time.perf_counter() - t0
    for prompt, o in zip(a.prompts, outs, strict=True):
        print(_json_line(prompt, o) if a.json else _text_line(prompt, o))
    n = sum(len(o.token_ids) for o in outs)
    print(f"{len(outs)} prompts, {n} tokens in {dt:.2f} s ({n / dt:.1f} tok/s)", file=sys.stderr)
    return 0


async def _generate_all(a: argparse.Namespace, roots: bytes | None) -> list[Completion]:
    # The first failure ends the command; leaving the client cancels the requests still in flight.
    async with AsyncClient(a.addr, timeout=a.timeout, api_key=a.api_key, tls=a.tls,
                           root_certificates=roots) as client:
        return list(await asyncio.gather(*(
            client.generate(p, **sampling_options(a)) for p in a.prompts)))


def _json_line(prompt: list[int] | str, o: Completion) -> str:
    spec = {"drafted": o.num_drafted_tokens, "accepted": o.num_accepted_tokens}
    if isinstance(prompt, str):
        return json.dumps({"prompt": prompt, "token_ids": list(o.token_ids), "text": o.text,
                           "finish_reason": o.finish_reason, "spec": spec})
    return json.dumps({"prompt_ids": list(prompt), "token_ids": list(o.token_ids), "finish_reason": o.finish_reason,
                       "spec": spec})


def _text_line(prompt: list[int] | str, o: Completion) -> str:
    if isinstance(prompt, str):
        return f"{prompt!r} -> {o.text!r} {list(o.token_ids)} ({o.finish_reason})"
    return f"{list(prompt)} -> {list(o.token_ids)} ({o.finish_reason})"


def _fail(message: str, code: int) -> int:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return code
