"""The pipeline engine (pipeline_parallel_degree > 1) on torch.distributed.pipelining.

See docs/pipeline.md. ``engine.PipelineEngine`` (the Engine) drives ``runtime.PipelineRunner``:
partition.py cuts the module into stages, surgery.py rebuilds a stage, schedules.py picks the
torch schedule, mixed_precision.py and sharded_optimizer.py carry smp's fp16/bf16 and optimizer-state
sharding, checkpoint.py writes and reads a stage's files.
"""
