"""Rotary position embedding (the torch reference; its Triton kernel is still to come)."""
