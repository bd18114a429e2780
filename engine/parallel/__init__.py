"""Tensor parallelism inside a node: one process per rank, each holding its shard of every layer (issue #50)."""
