"""A Ray run's checkpoint: what it holds, and reading it back.

The state tree is the global server's (θ, its rule's state, and the models that jobs in
flight pulled: `snapshots`), with HALoS's regional servers under "regions" (each also keeps
its model after the last merge and at its last push: `reference`, `at_push`). Beside it,
each live worker's state (inner optimizer, codec error buffer) and its data position. The
meta holds what the driver counts, every server's version, and the jobs in flight, which a
resumed run starts again from the models they pulled.
"""

import jax

from lowcomm_jax.parallel import mesh as mesh_lib
from lowcomm_jax.runtimes.ray.actors import initial_rule_state, server_rules, server_view
from lowcomm_jax.runtimes.ray.chaos import with_worker_slots
from lowcomm_jax.sim import GLOBAL

# Of the meta; a checkpoint of another format is refused, not misread. 2: a synchronous
# run's server holds its outer rules' states as a tuple per fragment.
FORMAT = 2


def written_here(meta: dict) -> bool:
  return meta.get("format") == FORMAT and meta.get("runtime") == "ray"


def abstract(r, region_names, meta: dict):
  """Shapes (with this process's shardings) of the checkpoint that `meta` describes: the
  servers' tree, and the live workers' states. `r`: the run built with a row per worker id
  (chaos.with_worker_slots), so every live worker finds its host."""
  rep = mesh_lib.replicated(r.topology.mesh)
  placed = lambda tree: jax.tree.map(
      lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=rep), tree)
  params = r.state_spec.abstract.params

  def one_server(name):
    out = {"params": params,
           "opt_state": jax.eval_shape(lambda p: initial_rule_state(r, name, p), params)}
    if name != GLOBAL:
      out.update(reference=params, at_push=params)
    pulled = [j for j in meta["in_flight"]
              if j.get("server", GLOBAL) == name and not j.get("own")]
    if pulled:
      out["snapshots"] = {str(j["version"]): params for j in pulled}
    return out
  servers = one_server(GLOBAL)
  if region_names:
    servers["regions"] = {name: one_server(name) for name in region_names}
  one_row = lambda tree: jax.tree.map(
      lambda a: jax.ShapeDtypeStruct((1,) + a.shape[1:], a.dtype), tree)
  per_host = r.abstract_workers()  # a tier's inner optimizer state has its own shapes

  def worker(w: int) -> dict:
    host = next(h.index for h in r.topology.hosts if w in h.worker_ids)
    out = {"state": one_row(per_host[host])}
    if r.sync.codec is not None:  # an error buffer per fragment (worker.py)
      layout = r.model.layout
      out["codec"] = jax.eval_shape(lambda: tuple(
          jax.tree.map(lambda x: x[None], r.sync.codec.init(layout.fragment(p).abstract))
          for p in range(layout.num_fragments)))
    return out
  return placed(servers), placed({str(w): worker(int(w)) for w in meta["live"]})


def restore(ckpt, r, region_names, mark: int) -> tuple[dict, dict, dict]:
  """(each server's state with its version, by name; the meta; each live worker's state
  with its data position) of checkpoint `mark`."""
  meta = ckpt.restore_meta(mark)
  servers, workers = abstract(r, region_names, meta)
  tree, meta, workers, data = ckpt.restore(mark, servers, workers)
  workers = {int(w): {**jax.device_get(s), "data": data["streams"][w]}
             for w, s in workers.items()}
  return _by_name(jax.device_get(tree), meta), meta, workers


def run_of(config):
  """The run as a Ray run's servers build it (one device, a row per worker id the run may
  use): what reads its checkpoints."""
  from lowcomm_jax.assemble.build import build
  from lowcomm_jax.assemble.plan import one_device
  return build(server_view(with_worker_slots(one_device(config))), check_memory=False)


def global_params(ckpt, r, mark: int):
  """θ of the global server in checkpoint `mark` (flat; what `export` writes). `r`:
  `run_of` the run's config."""
  regions = tuple(name for name in server_rules(r) if name != GLOBAL)
  return restore_servers(ckpt, r, regions, mark)[GLOBAL]["params"]


def restore_servers(ckpt, r, region_names, mark: int) -> dict:
  """Only the servers' states of checkpoint `mark` (a dead server's successor: the
  workers' states are not read)."""
  meta = ckpt.restore_meta(mark)
  servers, _ = abstract(r, region_names, meta)
  return _by_name(jax.device_get(ckpt.restore_state(mark, servers)), meta)


def _by_name(tree: dict, meta: dict) -> dict:
  versions = meta.get("versions", {GLOBAL: meta["version"]})
  by_name = {GLOBAL: {k: v for k, v in tree.items() if k != "regions"}}
  by_name.update(tree.get("regions", {}))
  return {name: {**state, "version": versions[name]} for name, state in by_name.items()}


def save(ckpt, step: int, states: dict, workers: dict, meta: dict) -> None:
  """Writes checkpoint `step`: `states`, each server's `ServerProcess.state()` by name;
  `workers`, each live worker's `checkpoint_state`; `meta`, the driver's fields (the
  versions and the format are added here)."""
  def tree_of(state):
    out = {k: state[k] for k in ("params", "opt_state", "reference", "at_push") if k in state}
    if state["snapshots"]:
      out["snapshots"] = state["snapshots"]
    return out
  tree = tree_of(states[GLOBAL])
  regions = {name: tree_of(s) for name, s in states.items() if name != GLOBAL}
  if regions:
    tree["regions"] = regions
  meta = {"format": FORMAT, "runtime": "ray", "version": states[GLOBAL]["version"],
          "versions": {name: s["version"] for name, s in states.items()},
          "live": [str(w) for w in workers], **meta}
  ckpt.save(step, tree, meta,
            {str(w): {k: v for k, v in s.items() if k != "data" and jax.tree.leaves(v)}
             for w, s in workers.items()},
            {"streams": {str(w): s["data"] for w, s in workers.items()}})
