"""Generated stubs of the standard gRPC server reflection protocol, v1 (see `baton.proto.codegen`)."""
