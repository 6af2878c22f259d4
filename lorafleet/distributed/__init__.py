"""Scale-out: the trainer sharded with FSDP2 over several ranks, and trainer ranks and sampler
replicas placed by Ray. The server reaches them through the same engine seams as in one
process (`lorafleet.interfaces`, built by `lorafleet.engines.build_engines`); see
docs/deploy.md.

Modules: placement.py (the placement flags, plain data), fsdp.py (sharding, the per-rank
trainer, layer-by-layer gather), protocol.py (settings, commands, replies), trainer_worker.py (a
rank's command loop, torchrun entry), launcher.py (torchrun group on this machine), remote.py
(the server-side `Trainer` over the ranks), ray_cluster.py (joining a Ray cluster),
ray_trainer.py (trainer ranks as Ray actors), ray_samplers.py (sampler replicas, the pool and
its version store), wire.py (adapter tensors through the object store).
"""
