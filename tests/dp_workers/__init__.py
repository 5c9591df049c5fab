"""Multi-process data-parallel workers, run under ``mpiexec -n N`` by tests/test_data_parallel.py."""
