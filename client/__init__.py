"""Python SDK for Baton's gRPC API. Imports no torch."""
