"""Tensor-parallel workers run under ``mpiexec -n N`` by tests/trainer/test_tp_layers.py and
tests/trainer/test_tp_training.py (one run per world size, shared by both modules: see `launch`)."""
