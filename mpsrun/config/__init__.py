"""mpsrun.config."""
