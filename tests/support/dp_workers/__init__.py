"""Data-parallel workers run under ``mpiexec -n N`` by tests/trainer/test_data_parallel.py."""
