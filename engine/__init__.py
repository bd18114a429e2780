"""Baton's engine: the hybrid Mamba2/attention model, its caches, scheduler and runner.

Shared by the prefill and the decode node. Imports no grpc, nixl, ray or prometheus.
"""
