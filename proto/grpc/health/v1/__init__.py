"""Generated stubs of the standard gRPC health checking protocol (see `baton.proto.codegen`)."""
