"""Pipeline-parallel training workers run under ``mpiexec -n N`` by tests/test_pp_training.py."""
