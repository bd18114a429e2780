"""The router: client-facing gRPC service, worker selection, disaggregation flow. Imports no torch."""
