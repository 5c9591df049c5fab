"""Rank functions of the context-parallel tests (`tests.support.mpi_runs`)."""
