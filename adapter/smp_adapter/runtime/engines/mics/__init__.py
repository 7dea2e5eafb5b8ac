"""smp v1's MiCS (sharded_data_parallel_degree < rdp) on torch FSDP2 hybrid sharding (engine.py)."""
