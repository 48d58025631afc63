"""How processes are joined and driven: `spmd` (lockstep, jax.distributed), `simulator`
(a virtual clock on one process) and `ray` (actors that may crash, leave and join).
No runtime imports another; what two share lives in assemble/ or programs/."""
