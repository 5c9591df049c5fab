"""A DLRM-style recommender trained on `trainer.sparse` embeddings: ``python -m trainer.recsys``.

    config     `RecsysConfig` from flags, checked once per job
    data       click logs: the planted synthetic log, Criteo TSV, per-step batches
    model      DLRM: bottom MLP, fused sharded embeddings, dot interactions, top MLP
    evaluate   validation log-loss and AUC, evals.jsonl and auc.png
    state      checkpoints: one shard per rank through `trainer.checkpoint`
    train      the training loop and the entry point
"""
