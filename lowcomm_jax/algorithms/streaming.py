"""Streaming DiLoCo (Douillard et al. 2025): the model is split into P fragments that sync in
turn, so a worker never sends the whole model at once and each transfer can hide behind
inner steps.

A round of H inner steps is P segments of H/P steps. Segment p ends with fragment p's sync:
the workers' Δ_w,p = θ_p − θ_w,p (θ_p: the fragment's global value since its last sync) are
aggregated (codecs apply per fragment) and fragment p's own outer optimizer moves θ_p. The
new θ_p reaches the workers τ = streaming.overlap_steps steps later, during the next
segment, and is mixed in with α = streaming.mix:

    θ_w,p ← (1 − α)·θ_p + α·θ_w,p

so each fragment syncs once per H steps, staggered by H/P. With P = 1, τ = 0, α = 0 this
is DiLoCo exactly. Fragments ('strided', the default): block i belongs to fragment i mod P,
so every fragment spans the depth of the network; 'sequential': contiguous groups of blocks.
The embeddings (tied to the head), position table and final norm travel together with the
lightest fragment (fragment 0 when P divides the number of blocks).

Per-host H (the host table) is allowed when every host's H is a multiple of P with
H/P > τ: the hosts' segments then end, and sync, together. DyLU is not: its measured H
would not keep that alignment.
"""

import ml_collections

from lowcomm_jax.algorithms.base import Segment, field_problem
from lowcomm_jax.algorithms.diloco import DiLoCo, codec_problems
from lowcomm_jax.model.pretrained import architecture_of

LAYOUTS = ("strided", "sequential")


def block_of(path) -> int | None:
  """The transformer block a parameter leaf belongs to (None: embeddings, final norm)."""
  keys = [getattr(k, "key", getattr(k, "idx", None)) for k in path]
  if len(keys) >= 2 and keys[0] == "blocks":
    return int(keys[1])
  return None


def fragment_of_blocks(n_layer: int, fragments: int, layout: str) -> list[int]:
  """Each block's fragment."""
  if layout == "strided":
    return [i % fragments for i in range(n_layer)]
  return [i * fragments // n_layer for i in range(n_layer)]


class StreamingDiLoCo(DiLoCo):
  name = "streaming"
  server_schedule = False  # (its simulator schedule has no parameter server's form)
  config_section = "streaming"
  summary = ("Streaming DiLoCo: P model fragments sync in turn every H/P steps, each applied "
             "tau steps later and mixed with alpha")

  def config_defaults(self):
    s = ml_collections.ConfigDict()
    s.fragments = 2  # P: model fragments; one syncs every H/P inner steps (H % P == 0)
    s.layout = "strided"  # 'strided' (block i in fragment i % P) | 'sequential' (contiguous blocks)
    s.overlap_steps = 0  # tau: inner steps between sending a fragment and applying its update (< H/P)
    s.mix = 0.0  # alpha: theta_w,p <- (1 - alpha) * theta_p + alpha * theta_w,p when it lands
    return s

  def problems(self, c):
    s = c.streaming
    out = codec_problems(c)
    arch = architecture_of(c.model)  # the preset's, or model.init_from's
    n_layer = arch.n_layer if arch else None
    if s.fragments < 1 or (n_layer and s.fragments > n_layer):
      most = n_layer or "the number of blocks"
      out.append(field_problem(c, "streaming.fragments", f"must be in [1, {most}] (each "
                               "fragment holds at least one block)"))
    if s.layout not in LAYOUTS:
      out.append(field_problem(c, "streaming.layout", f"use one of {LAYOUTS}"))
    if s.overlap_steps < 0:
      out.append(field_problem(c, "streaming.overlap_steps", "must be >= 0 (0: applied at once)"))
    if not 0.0 <= s.mix < 1.0:
      out.append(field_problem(c, "streaming.mix", "alpha must be in [0, 1) (0: take the "
                               "global fragment as it is)"))
    if c.outer.dylu:
      out.append(field_problem(c, "outer.dylu", "streaming's fragments sync at fixed steps; "
                               "DyLU's measured H would break that; set outer.dylu=False"))
    if s.fragments >= 1:
      fields = [("inner_steps", c.inner_steps)] + [
          (f"hosts[{i}].inner_steps", row["inner_steps"]) for i, row in enumerate(c.hosts)
          if row.get("inner_steps", 0)]
      for field, h in fields:
        if h >= 1 and (h % s.fragments or h // s.fragments <= s.overlap_steps):
          out.append(f"{field}={h}: H={h} must be a multiple of streaming.fragments="
                     f"{s.fragments} with H/P > streaming.overlap_steps={s.overlap_steps} "
                     "(a fragment's update lands before the next sync); change H, P or tau")
    return out

  def leaf_fragments(self, c, abstract_params):
    import jax
    s = c.streaming
    paths = [path for path, _ in jax.tree_util.tree_flatten_with_path(abstract_params)[0]]
    leaves = jax.tree.leaves(abstract_params)
    blocks = [block_of(p) for p in paths]
    n_layer = max(b for b in blocks if b is not None) + 1
    of_block = fragment_of_blocks(n_layer, s.fragments, s.layout)
    size = [0] * s.fragments
    for b, leaf in zip(blocks, leaves):
      if b is not None:
        size[of_block[b]] += leaf.size
    lightest = size.index(min(size))
    return tuple(lightest if b is None else of_block[b] for b in blocks)

  def segments(self, c, inner_steps):
    p, tau = c.streaming.fragments, c.streaming.overlap_steps
    steps = inner_steps // p
    return [Segment(start=i * steps, steps=steps, sync=i, mix=(i - 1) % p, mix_at=tau)
            for i in range(p)]

  def mix(self, c):
    return float(c.streaming.mix)

  def schedule(self, plan, backend):
    from lowcomm_jax.sim.sync_schedules import StreamingRounds
    return StreamingRounds(plan, backend)


ALGORITHM = StreamingDiLoCo()
