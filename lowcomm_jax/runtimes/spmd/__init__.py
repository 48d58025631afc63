"""The lockstep runtime: every process runs its hosts' programs, joined by jax.distributed.
runner.py picks the driver (driver.py: a mark per round; runtimes/spmd/collab.py: collaborative epochs);
runtimes/spmd/rounds.py runs one round's programs."""
