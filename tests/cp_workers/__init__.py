"""Rank functions of the context-parallel tests (`tests.mpi_runs`)."""
