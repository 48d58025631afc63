"""A Ray run's checkpoint, written where its state is, and reading it back.

Each actor writes the part it holds (run/checkpoint_parts.py: arrays, a JSON document and
a manifest, renamed into place) in the run's checkpoints folder, then the driver commits
the round (run/checkpoint.py `Checkpointer.commit`: its meta alone through orbax, listing
the parts with their manifests' crc32):

  worker_<w>/<r>/    worker w's state as it was before its unpushed job (inner optimizer,
                     θ_w where the algorithm keeps it, its codec's error buffer); data.json:
                     its data stream's position. Written by the worker.
  server_<name>/<r>/ server `name`'s state: θ, its rule's state, for HALoS's regional
                     servers also `reference` and `at_push`, and the models jobs in flight
                     pulled (`snapshots`); data.json: its version and those snapshots'.
                     Written by the server actor; in the peer form by one current member
                     from its replica (NoLoCo's pair swaps: by the driver, which gathers
                     every member's rows of the outer state: PairReplicas).
  <r>/meta           the driver's counts, the jobs in flight, the servers' versions and
                     the parts listed (orbax's commit of this step is the round's).

What reaches the driver is each part's crc32 and a server's version: no tensor. A resume
hands each actor where its part lies (`at`), and the actor reads it there; so every
process must reach the folder (one machine, or a shared file system).
"""

import pathlib

import jax

from lowcomm_jax.run import checkpoint_parts
from lowcomm_jax.runtimes.ray.actors import initial_rule_state, server_view
from lowcomm_jax.runtimes.ray.chaos import with_worker_slots
from lowcomm_jax.parallel.server_names import GLOBAL

# Of the meta; a checkpoint of another format is refused, not misread. 3: the state in
# parts written by the actors that hold it.
FORMAT = 3


def written_here(meta: dict) -> bool:
  return meta.get("format") == FORMAT and meta.get("runtime") == "ray"


def at(ckpt, round_: int) -> dict:
  """Where round `round_`'s parts lie, as the driver hands it to an actor (plain JSON)."""
  return {"directory": str(ckpt.directory), "round": round_, "keep": ckpt.max_to_keep}


def worker_part(worker: int) -> str:
  return f"worker_{worker}"


def server_part(name: str) -> str:
  return f"server_{name}"


def _store(where: dict, part: str, *, read_only: bool = False):
  return checkpoint_parts.PartStore(
      pathlib.Path(where["directory"]) / part, where["keep"],
      read_only=read_only)


def _shapes(tree):
  return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)


# --- a worker's part (written and read in its process) -------------------------------------

def worker_abstract(r, worker: int) -> dict:
  """The shapes of worker `worker`'s part: its host's row of the worker states (a tier's
  inner optimizer state has its own shapes) and, with a codec, an error buffer per
  fragment (worker.py). `r`: a run built with a row per worker id (chaos.with_worker_slots)."""
  host = next(h.index for h in r.topology.hosts if worker in h.worker_ids)
  one_row = lambda tree: jax.tree.map(
      lambda a: jax.ShapeDtypeStruct((1,) + a.shape[1:], a.dtype), tree)
  out = {"state": one_row(r.abstract_workers()[host])}
  if r.sync.codec is not None:
    layout = r.model.layout
    out["codec"] = _shapes(jax.eval_shape(lambda: tuple(
        jax.tree.map(lambda x: x[None], r.sync.codec.init(layout.fragment(p).abstract))
        for p in range(layout.num_fragments))))
  return out


def write_worker(where: dict, worker: int, state: dict) -> int:
  """Worker `worker`'s part of round where["round"]; `state`: its `checkpoint_state`.
  Returns the part's manifest crc32 (what the commit lists)."""
  tree = {k: v for k, v in state.items() if k != "data" and jax.tree.leaves(v)}
  return _store(where, worker_part(worker)).save(where["round"], tree,
                                                 {"stream": state["data"]})


