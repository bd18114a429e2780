"""The `.proto` sources of Baton's APIs and their generated Python stubs."""
