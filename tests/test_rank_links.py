"""Rank 0's links to its other ranks' transfer agents (node/rank_transfer.py), over a real Unix socket: the ranks
announce themselves in any order and are kept in rank order; a rank that misses an answer leaves the links out of
step, and every later command is refused at once (the decode node then prefills locally) instead of reading a late
answer as the next one's."""

from __future__ import annotations

import socket
import time

import pytest

from baton.node.rank_transfer import Done, Forget, Hello, RankLinks, _recv, _send
from baton.transfer.errors import TransferError
from baton.transfer.metadata import RankAgent


def _rank(links: RankLinks, rank: int) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(links.path)
    _send(sock, Hello(RankAgent(rank, f"agent-{rank}", b"nixl", {})))
    return sock


def test_ranks_are_ordered_and_a_missed_answer_breaks_the_links():
    links = RankLinks(3)
    try:
        two, one = _rank(links, 2), _rank(links, 1)
        links.accept(timeout=5)
        assert [r.tp_rank for r in links.ranks] == [1, 2]
        links.send(Forget("peer"))
        for sock in (one, two):
            _recv(sock)
            _send(sock, Done())
        assert links.replies(5) == [Done(), Done()]
        links.send(Forget("peer"))
        _recv(one)
        _send(one, Done())  # rank 2 never answers
        t0 = time.monotonic()
        replies = links.replies(0.3)
        assert time.monotonic() - t0 < 2
        assert replies[0] == Done() and "rank 2 did not answer" in replies[1].message
        with pytest.raises(TransferError, match="out of step: rank 2 did not answer"):
            links.send(Forget("peer"))
        one.close()
        two.close()
    finally:
        links.close()


def test_ranks_that_do_not_announce_themselves_in_time_stop_the_node():
    links = RankLinks(3)
    try:
        sock = _rank(links, 1)
        with pytest.raises(RuntimeError, match="expected 2 within 0.2 s, got 1"):
            links.accept(timeout=0.2)
        sock.close()
    finally:
        links.close()
