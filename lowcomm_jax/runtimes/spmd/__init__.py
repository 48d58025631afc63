"""The lockstep runtime: every process runs its hosts' programs, joined by jax.distributed.
train.py picks the driver by `Algorithm.progress` (driver.py: a mark per round; collab.py:
collaborative epochs); rounds.py runs one round's programs."""
