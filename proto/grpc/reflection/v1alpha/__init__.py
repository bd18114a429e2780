"""Generated stubs of the standard gRPC server reflection protocol, v1alpha (see `baton.proto.codegen`)."""
