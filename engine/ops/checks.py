"""Argument checks shared by the operators: a wrong shape is a `ValueError` naming the operator, the
argument, the expected shape and the one given."""

from __future__ import annotations

from torch import Tensor


def check_shape(fn: str, name: str, t: Tensor, dims: str, expected: tuple[int, ...]) -> None:
    if tuple(t.shape) != expected:
        raise ValueError(f"{fn}: {name} expected shape {dims} = {expected}, got {tuple(t.shape)}")
