"""Scale-out: the trainer sharded with FSDP2 over several ranks, and trainer ranks and sampler
replicas placed by Ray. The server reaches them through the same engine interfaces as in one
process (`stack.build_dist_stack`); see docs/deploy.md.

Modules: fsdp.py (sharding, the per-rank trainer, layer-by-layer gather), protocol.py
(settings, commands, replies), trainer_worker.py (a rank's command loop, torchrun entry),
launcher.py (torchrun group on this machine), remote.py (the server-side TrainEngine adapter),
ray_workers.py (Ray actors, the replica pool), stack.py (wiring for the server).
"""
