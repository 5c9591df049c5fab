"""Language-model data: byte-level text, or tokenized datasets on disk.

* `trainer.data.corpus`   a corpus every host has (or ``--data PATH``), its validation split
* `trainer.data.batches`  deterministic DP-sharded batches, seeded by (seed, step) alone

Tokenized datasets (``--data DIR``, ``--data a:0.7,b:0.3``):

* `trainer.data.prepare`        ``python -m trainer.data.prepare``: text files -> token shards
* `trainer.data.shard_writer`   shards, document index and checksums, written as ids arrive
* `trainer.data.token_files`    the on-disk format; windows read into the batch, blocks verified
  lazily
* `trainer.data.token_batches`  resumable DP-sharded order, blending, held-out split
* `trainer.data.sources`        what ``--data`` names: text, a tokenized dataset, a blend
"""
