"""The sync seam: how a run turns its workers' Δ of a fragment into the update its outer
rule steps with. One `Sync` per run (`Algorithm.sync` returns it), asked by the runner's
programs (assemble/build.py), the simulator's plan (its wire bytes) and its parameter servers (the
codec's round trip): the codec is built once, here.

Today's choice, from the config:
- a robust rule or signal weights (`aggregate.rule`, `aggregate.signal`, `aggregate.bucket`)
  all-gather the updates (with a codec: its payloads, decoded per sender) and combine them
  ahead of the outer rule (`outer`); the combination's state lives with the rule's;
- else with a codec (`compress.codec`) the compressed mean (encode, all-gather payloads,
  decode), tier- or token-weighted where `nested`; with compress.reduce='scatter' a
  quantized reduce-scatter instead (aggregate/compressed.py, compress/sharded.py);
- else the nested (tier-masked, weighted) mean where some worker trains a narrower FFN or
  workers are weighted by tokens, and the plain all-reduce mean otherwise.
Attacks (`attack.*`, tests and benchmarks) replace what the listed workers send first.

With a codec, on workers spread over several devices, the sync maps its workers per device
(`per_device`, parallel/workers.py): each device encodes its own workers' Δ, and only their
payloads cross devices. Left to XLA's partitioner, top-k, random-k and DeMo all-gathered the
dense Δ, 100x the payload. On one device nothing crosses, and the vmap's program stays.
"""

import ml_collections
import optax

from lowcomm_jax import aggregate, compress
from lowcomm_jax.errors import Problems
from lowcomm_jax.parallel import ledger, workers
from lowcomm_jax.parallel.flat import ParamLayout, tree_view


def needs_nested_mean(config: ml_collections.ConfigDict, hosts, d_ff: int) -> bool:
  """Plain mean unless some worker trains a narrower FFN or workers are weighted by tokens
  (or, in collaborative epochs, by their samples)."""
  return (config.collab.target_batch_size > 0 or config.aggregate.weighting == "tokens"
          or any(h.hidden != d_ff for h in hosts))


def robust_combination(config: ml_collections.ConfigDict) -> bool:
  """Whether the sync combines all-gathered updates by a robust rule or signal weights
  (aggregate/robust.py) instead of the plain mean's all-reduce."""
  a = config.aggregate
  return a.rule != "mean" or a.signal != "none" or a.bucket > 1


def scatter_problems(config: ml_collections.ConfigDict, algorithm) -> list[str]:
  """What stops compress.reduce='scatter' for `algorithm`: a reduce-scatter's owners are
  the sync's workers, and each reads only its shard of every payload."""
  out = Problems(config)
  if config.compress.reduce != "scatter":
    return out
  out.check(algorithm.synchronous and config.collab.target_batch_size == 0, "compress.reduce",
            f"{config.algorithm}'s pushes or a collaborative epoch's gradients meet at a "
            "server, with nothing to scatter: use 'gather'")
  out.check(not robust_combination(config), "compress.reduce",
            "robust rules and signal weights read every worker's whole row, which a "
            "reduce-scatter never gathers: use 'gather'")
  return out