def read_worker(where: dict, r, worker: int) -> dict:
  """{"state", "codec", "data"} of worker `worker`'s part (host arrays)."""
  tree, data = _store(where, worker_part(worker), read_only=True).restore(
      where["round"], worker_abstract(r, worker))
  return {**tree, "data": data["stream"]}


# --- a server's part (written by whoever holds that state) ---------------------------------

def server_abstract(r, name: str, snapshots: list[int]) -> dict:
  """The shapes of server `name`'s part holding the models pulled at `snapshots`."""
  params = _shapes(r.state_spec.abstract.params)
  out = {"params": params,
         "opt_state": _shapes(jax.eval_shape(lambda p: initial_rule_state(r, name, p), params))}
  if name != GLOBAL:
    out.update(reference=params, at_push=params)
  if snapshots:
    out["snapshots"] = {str(v): params for v in snapshots}
  return out


def write_server(where: dict, name: str, state: dict) -> dict:
  """Server `name`'s part of round where["round"]; `state`: a `ServerProcess.state()` (or
  a replica's `share()`). Returns what the commit lists: {"crc", "version"}."""
  tree = {k: state[k] for k in ("params", "opt_state", "reference", "at_push") if k in state}
  snapshots = sorted(int(v) for v in state.get("snapshots", {}))
  if snapshots:
    tree["snapshots"] = state["snapshots"]
  crc = _store(where, server_part(name)).save(
      where["round"], tree, {"version": int(state["version"]), "snapshots": snapshots})
  return {"crc": crc, "version": int(state["version"])}


def read_server(where: dict, r, name: str) -> dict:
  """Server `name`'s state in its part, with its version (host arrays). `r`: any run of
  the config (the shapes of θ and the outer states are no mesh's)."""
  store = _store(where, server_part(name), read_only=True)
  doc = store.data(where["round"])
  tree, _ = store.restore(where["round"], server_abstract(r, name, doc["snapshots"]))
  return {**tree, "snapshots": tree.get("snapshots", {}), "version": doc["version"]}


# --- the driver's side ----------------------------------------------------------------------

def commit(ckpt, round_: int, servers: dict, workers: dict, meta: dict) -> None:
  """Commits round `round_` whose parts are written: `servers`, {name: write_server's
  record}; `workers`, {id: write_worker's crc}; `meta`, the driver's fields."""
  parts = {server_part(name): rec["crc"] for name, rec in servers.items()}
  parts.update({worker_part(w): crc for w, crc in workers.items()})
  ckpt.commit(round_, {"format": FORMAT, "runtime": "ray", "version": servers[GLOBAL]["version"],
                       "versions": {name: rec["version"] for name, rec in servers.items()},
                       "live": [str(w) for w in sorted(workers)], **meta}, parts)


def run_of(config):
  """The run as a Ray run's servers build it (one device, a row per worker id the run may
  use): what reads its checkpoints."""
  from lowcomm_jax.assemble.build import build
  from lowcomm_jax.assemble.plan import one_device
  return build(server_view(with_worker_slots(one_device(config))), check_memory=False)


def restore(ckpt, r, mark: int) -> tuple[dict, dict, dict]:
  """(each server's state by name, the meta, each live worker's state) of checkpoint
  `mark`, every part read in this process (a run's actors read their own instead; this is
  for inspecting one). `r`: `run_of` the run's config."""
  meta = ckpt.restore_meta(mark)
  where = at(ckpt, mark)
  servers = {name: read_server(where, r, name) for name in meta["versions"]}
  return servers, meta, {int(w): read_worker(where, r, int(w)) for w in meta["live"]}


def global_params(ckpt, r, mark: int):
  """θ of the global server in checkpoint `mark` (flat; what `export` writes). `r`:
  `run_of` the run's config."""
  return read_server(at(ckpt, mark), r, GLOBAL)["params"]
