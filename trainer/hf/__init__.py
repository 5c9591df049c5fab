"""Hugging Face interop: dtrain's Llama to and from the folders transformers reads and writes.

* `trainer.hf.config`   ``config.json`` / ``generation_config.json`` both ways; what is refused
* `trainer.hf.names`    which Hugging Face tensors make each dtrain parameter (fused k/v,
  gate/up), and back
* `trainer.hf.weights`  sharded safetensors with an index, written shard by shard, read by slice
* `trainer.hf.folder`   a whole folder: written atomically (export), read and loaded (import)
* `trainer.hf.source`   what a run started from a folder keeps of it: its tokenizer, special
  ids and ``max_position_embeddings``, for sampling and export
"""
