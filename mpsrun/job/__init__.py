"""mpsrun.job."""
