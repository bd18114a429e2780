"""Generated protobuf and gRPC stubs of the `baton.v1` API (see `baton.proto.codegen`)."""
