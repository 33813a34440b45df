"""mpsrun.node."""
