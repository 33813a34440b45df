"""mpsrun.tools."""
