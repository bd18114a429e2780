"""The prefill node: an engine that only prefills (N-1 tokens) and leases the caches to decode nodes."""
