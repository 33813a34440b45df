"""mpsrun.mps."""
