"""Training on many processes: torchrun launches, FSDP2 shards, DCP checkpoints.

`env` wraps torch.distributed (world size, rank, collectives of Python objects); `parallelize`
shards a model; `rollout` splits generation across ranks; `checkpoint` commits sharded saves
and coordinates the save-directory lock. At world size 1 (no torchrun) none of it runs: the
single-process code path is unchanged.
"""
