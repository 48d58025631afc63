"""The Ray runtime's costs (issue 29): server throughput against payload size, a push's
overhead against the bare local program, and recovery from each kind of failure.

  python bench/ray_overheads.py [--parts throughput,overhead,recovery] [--pushes 20]
      [--out ray_overheads.jsonl]

throughput: the real server actor (ServerProcess, async_dn's Delayed Nesterov) applying
  pushes of three model sizes (small on bytes: 3.4 MB; pythia_14m on GPT-2 BPE: 56 MB;
  gpt2_124m with a 256-token vocabulary: 344 MB of float32 Δ), dense and int8-coded (payloads made by the
  worker's own encoder), put in Ray's object store beforehand: pushes/s one at a time
  (each waited for) and pipelined (all sent, then waited for).
overhead: one worker, `small`, H = 10: a job through Ray (pull, the worker's job, push,
  each waited for by the driver) against the same job called in-process (the bare local
  program with its host transfers).
recovery: 4 workers, `small`, a chaos schedule (a worker killed and rejoining, one added,
  the server killed): seconds to recover and work lost, from summary.json.
checkpoints: --workers (8) of `small`, DiLoCo, 2 rounds of H = 2, each checkpointed, in the
  peer form and through the server: per checkpoint, what the driver's ray.get calls
  returned while it saved (pickled bytes: `count_saves`), what it wrote itself (the orbax
  step: the meta), what the actors wrote (their parts), and the save's seconds.
A JSON row per measurement is appended to --out as it is made.
"""

import argparse
import json
import os
import pathlib
import runpy
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
os.environ.setdefault("LOWCOMM_DATA_DIR", str(REPO.parent / "shared" / "data"))
os.environ.setdefault("TIKTOKEN_CACHE_DIR", str(REPO.parent / "shared" / "data" / "tiktoken"))

import numpy as np  # noqa: E402

# (model, tokenizer, vocabulary): 0.86 M, 14.1 M and 85.9 M float32 parameters
SIZES = (("small", "byte", 0), ("pythia_14m", "gpt2", 0), ("gpt2_124m", "byte", 256))


def config(model="small", tokenizer="byte", **fields):
  c = runpy.run_path(str(REPO / "configs" / "base.py"))["get_config"]()
  c.runtime, c.algorithm, c.num_workers = "ray", "async_dn", 4
  c.model.name, c.data.tokenizer = model, tokenizer
  c.data.seq_len, c.data.batch_size = 64, 8
  c.rounds, c.inner_steps, c.mesh.replica = 4, 10, 1
  c.eval_every = c.checkpoint_every = c.log_every = 1
  c.update_from_flattened_dict(fields)  # dotted names: {"compress.codec": "int8"}
  return c


def emit(out: str, row: dict) -> None:
  print(json.dumps(row), flush=True)
  with open(out, "a") as f:
    f.write(json.dumps(row) + "\n")


def throughput(args, ray) -> None:
  import jax
  from lowcomm_jax.programs import servers
  from lowcomm_jax.assemble.build import build
  from lowcomm_jax.runtimes.ray import cluster
  from lowcomm_jax.runtimes.ray.server import ServerProcess
  from lowcomm_jax.assemble.plan import one_device
  for model, tokenizer, vocab in SIZES:
    for codec in ("none", "int8"):
      # one worker's build (the server holds none; Delayed Nesterov's N stays 4)
      c = config(model, tokenizer, num_workers=1, **{"compress.codec": codec,
                                                     "model.vocab_size": vocab,
                                                     "outer.dn_buffer": 4})
      r = build(one_device(c), check_memory=False)
      size = r.model.layout.size
      rng = np.random.default_rng(0)
      deltas = [rng.normal(0, 1e-3, size).astype(np.float32) for _ in range(2)]
      if codec == "none":
        sent = deltas
        metas = [{"version": 0, "steps": 10} for _ in deltas]
      else:
        encode = jax.jit(servers.make_encode(r.sync.codec, r.model.layout))
        state = r.sync.codec.init(r.model.layout.abstract)
        keys = [jax.random.key(i) for i in range(len(deltas))]
        sent = [jax.device_get(encode(d, state, k)[0]) for d, k in zip(deltas, keys)]
        metas = [{"version": 0, "steps": 10,
                  "codec_key": np.asarray(jax.random.key_data(k))} for k in keys]
      refs = [ray.put(x) for x in sent]
      nbytes = sum(np.asarray(x).nbytes for x in jax.tree.leaves(sent[0]))
      server = ray.remote(**cluster.actor_options(c, worker=False))(ServerProcess).remote(c)
      ray.get(server.ping.remote())
      ray.get(server.push.remote(metas[0], refs[0]))  # compiles
      t0 = time.perf_counter()
      for i in range(args.pushes):
        ray.get(server.push.remote(metas[i % 2], refs[i % 2]))
      one = args.pushes / (time.perf_counter() - t0)
      t0 = time.perf_counter()
      ray.get([server.push.remote(metas[i % 2], refs[i % 2]) for i in range(args.pushes)])
      piped = args.pushes / (time.perf_counter() - t0)
      ray.kill(server)
      emit(args.out, {"part": "throughput", "model": model, "codec": codec,
                      "params": size, "payload_bytes": nbytes,
                      "pushes_per_s_waited": one, "pushes_per_s_pipelined": piped,
                      "MB_per_s_pipelined": piped * nbytes / 1e6})


