"""Standard gRPC protocols Baton serves (see `baton.proto.codegen`)."""
