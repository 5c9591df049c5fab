"""What context parallelism runs with, refused when the options are read, before any rank
builds anything (pure: no torch, no communicator; `trainer.config.options.TrainConfig` calls
`check_context` with its values)."""

from __future__ import annotations

from trainer.errors import ConfigError


def check_context(*, cp: int, seq_len: int, tp: int = 1, sequence_parallel: bool = False,
                  dropout: float = 0.0, compiled: bool = False,
                  zero_shard_size: int = 0) -> None:
    """Refuse a sequence that does not split over ``cp`` ranks, and what ``--cp`` does not run
    with yet. Each message names the flags.

    Mixture-of-experts layers run: routing is per token, and an expert's copies span cp
    (`trainer.parallel.expert.parallel.EXPERT_REPLICAS`). Their load-balancing loss and
    capacity are taken over each rank's tokens, as under data parallelism. ZeRO-1, 2 and 3
    shard over dp x cp (the ``dp_cp`` group: cp ranks hold the same weights); hybrid sharding
    (``--zero-shard-size``) is not combined with cp yet."""
    if cp == 1:
        return
    chunks = 2 * cp
    if seq_len % chunks:
        below = seq_len - seq_len % chunks
        nearest = f"{below} or {below + chunks}" if below else str(chunks)
        raise ConfigError(
            "sequence does not split over the context-parallel ranks",
            f"--seq-len {seq_len} --cp {cp}",
            f"the sequence is cut into 2 x cp = {chunks} equal chunks (zig-zag: rank r holds "
            f"chunks r and {chunks - 1} - r), and {chunks} does not divide {seq_len}",
            f"Choose a --seq-len that is a multiple of {chunks} (e.g. {nearest}), or a --cp "
            f"for which 2 x cp divides {seq_len}")
    local = seq_len // cp
    if sequence_parallel and local % tp:
        raise ConfigError(
            "sequence parallelism does not split a context-parallel rank's tokens",
            f"--sequence-parallel --tp {tp} --cp {cp} --seq-len {seq_len}",
            f"each cp rank holds {local} tokens, which do not divide over tp {tp}",
            f"Choose a --seq-len that is a multiple of {chunks * tp}")
    refused = [flag for flag, on in ((f"--dropout {dropout}", dropout != 0.0),
                                     ("--compile", compiled),
                                     (f"--zero-shard-size {zero_shard_size}",
                                      zero_shard_size > 0)) if on]
    if refused:
        raise ConfigError(
            "unsupported combination", f"--cp {cp} with {', '.join(refused)}",
            "context parallelism does not run with dropout (a rank draws its attention "
            "probabilities block by block, so a mask would depend on the layout), compiled "
            "blocks (the K/V exchange is inside the attention) or hybrid sharding yet",
            f"Drop {', '.join(refused)} (--dropout 0; ZeRO-3 shards over dp x cp without "
            "--zero-shard-size), or train with --cp 1")
