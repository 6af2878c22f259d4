"""The engine worker's side: the executor and what it composes (live runs, batches, checkpoints, sampler versions)."""
