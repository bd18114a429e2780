"""Server plumbing every server process shares, below the router, the nodes and the transfer layer: a port that
cannot be bound (`listen_error`) and the operations HTTP endpoints (`ops_http`). Imports no torch."""
