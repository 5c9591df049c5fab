"""Byte-level language-model data.

* `trainer.data.corpus`   a corpus every host has (or ``--data PATH``), its validation split
* `trainer.data.batches`  deterministic DP-sharded batches, seeded by (seed, step) alone
"""
