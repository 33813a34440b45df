"""mpsrun.runtime."""