def overhead(args, ray) -> None:
  from lowcomm_jax.runtimes.ray import cluster
  from lowcomm_jax.runtimes.ray.server import ServerProcess
  from lowcomm_jax.runtimes.ray.worker import WorkerProcess
  c = config(num_workers=1)
  bare_worker, bare_server = WorkerProcess(c, 0), ServerProcess(c)
  version, params = bare_server.pull()
  bare_worker.job(version, params, 0, c.inner_steps, 0)  # compiles
  t0 = time.perf_counter()
  for i in range(args.pushes):
    bare_worker.job(version, params, 0, c.inner_steps, i + 1)
  bare = (time.perf_counter() - t0) / args.pushes
  server = ray.remote(**cluster.actor_options(c, worker=False))(ServerProcess).remote(c)
  worker = ray.remote(max_concurrency=2, **cluster.actor_options(c, worker=True))(
      WorkerProcess).remote(c, 0)

  def one_push(order):
    v, p = server.pull.options(num_returns=2).remote()
    meta, sent = worker.job.options(num_returns=2).remote(v, p, 0, c.inner_steps, order)
    ray.get(server.push.remote(meta, sent))

  one_push(0)  # compiles
  t0 = time.perf_counter()
  for i in range(args.pushes):
    one_push(i + 1)
  through_ray = (time.perf_counter() - t0) / args.pushes
  ray.kill(server)
  ray.kill(worker)
  emit(args.out, {"part": "overhead", "model": "small", "inner_steps": c.inner_steps,
                  "bare_job_s": bare, "ray_push_cycle_s": through_ray,
                  "overhead_s": through_ray - bare, "ratio": through_ray / bare})


def recovery(args, ray) -> None:
  from lowcomm_jax.runtimes.ray import driver
  c = config(rounds=6, **{"ray.chaos": ("kill_worker=1@4", "rejoin_worker=1@8",
                                        "add_worker@10", "kill_server@13")})
  with tempfile.TemporaryDirectory() as workdir:
    s = driver.run(c, workdir)
  emit(args.out, {"part": "recovery", "model": "small", "recoveries": s["recoveries"],
                  "pushes_dropped": s["pushes_dropped"],
                  "steps_lost": s["pushes_dropped"] * c.inner_steps,
                  "pushes_replayed": s["pushes_replayed"], "pushes": s["pushes"],
                  "eval_loss": s["eval_loss"], "wall_seconds": s["wall_seconds"]})


def count_saves(setattr_) -> list[dict]:
  """Makes every RayDriver count, per checkpoint it saves, the pickled bytes that ray.get
  calls return in its process meanwhile (Ray's module function, whoever calls it) and the
  save's seconds (`setattr_`: setattr, or a test's monkeypatch.setattr). Returns the list
  it appends one {"received", "seconds"} to."""
  import pickle
  from lowcomm_jax.runtimes.ray.driver import RayDriver
  saves, save = [], RayDriver.save

  def counting_save(driver, *args, **kwargs):
    ray, get, t0 = driver.ray, driver.ray.get, time.perf_counter()
    received = []

    def counted(refs, *a, **k):  # every ray.get of the driver's process meanwhile
      out = get(refs, *a, **k)
      received.append(len(pickle.dumps(out)))
      return out
    ray.get = counted
    try:
      return save(driver, *args, **kwargs)
    finally:
      ray.get = get
      saves.append({"received": sum(received), "seconds": time.perf_counter() - t0})
  setattr_(RayDriver, "save", counting_save)
  return saves


def _bytes_under(path: pathlib.Path) -> int:
  return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def checkpoints(args, ray) -> None:
  from lowcomm_jax.runtimes.ray import driver
  saves = count_saves(setattr)
  for form in ("auto", "server"):
    c = config(algorithm="diloco", num_workers=args.workers, rounds=2, inner_steps=2,
               collective_form=form)
    del saves[:]
    with tempfile.TemporaryDirectory() as workdir:
      s = driver.run(c, workdir)
      root = pathlib.Path(workdir) / "checkpoints"
      steps = sorted(int(d.name) for d in root.iterdir() if d.name.isdigit())
      driver_written = [_bytes_under(root / str(k)) for k in steps]
      parts = {d.name: _bytes_under(d) // max(1, len(list(d.iterdir())))
               for d in root.iterdir() if d.is_dir() and not d.name.isdigit()
               and d.name != "damaged" and any(d.iterdir())}
    emit(args.out, {"part": "checkpoints", "model": "small", "workers": args.workers,
                    "round_form": s["round_form"], "saves": saves[:],
                    "driver_written_bytes": driver_written,
                    "part_bytes_per_round": parts, "theta_bytes": 4 * s["params"],
                    "eval_loss": s["eval_loss"]})


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--parts", default="throughput,overhead,recovery")
  p.add_argument("--pushes", type=int, default=20)
  p.add_argument("--workers", type=int, default=8, help="checkpoints: the run's workers")
  p.add_argument("--out", default="ray_overheads.jsonl")
  args = p.parse_args()
  import ray
  ray.init(num_cpus=os.cpu_count(), include_dashboard=False, configure_logging=False,
           log_to_driver=False)
  for part in args.parts.split(","):
    {"throughput": throughput, "overhead": overhead, "recovery": recovery,
     "checkpoints": checkpoints}[part](args, ray)
  ray.shutdown()


if __name__ == "__main__":
  main()
