"""Pipeline-parallel workers run under ``mpiexec -n N`` by tests/test_pp_runtime.py."""
