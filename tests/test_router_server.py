"""The router as a process: `python -m baton.router.server` serves until SIGTERM and exits cleanly; importing
the router never imports torch."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys

import grpc

from baton.proto.v1 import generation_pb2, generation_pb2_grpc
from baton.router.config import RouterConfig
from baton.router.server import main, serve
from tests.test_router_fakes import expected_tokens, run, start_fake


def test_router_imports_no_torch():
    code = ("import sys; import baton.router, baton.router.server, baton.router.service, baton.router.flow; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_main_rejects_bad_arguments(capsys):
    assert main(["--port", "0", "--decode", "nohost"]) == 2
    assert "decode_addrs" in capsys.readouterr().err


def test_serve_returns_a_started_server_that_stops_cleanly():
    async def go():
        fake, server, addr = await start_fake("decode", "d0")
        router = await serve(RouterConfig((), (addr,)), 0)
        assert isinstance(router, grpc.aio.Server)
        await router.stop(0)
        await server.stop(0)
    run(go())


def test_standalone_process_serves_until_sigterm():
    async def go():
        fakes = [await start_fake(role, f"{role[0]}0") for role in ("prefill", "decode")]
        (_, _, p_addr), (d_fake, _, d_addr) = fakes
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "baton.router.server", "--port", "0", "--prefill", p_addr, "--decode", d_addr,
            "--local-prefill-threshold", "2", stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
        try:
            line = (await asyncio.wait_for(proc.stdout.readline(), 15)).decode()
            m = re.match(r"baton router listening on 127\.0\.0\.1:(\d+)", line)
            assert m, line
            async with grpc.aio.insecure_channel(f"127.0.0.1:{m[1]}") as ch:
                stub = generation_pb2_grpc.GenerationStub(ch)
                assert (await stub.Health(generation_pb2.HealthRequest(), timeout=5)).ok
                req = generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=[1, 2, 3]))
                msgs = [x async for x in stub.Generate(req, timeout=5)]
                assert [t for x in msgs for t in x.token_ids] == expected_tokens([1, 2, 3])
                assert d_fake.decodes[0].HasField("handle")
            proc.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(proc.wait(), 15) == 0
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
            await asyncio.gather(*(s.stop(0) for _, s, _ in fakes))
    run(go())
