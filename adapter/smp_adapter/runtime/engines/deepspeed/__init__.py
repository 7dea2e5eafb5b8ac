"""The DeepSpeed engine (pipeline_parallel_degree 1) and everything that imports DeepSpeed.

engine.py             the Engine: deepspeed.initialize, ZeRO 0/1/3 steps, clipping, state dicts
config.py             the job's one DeepSpeed config (built once by smp.init) + the optimizer's arguments
groups.py             smp's process groups handed to DeepSpeed (mpu, hpZ), zero.Init's arguments
zero3.py              ZeRO-3 parameters: the one "is this a shard" test, delayed initialisation
                      materialised into shards module by module, partitioning at wrap time,
                      gathering for saves and TP splits
process_group.py      starting torch.distributed through DeepSpeed's comm layer; clearing its caches
universal_checkpoint.py  what a ZeRO checkpoint records for loading under another layout
parts.py              DeepSpeed pieces the pipeline engine reuses (partition solver, loss scalers)
"""
