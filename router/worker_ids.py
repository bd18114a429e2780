"""How long a request's id on the workers stays its own after the request ended."""

# A node may still be ending a request (its Abort or stream cancellation on the way, its last step in flight, the
# lease of its prefill not yet released) when a new request with the same id arrives: for this long after a request
# ended, a new one under its id gets a distinct id on the workers.
ID_REUSE_AFTER_S = 30.0
