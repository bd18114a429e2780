"""Model layers (pure torch; GPU kernels plug in underneath via `baton.engine.ops`)."""
