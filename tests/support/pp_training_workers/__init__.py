"""Pipeline-parallel training workers run under ``mpiexec -n N`` by
tests/trainer/test_pp_training.py."""
