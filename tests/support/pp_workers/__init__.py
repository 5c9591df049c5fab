"""Pipeline-parallel workers run under ``mpiexec -n N`` by tests/trainer/test_pp_runtime.py."""
