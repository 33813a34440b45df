"""mpsrun.session."""
