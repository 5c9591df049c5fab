"""Sharded-embedding and DLRM workers run under ``mpiexec -n G`` by tests/test_sparse_*.py."""
