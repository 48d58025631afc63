"""A run's life in its workdir: the run loop, its files, identity, checkpoints, lock, metrics
and the compilation cache. Knows nothing of how a runtime trains."""
