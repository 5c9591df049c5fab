"""Data-parallel workers run under ``mpiexec -n N`` by tests/test_data_parallel.py."""