class Sync:
  """The config-driven sync of a run whose hosts train `d_ff`-wide models or narrower."""
  # `consensus(per-worker state [R, ...]) -> θ_p`, for syncs whose workers keep their own
  # outer weights in the aggregator's state (NoLoCo): θ on rounds that read it. None: the
  # outer rule moves θ.
  consensus = None
  # `partners(round_index) -> [each worker slot's peer]`, for syncs whose workers each swap
  # with one peer a round (NoLoCo's gossip), with `swap_payload(own, Δ)` (what a worker
  # sends its peer) and `swap_step(own, mine, theirs)` (its new own state), `own` its row
  # of the aggregator's state as flat vectors: what two workers run alone (the Ray
  # runtime's peer form). None: the sync combines every worker's row.
  partners = None

  def fill_absent(self, deltas_RxN, present, per_worker_state, round_index: int):
    """Δ rows [R, N] (host numpy) for a parameter server's round that the workers not
    `present` missed, for a sync whose workers keep their own state in it (`consensus`):
    what the absent rows hold so that the present workers' step is what the algorithm wants
    without them. Their own rows of the state are restored after the step. The default
    leaves the zeros (a mean weighs the absent rows 0 in `make_server_sync`, which other
    syncs run)."""
    del present, per_worker_state, round_index
    return deltas_RxN

  def __init__(self, config: ml_collections.ConfigDict, hosts, d_ff: int):
    c = config
    self.config = c
    self.codec = compress.make_codec(c.compress, lr=c.optimizer.lr, shards=c.num_workers)
    self.nested = needs_nested_mean(c, hosts, d_ff)
    # A collaborative epoch weighs each worker's mean gradient by its samples (the signals'
    # token counts), as token weighting does.
    self.weigh_tokens = c.collab.target_batch_size > 0 or c.aggregate.weighting == "tokens"
    self.robust = robust_combination(c)
    self.place(replica_devices=2)  # until the runner places it: as on several devices
    self.attack = aggregate.make_attack(tuple(c.attack.workers), c.attack.kind,
                                        c.attack.scale, c.num_workers)

  def aggregator(self, layout: ParamLayout) -> optax.GradientTransformationExtraArgs:
    """How the workers' Δ of one fragment (flat, `layout` is the fragment's) become one
    update: the sync's only communication. The plain mean runs on the flat buffer as is;
    codecs (per tensor) and the nested mean (tier masks per FFN leaf) see the tree."""
    seed, axes = self.config.seed, self.axis_name
    if self.robust:  # combined ahead of the outer rule: `outer`
      if self.codec is not None:
        return tree_view(aggregate.compressed_gather(self.codec, axes, seed=seed), layout,
                         stacked=True)
      return aggregate.gather_all(axes)
    if self.codec is not None and self.codec.sharded is not None:  # compress.reduce
      return tree_view(aggregate.compressed_scatter_mean(self.codec, axes, seed=seed), layout)
    if self.codec is not None:
      return tree_view(aggregate.compressed_mean(self.codec, axes, seed=seed), layout)
    if self.nested:
      return tree_view(aggregate.nested_mean(axes), layout)
    return optax.with_extra_args_support(aggregate.replica_mean(axes))

  def place(self, replica_devices: int) -> list[str]:
    """Settles how the sync maps its workers once the mesh is known (`replica_devices`
    devices hold them; before its aggregators are built), and returns what stops it there,
    each 'field=value: fix'. The config-driven sync runs on any: per device where a codec
    encodes and the workers span devices (`map_workers`: encode where the Δ lives)."""
    self.per_device = self.codec is not None and replica_devices > 1
    self.axis_name = workers.PER_DEVICE if self.per_device else workers.REPLICA
    return []

  def map_workers(self, fn, in_axes: tuple, out_axes: tuple):
    """`fn` (one worker's part of the sync) over the stacked workers, so that the
    aggregator's collectives span them all (parallel/workers.py)."""
    return workers.map_workers(fn, in_axes, out_axes, per_device=self.per_device)

  def outer(self, rule: optax.GradientTransformation, probe=None
            ) -> optax.GradientTransformation:
    """The algorithm's outer `rule`, after the robust combination of the all-gathered
    updates where there is one (`probe`: the probe-loss signal's scorer). The combination's
    state (previous aggregate, signal EMAs, weights) is the same on every worker, so it
    lives with the outer rule's, once per fragment, and is checkpointed there. Works on the
    flat Δ: norms and coordinates are the tree's."""
    if not self.robust:
      return rule
    return aggregate.combine_then(self.robust_rule(probe).transform(), rule)

  def robust_rule(self, probe=None) -> aggregate.RobustRule:
    """The robust combination's choices and steps (aggregate/robust.py), from `aggregate.*`."""
    c, a = self.config, self.config.aggregate
    return aggregate.RobustRule(
        rule=a.rule, signal=a.signal, num_workers=c.num_workers, trim=a.trim,
        clip_iters=a.clip_iters, clip_tau=a.clip_tau, bucket=a.bucket,
        temperature=a.temperature, floor=a.floor, weight_ema=a.weight_ema,
        warmup_rounds=a.warmup_rounds, signal_ema=a.signal_ema, seed=c.seed,
        noise_sigmas=a.noise_sigmas, probe=probe)

  def probe_step(self, local_steps: bool) -> float:
    """How far along each worker's update the `probe_loss` signal evaluates its proposal:
    `aggregate.probe_step`, or by default the whole Δ for algorithms with local steps (θ − Δ_w
    is the worker's own model) and one SGD step at the inner lr for DDP (Δ is a gradient)."""
    c = self.config
    if c.aggregate.probe_step > 0:
      return float(c.aggregate.probe_step)
    return 1.0 if local_steps else float(c.optimizer.lr)

  def payload_bytes(self, like) -> int:
    """What one worker sends for trees shaped like `like`: the codec's packed payload, or
    the dense tensors."""
    return self.codec.payload_bytes(like) if self.codec is not None else ledger.tree_bytes(like)
