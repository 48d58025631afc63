"""The simulator: virtual workers on one process, a virtual clock, speeds and a shared
network (lowcomm_jax/sim/ schedules them; backend.py runs the math with the runner's programs)."""
