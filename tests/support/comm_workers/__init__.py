"""Worker scripts run under `mpiexec` by the communication tests, and the helper that runs them."""
