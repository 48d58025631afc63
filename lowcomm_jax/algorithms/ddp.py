"""DDP: every worker's gradient at θ, averaged every step, stepped by the per-step optimizer.

A round is one step: the local program is ∇L(θ; batch_w) (no local parameters), the sync
all-reduces it (or, with `compress.codec=demo`, all-gathers DeMo's compressed momentum) and
the outer rule is the inner optimizer itself — or DeMo's sign descent. In the simulator
every step is a round: the slowest worker's step, then one ring all-reduce of the gradient
over the virtual links (all-gather of DeMo's payloads), which is what a WAN does to DDP.
"""

import optax

from lowcomm_jax import compress
from lowcomm_jax.programs import optimizers
from lowcomm_jax.algorithms.base import Algorithm, field_problem
from lowcomm_jax.parallel.flat import tree_view


class DDP(Algorithm):
  name = "ddp"
  summary = "average gradients every step (inner_steps must be 1)"
  local_steps = False

  def problems(self, c):
    out = []
    if c.inner_steps != 1:
      out.append(field_problem(c, "inner_steps", "ddp averages gradients every step; set "
                               "--config.inner_steps=1 (and raise rounds for more steps)"))
    if c.outer.dylu:
      out.append(field_problem(c, "outer.dylu", "Dynamic Local Updates need local steps; use "
                               "an algorithm with them, e.g. diloco or async_dn"))
    for i, row in enumerate(c.hosts):
      if row.get("inner_steps", 0) not in (0, 1):
        out.append(f"hosts[{i}].inner_steps={row['inner_steps']}: ddp takes one step per "
                   "round; leave it 0")
    return out

  def progress(self, c):
    # A target batch makes a step an epoch that unequal peers fill together (collab.*).
    return "epochs" if c.collab.target_batch_size > 0 else "rounds"

  def outer_rule(self, c, inner_tx, layout) -> optax.GradientTransformation:
    codec = compress.spec(c.compress.codec)
    if codec is not None and codec.sign_descent:  # DeMo: the decoded mean's sign
      return tree_view(optimizers.sign_descent(c.optimizer, c.rounds), layout)
    return tree_view(inner_tx, layout)


ALGORITHM = DDP()
