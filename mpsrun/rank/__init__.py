"""mpsrun.rank."""
