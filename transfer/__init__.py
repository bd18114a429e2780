"""Baton's transfer layer: everything NIXL. Registration of the cache pools, the metadata handshake,
coalesced descriptor plans, READ + notification, leases on the prefill side, and transfer stats.

Imports only the engine's cache description (no scheduler, no model)."""
