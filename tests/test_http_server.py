"""The router's HTTP server (router/asgi_server.py, Hypercorn on the router's loop), over fake workers.

HTTP/1.1 keep-alive (JSON and SSE answers over one connection) and HTTP/2 (h2c, several streams on one
connection); half-sent requests (slowloris) are closed after the idle timeout while a normal request is
answered, without a thread per held connection; a body that trickles gets 408; an idle keep-alive
connection is closed; the port binds only the address --host names; operations routes on the same port; a
write the client never takes ends the request after the write timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import threading
import time

import httpx2
import pytest

from baton.router.http_exchange import ClientGone, Exchange
from baton.router.http_limits import HttpLimits
from tests.test_openai_http import fake_front
from tests.test_router_fakes import expected_tokens, run

FAST = HttpLimits(idle_timeout_s=1.0, body_timeout_s=1.0)
COMPLETION = {"model": "fake", "prompt": [5, 6, 7], "max_tokens": 4, "return_token_ids": True}


def _post(conn: http.client.HTTPConnection, body: dict) -> http.client.HTTPResponse:
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    return conn.getresponse()


def test_keep_alive_serves_json_and_sse_over_one_http11_connection():
    def client(port: int) -> list:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        seen = []
        for i in range(3):
            r = _post(conn, COMPLETION)
            seen.append((r.version, r.status, json.loads(r.read())["choices"][0]["token_ids"]))
            sse = _post(conn, {**COMPLETION, "stream": True})
            events = [line for line in sse.read().decode().split("\n\n") if line]
            seen.append((sse.version, sse.status, sse.getheader("content-type"), events[-1]))
            conn.request("GET", "/health")
            h = conn.getresponse()
            seen.append((h.status, json.loads(h.read())["ok"]))
            seen.append(conn.sock.getsockname() if i == 0 else conn.sock.getsockname() == seen[3])
        conn.close()
        return seen

    async def go():
        async with fake_front() as env:
            seen = await asyncio.to_thread(client, env.router.http.port)
            ids = expected_tokens([5, 6, 7], 4)
            for i in range(3):
                assert seen[4 * i] == (11, 200, ids)
                assert seen[4 * i + 1] == (11, 200, "text/event-stream", "data: [DONE]")
                assert seen[4 * i + 2] == (200, True)
            assert seen[7] is True and seen[11] is True  # the same local port: one connection throughout

    run(go())


def test_http2_streams_share_one_connection():
    async def go():
        async with fake_front() as env:
            env.decode.token_delay_s = 0.01
            async with httpx2.AsyncClient(http1=False, http2=True, trust_env=False, timeout=10) as c:
                url = f"http://127.0.0.1:{env.router.http.port}/v1/completions"

                async def one(i: int) -> tuple[str, list[int]]:
                    body = {**COMPLETION, "prompt": [5, 6, i], "stream": True}
                    async with c.stream("POST", url, json=body) as r:
                        assert r.status_code == 200
                        ids = []
                        async for line in r.aiter_lines():
                            if line.startswith("data: {"):
                                ids += json.loads(line[6:])["choices"][0]["token_ids"]
                        return r.http_version, ids

                out = await asyncio.gather(*(one(i) for i in range(20)))
            assert out == [("HTTP/2", expected_tokens([5, 6, i], 4)) for i in range(20)]

    run(go())


async def _eof_within(reader: asyncio.StreamReader, timeout: float) -> bool:
    """True if the server closed the connection (after answering, maybe) within `timeout`."""
    with contextlib.suppress(TimeoutError, ConnectionError):
        async with asyncio.timeout(timeout):
            while await reader.read(65536):
                pass
            return True
    return False


def test_half_sent_requests_are_dropped_without_a_thread_each():
    async def go():
        async with fake_front(limits=FAST) as env:
            port = env.router.http.port
            async with httpx2.AsyncClient(trust_env=False, timeout=10) as c:
                url = f"http://127.0.0.1:{port}/v1/completions"
                assert (await c.post(url, json=COMPLETION)).status_code == 200  # warm: the parse threads exist
                threads = threading.active_count()
                held = []
                for i in range(300):
                    reader, writer = await asyncio.open_connection("127.0.0.1", port)
                    # Headers that never end, or a request line that never ends.
                    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-" if i % 2 else b"GET /he")
                    held.append((reader, writer))
                await asyncio.sleep(0.2)
                assert threading.active_count() <= threads + 2
                t0 = time.monotonic()
                r = await c.post(url, json=COMPLETION)  # served meanwhile
                assert r.status_code == 200 and time.monotonic() - t0 < 1.0
                closed = await asyncio.gather(*(_eof_within(rd, FAST.idle_timeout_s + 3) for rd, _ in held))
                assert all(closed), f"{closed.count(False)} of {len(held)} half-sent requests still held"
                for _, w in held:
                    w.close()
                assert (await c.post(url, json=COMPLETION)).status_code == 200

    run(go())


def test_trickled_body_gets_408_and_idle_keep_alive_connection_is_closed():
    async def go():
        async with fake_front(limits=FAST) as env:
            port = env.router.http.port
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100\r\n\r\n{\"prompt\": ")
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), FAST.body_timeout_s + 3)
            assert head.startswith(b"HTTP/1.1 408")
            assert await _eof_within(reader, 3)
            writer.close()
            # A served connection left idle is closed after the idle timeout.
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200")
            t0 = time.monotonic()
            assert await _eof_within(reader, FAST.idle_timeout_s + 3)
            assert time.monotonic() - t0 >= FAST.idle_timeout_s - 0.2
            writer.close()

    run(go())


def _listening_addresses(port: int) -> set[str]:
    """Local addresses (hex, as /proc/net/tcp* lists them) of the sockets listening on `port`."""
    out = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(FileNotFoundError), open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                addr, p = local.split(":")
                if state == "0A" and int(p, 16) == port:  # 0A: LISTEN
                    out.add(addr)
    return out


@pytest.mark.skipif(not __import__("os").path.exists("/proc/net/tcp"), reason="reads Linux's /proc/net/tcp")
def test_binds_only_the_host_address_and_serves_operations_routes():
    async def go():
        async with fake_front() as env:
            port = env.router.http.port
            assert _listening_addresses(port) == {"0100007F"}  # 127.0.0.1 only
            async with httpx2.AsyncClient(trust_env=False, timeout=10) as c:
                base = f"http://127.0.0.1:{port}"
                assert (await c.get(base + "/health")).json()["ok"] is True
                assert "baton_router_requests_total" in (await c.get(base + "/metrics")).text
                assert {w["role"] for w in (await c.get(base + "/v1/workers")).json()} == {"prefill", "decode"}
                missing = await c.get(base + "/nope")
                assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"

    run(go())


def test_a_write_the_client_never_takes_ends_as_client_gone_after_the_write_timeout():
    # A send that never completes stands for a client whose receive window stays full (filling real socket
    # buffers would take megabytes of tokens).
    async def go():
        never = asyncio.Event()

        async def send(message: dict) -> None:
            if message["type"] == "http.response.body":
                await never.wait()

        async def receive() -> dict:
            return {"type": "http.request", "body": b"{}", "more_body": False}

        scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}
        ex = Exchange(scope, receive, send, HttpLimits(write_timeout_s=0.3))
        t0 = time.monotonic()
        with pytest.raises(ClientGone):
            await ex.event({"choices": []})
        assert 0.25 < time.monotonic() - t0 < 2

    run(go())
