"""Padded-vocabulary training workers run under ``mpiexec -n 4`` by
tests/trainer/test_padded_vocab_training.py."""
