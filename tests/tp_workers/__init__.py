"""Tensor-parallel workers run under ``mpiexec -n N`` by tests/test_tp_layers.py and
tests/test_tp_training.py (one run per world size, shared by both modules: see `launch`)."""
