"""Every configuration field, with its default and what it means: the schema of record.

It ships with the package, so a non-editable install keeps every check that compares a
config with the defaults and every field's meaning in `--print_config` (config/doc.py reads
the comments here, and an algorithm's own section from its `config_defaults`). configs/base.py hands it to config files; they start from
`get_config()` and change a few fields. Any field can be overridden on the command line:
`--config.outer.lr=0.5 --config.data.batch_mode=same`. Values are checked once at start-up
(lowcomm_jax/config/check.py) before any compute.
"""

import os
from typing import Callable

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  """Every field at its default: the package's own sections, then each algorithm's
  (declared in its module: `Algorithm.config_defaults`)."""
  c = ml_collections.ConfigDict()
  for section in (_run, _devices, _outer, _aggregation, _ray, _simulator, _optimizer, _model,
                  _data):
    section(c)
  for dotted, declare in declared_sections():
    *parents, name = dotted.split(".")
    node = c
    for parent in parents:
      node = node[parent]
    node[name] = declare()
  return c


def declared_sections() -> list[tuple[str, Callable[[], ml_collections.ConfigDict]]]:
  """(dotted section, the function that declares its fields) of every algorithm with a
  section of its own (config/doc.py reads their comments from the same functions)."""
  from lowcomm_jax import algorithms
  return [(a.config_section, a.config_defaults) for a in algorithms.REGISTRY.values()
          if a.config_section]


def _run(c: ml_collections.ConfigDict) -> None:
  """The run itself: its algorithm, size, cadence and what it writes; the host table."""
  # --- run ---------------------------------------------------------------------------
  c.algorithm = "diloco"  # a name in algorithms.REGISTRY (each with its summary: docs/algorithms.md)
  c.num_workers = 4  # workers (replicas); each has its own data stream and inner optimizer state
  c.rounds = 20  # outer rounds; DDP takes one step per round
  c.inner_steps = 20  # H: inner steps per worker per round (must be 1 for ddp)
  c.seed = 0  # every random stream derives from (seed, worker_id, step)
  c.eval_every = 5  # rounds between evaluations on the validation split (0: only at the end)
  c.eval_batches = 8  # validation batches per evaluation (fixed windows, same every time)
  c.eval = ml_collections.ConfigDict()
  c.eval.widths = ()  # MatFormer FFN widths evaluated beside the trained tiers, e.g. (0.375,
  # | 0.5): every evaluation reports eval_loss/tier_<w> for the hosts' tiers and these
  # | (Mix'n'Match: any width is a model); () with every host at 1.0: the full width alone
  c.checkpoint_every = 10  # rounds between checkpoints (0: only at the end)
  c.keep_checkpoints = 2  # how many checkpoints orbax keeps
  c.log_every = 1  # rounds between metric writes (TensorBoard + metrics.jsonl)
  c.metrics = ml_collections.ConfigDict()
  c.metrics.writer = "tensorboard"  # TensorBoard's event files: 'tensorboard' (tensorboard's own
  # | record writer, no TensorFlow) | 'clu' (clu.metric_writers.create_default_writer: TensorFlow's
  # | summary writer, and a log line per row; needs TensorFlow). metrics.jsonl is the same either way
  c.overlap_sync = True  # delayed syncs (one_step_delay, eager, overlap) run inside the next
  # | round's program, their collective beside its local steps, where every process runs one
  # | host of the same shape; rounds that evaluate or save sync at once (False: separate
  # | programs; the numbers are the same either way)
  # JAX's persistent compilation cache (lowcomm_jax/run/compile_cache.py): a second run of a
  # config loads its programs instead of compiling them. JAX's own JAX_COMPILATION_CACHE_DIR,
  # where set, moves the default.
  cache = os.environ.get("JAX_COMPILATION_CACHE_DIR", "~/.cache/lowcomm_jax/jax")
  c.compile_cache_dir = cache  # folder of compiled programs; '' turns the cache off
  # Resuming a workdir under another config is refused, except for rounds and the cadence
  # fields above (and distributed.*): name other fields here to let them change.
  c.resume_allow = ""  # e.g. 'outer.lr,seed': fields allowed to differ on resume (recorded)

  # --- hosts: one row per process (lowcomm_jax/assemble/hosts.py); [] = num_workers at full width
  c.hosts = []  # e.g. [host(tier=1.0), host(tier=0.25, workers=2)] with hosts.host


def _devices(c: ml_collections.ConfigDict) -> None:
  """The processes (jax.distributed) and each worker's devices."""
  # --- processes (jax.distributed); unset fields fall back to JAX's/SLURM's env variables
  c.distributed = ml_collections.ConfigDict()
  c.distributed.coordinator_address = ""  # 'host:port' of process 0 ('' = env / single)
  c.distributed.num_processes = 0  # 0: from the environment, else 1
  c.distributed.process_id = -1  # -1: from the environment
  c.distributed.heartbeat_timeout_s = 60  # a silent process is declared dead after this
  c.distributed.join_timeout_s = 300  # wait this long for all processes, then name the missing
  # Where process 0's coordinator listens. '' = the coordinator_address host only (its port);
  # '0.0.0.0:PORT' listens on every interface. Unauthenticated: keep it on a private network.
  c.distributed.coordinator_bind_address = ""  # 'host:port' ('' = coordinator_address's host)

  # --- devices: mesh ('replica', 'data', 'model') ---------------------------------------
  c.mesh = ml_collections.ConfigDict()
  c.mesh.replica = -1  # devices along the replica axis; -1: as many as divide num_workers
  c.mesh.data = 1  # devices each worker splits its batch over
  # (the 'model' axis has model.tp.size devices)


def _outer(c: ml_collections.ConfigDict) -> None:
  """The outer optimizer, which every algorithm with an outer rule reads."""
  # --- outer optimizer (applied to the averaged pseudo-gradient) -------------------------
  c.outer = ml_collections.ConfigDict()
  c.outer.lr = 0.7  # DiLoCo's outer learning rate
  c.outer.momentum = 0.9  # outer momentum (0 disables it)
  c.outer.nesterov = True  # Nesterov momentum, as in DiLoCo
  c.outer.dylu = False  # Dynamic Local Updates: H_w = max(1, ceil(H * speed_w / max speed))
  c.outer.dn_buffer = 0  # async_dn/halos: Delayed Nesterov's N (0: the server's workers)
  c.outer.dn_c = 0.0  # Delayed Nesterov's momentum activation c in [0, 1/N] between refreshes


def _aggregation(c: ml_collections.ConfigDict) -> None:
  """How the workers' contributions are combined, attacked (tests) and compressed."""
  # --- aggregation of pseudo-gradients --------------------------------------------------
  c.aggregate = ml_collections.ConfigDict()
  c.aggregate.weighting = "uniform"  # 'uniform' | 'tokens' (weight workers by tokens processed)
  c.aggregate.rule = "mean"  # 'mean' | 'median' | 'trimmed_mean' | 'centered_clip' (robust)
  c.aggregate.signal = "none"  # per-worker weights from: 'none' | 'loss_ema'
  # | 'grad_norm_stability' | 'cosine' | 'probe_loss' (lowcomm_jax/aggregate/signal.py)
  c.aggregate.trim = 1  # trimmed_mean: values dropped per side per coordinate (workers)
  c.aggregate.clip_iters = 1  # centered_clip: clipping iterations from the previous aggregate
  c.aggregate.clip_tau = 0.0  # centered_clip: clipping radius; 0: the median distance
  c.aggregate.bucket = 0  # > 1: average shuffled buckets of this many workers before the rule
  c.aggregate.temperature = 1.0  # softmax temperature over the standardized signal
  c.aggregate.noise_sigmas = 3.0  # a difference must exceed this many noise std to count; 0: plain z-score
  c.aggregate.floor = 0.2  # no worker's weight below floor / num_workers
  c.aggregate.weight_ema = 0.5  # smoothing of the weights from round to round
  c.aggregate.warmup_rounds = 2  # uniform weights while the signals accumulate
  c.aggregate.signal_ema = 0.9  # EMA decay of each worker's signals
  c.aggregate.probe_batch_size = 16  # probe_loss: windows in the shared probe batch (train split)
  c.aggregate.probe_step = 0.0  # probe_loss: proposal θ − step·Δ_w; 0: 1 (local steps), optimizer.lr (ddp)

  # --- adversarial workers (tests and benchmarks of robust aggregation) ---------------
  c.attack = ml_collections.ConfigDict()
  c.attack.workers = ()  # worker ids that send a manipulated update
  c.attack.kind = "scale"  # 'scale' (x attack.scale) | 'sign_flip' | 'random' (same norm)
  c.attack.scale = 100.0  # the factor of 'scale'

  # --- compression of what crosses the network (lowcomm_jax/compress/) ------------------
  # diloco: compresses each round's pseudo-gradients; ddp: every step's gradients ('demo'
  # there is DisTrO-style training: DeMo momentum + DCT top-k, sign descent).
  c.compress = ml_collections.ConfigDict()
  c.compress.codec = "none"  # none | int8 | fp8 | int4 | muloco | topk | randomk | sparseloco | demo
  c.compress.error_feedback = True  # keep what was not sent and re-send it (sparseloco/demo always do)
  c.compress.beta = -1.0  # error-buffer decay e = beta*e + x; -1: the codec's (1.0; SparseLoCo 0.95; DeMo momentum 0.999)
  c.compress.quant_block = 0  # int8/fp8/int4/muloco: one scale (muloco: bin table) per row (0) or per this many entries
  c.compress.stochastic_rounding = False  # int8/int4: round to a random neighbour (unbiased)
  c.compress.density = 0.01  # topk (chunk=0) / randomk: fraction of each tensor's entries sent
  c.compress.chunk = 64  # topk/sparseloco/demo: chunk side (chunk x chunk blocks); topk 0 = per tensor
  c.compress.k = 0  # topk/sparseloco/demo: entries sent per chunk; 0: the codec's (64 of 4096; DeMo 32)
  c.compress.value_bits = 32  # topk: 32 or 2; demo: 32 or 1 (sign only); sparseloco is always 2
  c.compress.mean_over_senders = False  # demo: average each coefficient over the workers that sent it


def _ray(c: ml_collections.ConfigDict) -> None:
  """The runtime, and the Ray runtime's own fields."""
  # --- runtime (lowcomm_jax/runtimes/: the table RUNTIMES) -------------------------------
  c.runtime = "spmd"  # 'spmd': jax.distributed, lockstep processes | 'simulator': virtual
  # | workers on a virtual clock, one process (sim.*) | 'ray': a JAX process per worker and
  # | server; asynchronous algorithms; workers join, leave or crash (ray.*)
  c.ray = ml_collections.ConfigDict()
  c.ray.address = ""  # '' : start a Ray inside this process; 'auto' or 'host:port': join one
  c.ray.num_cpus = 0  # a Ray started here: CPUs it may schedule (0: every core)
  c.ray.bind_address = ""  # a Ray started here: the address its services listen on
  # | ('' : Ray's default; '127.0.0.1' keeps every port on this machine)
  c.ray.gpus_per_worker = 0.0  # GPUs each worker actor holds (0.5: two workers share one)
  c.ray.worker_nodes = ()  # per worker: a custom resource its actor needs, which pins it to
  # | the node started with it (`ray start --resources='{"node2": 1}'`); () : anywhere,
  # | an entry '': that worker anywhere
  c.ray.server_node = ""  # the same for every server process ('': anywhere)
  c.ray.apply_order = "arrival"  # 'arrival': pushes applied as they come | 'dispatch': in
  # | the order their jobs started (reproducible runs: tests, comparison with the simulator)
  c.ray.step_sleep_s = ()  # per worker: seconds slept per inner step (imposed slowness)
  c.ray.batch_sizes = ()  # collaborative epochs: per worker, its micro-batch in samples (a
  # | bigger GPU, a bigger batch); () or a worker that joins later: data.batch_size
  # Quorum rounds (synchronous algorithms): a round closes once min_quorum workers have
  # contributed from its θ and grace_s seconds have passed since, or when every live worker
  # has; later contributions fold into the next round (weighted by tokens, staleness kept).
  c.ray.min_quorum = 0  # workers a round needs (0: every live worker)
  c.ray.grace_s = 0.0  # seconds a reached quorum waits for the others
  c.ray.recover_timeout_s = 120.0  # a restarted server or worker must answer within this
  c.ray.collective_timeout_s = 600.0  # the peer form (sim.network.collective): a round's
  # | collective gives up on members that have not finished within this, and is tried
  # | again among the others (>= 5 s: round 1 compiles its programs)
  c.ray.standby_server = False  # keep a server process built and idle: a dead server's
  # | successor skips the process start (one more process and θ's memory on its node)
  c.ray.chaos = ()  # failures on cue (tests, benchmarks), each 'what@N' (N pushes applied):
  # | 'kill_worker=K@N', 'add_worker@N' (the next free id joins), 'rejoin_worker=K@N' (a
  # | killed worker back where its data stream was), 'kill_server@N' (once: it restarts from
  # | the last checkpoint, the pushes since replayed), 'delay_worker=K:S@N' (S s per push),
  # | 'crash_in_sync=K@N' (the peer form: K dies in the middle of the next collective)


def _simulator(c: ml_collections.ConfigDict) -> None:
  """The simulator's fields, and the network both it and the Ray runtime read."""
  # --- simulator (runtime='simulator'; lowcomm_jax/sim/, runtimes/simulator/) -------------
  c.sim = ml_collections.ConfigDict()
  c.sim.heterogeneity = "none"  # worker speeds: none | slight | moderate | very (sim/speeds.py)
  c.sim.speeds = ()  # explicit relative speeds, one per worker (overrides heterogeneity)
  c.sim.step_seconds = 0.1  # virtual seconds per inner step of the fastest worker
  c.sim.jitter = 0.0  # per-step duration noise: x (1 + jitter * N(0, 1))
  c.sim.straggler_prob = 0.0  # chance a job runs straggler_slowdown times slower
  c.sim.straggler_slowdown = 3.0  # how much slower a straggling job runs
  c.sim.jobs_per_call = 0  # synchronous jobs run in one vmapped call (their activations are
  # | held at once); 0: every worker if they fit in memory, else the widest power of two
  # The network: the simulator's links; under runtime='ray', the links its nodes sit on
  # (bench/real_links.py builds them; config.json keeps them for the simulator's replay).
  c.sim.network = ml_collections.ConfigDict()
  c.sim.network.regions = 1  # workers fill regions in contiguous blocks
  c.sim.network.worker_regions = ()  # or: the region of each worker
  c.sim.network.server_region = -1  # where the global parameter server sits: -1: a region
  # | of its own (linked to every region at inter_gbps, inter_latency_s); r: in region r,
  # | with its workers (the summary records which)
  c.sim.network.region_gbps = 0.0  # each region's uplink and downlink, shared by all its
  # | inter-region transfers (sim/flows.py: max-min fair); 0: its fastest link's bandwidth
  c.sim.network.collective = "auto"  # synchronous rounds: ring | hierarchical (inside each
  # | region, then across regions) | auto (the faster; sim/collectives.py) | direct (every
  # | pair at once: the Ray runtime's flat exchange) | server (a parameter server's rounds:
  # | pulls, then contributions). On Ray: 'server' runs quorum rounds through the server
  # | actor; the others (where the algorithm has the form: runtimes/ray/checks.round_form)
  # | among the round's workers, each holding θ: 'ring' and 'direct' in one direct
  # | exchange, 'hierarchical' by region, 'auto' by region where the simulator picks it
  c.sim.network.intra_gbps = 100.0  # bandwidth inside a region: each node's NIC
  c.sim.network.intra_latency_s = 1e-4  # seconds, inside a region
  c.sim.network.inter_gbps = 1.0  # bandwidth between any two regions
  c.sim.network.inter_latency_s = 0.05  # seconds, between any two regions
  c.sim.network.inter_gbps_matrix = ()  # or per pair: regions x regions rows (diagonal unused)
  c.sim.network.inter_latency_matrix = ()  # or per pair, like inter_gbps_matrix
  c.sim.network.bytes_scale = 1.0  # payloads take this many times their real bytes' time
  # | (a small CPU model standing in for a large one; bytes_sent stays real)


def _optimizer(c: ml_collections.ConfigDict) -> None:
  """Each worker's inner optimizer."""
  # --- inner optimizer (each worker; for ddp the per-step optimizer) ----------------------
  c.optimizer = ml_collections.ConfigDict()
  # Inner optimizers (lowcomm_jax/programs/optimizers.py): adamw | sgd | lamb | lars | adafactor | lion |
  # muon (Newton-Schulz-orthogonalized momentum on hidden matrices, AdamW on embeddings,
  # the LM head, norms and biases).
  c.optimizer.name = "adamw"  # inner optimizer (above)
  c.optimizer.lr = 3e-3  # peak learning rate
  c.optimizer.warmup_steps = 50  # linear warmup (inner steps)
  c.optimizer.decay_steps = 0  # cosine decay length in inner steps; 0: rounds * inner_steps
  c.optimizer.min_lr_ratio = 0.1  # final lr = lr * min_lr_ratio
  c.optimizer.b1 = 0.9  # first-moment decay (AdamW, LAMB, Lion, Muon's AdamW part)
  c.optimizer.b2 = 0.95  # second-moment decay (the same; Lion's paper uses 0.99)
  c.optimizer.momentum = 0.95  # momentum of lars and muon (sgd is plain SGD)
  c.optimizer.adam_lr = 0.0  # muon: peak lr of its AdamW part; 0: optimizer.lr
  c.optimizer.weight_decay = 0.1  # decoupled, on matrices only (not biases/LayerNorm)
  c.optimizer.grad_clip = 1.0  # global-norm clipping; 0 disables it


def _model(c: ml_collections.ConfigDict) -> None:
  """The model, its LoRA adapters, collaborative epochs and tensor parallelism."""
  # --- model -------------------------------------------------------------------------
  c.model = ml_collections.ConfigDict()
  # Presets (lowcomm_jax/model/presets.py): tiny | small | small12 | pythia_14m | gpt2_124m,
  # and the Llama family's tiny_llama | smollm2_135m.
  c.model.name = "small"  # model preset (above)
  c.model.vocab_size = 0  # 0: the preset's, or the tokenizer's rounded up to a multiple of 64
  c.model.dtype = "float32"  # compute dtype: 'float32' | 'bfloat16' (parameters stay float32)
  c.model.dropout = 0.0  # residual/embedding dropout rate during training
  # Attention kernel (lowcomm_jax/model/attention.py): 'auto' runs cuDNN's flash attention on
  # NVIDIA GPUs where it can (bfloat16, head dim a multiple of 8 up to 128) and XLA's
  # elsewhere; 'cudnn' insists on it (refused where it cannot run); 'xla' never uses it.
  # Attention dropout (model.dropout > 0, in training) always runs the materialized form.
  c.model.attention = "auto"  # 'auto' | 'cudnn' | 'xla'
  # The cross-entropy's piece, in positions (lowcomm_jax/model/cross_entropy.py): the float32
  # logits exist one piece at a time. 0: 256 with a 16-bit model.dtype, and the whole
  # sequence in float32 (whose logits are float32 already, and where pieces cost speed on CPU).
  c.model.loss_chunk = 0  # positions per piece of the loss; 0: chosen by model.dtype
  # A pretrained checkpoint (lowcomm_jax/model/pretrained.py): its architecture replaces
  # model.name's and its weights the random init.
  c.model.init_from = ""  # .gguf, .safetensors or a folder with both; '' trains from scratch
  # LoRA (lowcomm_jax/model/lora.py): train adapters A [in, r], B [r, out] on the targeted
  # kernels of a frozen base (model.init_from's, or the seeded init); only they cross the
  # network and fill the checkpoints.
  c.lora = ml_collections.ConfigDict()
  c.lora.rank = 0  # adapter rank; 0: no LoRA, every weight trains
  c.lora.alpha = 16.0  # the adapters' scale is alpha / rank (nnx.LoRA applies none)
  c.lora.targets = ("attn",)  # 'attn' (q|k|v and output projections) and/or 'mlp'
  c.lora.base_dtype = "float32"  # the frozen base's storage: 'float32' | 'bfloat16'
  # A target batch reached together by unequal peers (lowcomm_jax/runtimes/spmd/collab.py), as hivemind
  # does: every host takes micro-batches of its own batch_size at its own speed until the
  # collaboration's samples reach the target, then the sample-weighted mean gradient takes one
  # optimizer step (an epoch; `rounds` counts them). Needs algorithm='ddp'.
  c.collab = ml_collections.ConfigDict()
  c.collab.target_batch_size = 0  # samples per epoch over all peers; 0: off
  c.collab.wait_timeout_s = 600.0  # a peer waits this long for the others' counts, then fails
  c.collab.static_split = False  # baseline: each peer takes a fixed share of the target, in
  # | proportion to hosts[i].speed, instead of counting toward it together
  c.collab.link_gbps = 0.0  # emulate a slow link between peer processes: each epoch's sync
  # | also waits a ring all-reduce of its bytes at this bandwidth; 0: no emulation
  c.collab.link_latency_s = 0.0  # that link's latency, paid per ring step
  # Tensor parallelism inside each worker (lowcomm_jax/model/tp.py), over the mesh's 'model' axis.
  c.model.tp = ml_collections.ConfigDict()
  c.model.tp.size = 1  # devices on 'model' (heads and FFN split over them); 1: no TP
  c.model.tp.sync = "standard"  # standard (2 all-reduces/block) | spd (1) | grouped | selective
  c.model.tp.layers_per_group = 1  # grouped: blocks per all-reduce (must divide n_layer)
  c.model.tp.attn_sync_layers = ()  # selective: blocks that keep their attention all-reduce


def _data(c: ml_collections.ConfigDict) -> None:
  """The corpus and how the workers read it."""
  # --- data --------------------------------------------------------------------------
  c.data = ml_collections.ConfigDict()
  c.data.path = ""  # a plain-text corpus; '' means TinyShakespeare (local copy or download)
  # | or a folder written by `python -m lowcomm_jax.data.prepare`, or a .bin token file in
  # | nanoGPT's format (flat uint16/uint32 ids)
  c.data.tokenizer = "byte"  # 'byte' (vocab 256, no files) | 'r50k_base' | 'gpt2' (alias)
  # | or a Hugging Face tokenizer.json path; token files must have been made with it
  c.data.dtype = ""  # a .bin file's tokens: 'uint16' | 'uint32'; '' : meta.json's, else uint16
  c.data.val_path = ""  # a .bin file of validation tokens; '' : data.path's tail
  c.data.batch_mode = "different"  # 'different': a stream per worker | 'same': one shared stream
  c.data.seq_len = 128  # tokens per training window (model input length)
  c.data.batch_size = 16  # sequences per worker per inner step
  c.data.partition = "none"  # 'none': every worker samples the whole corpus (IID)
  # | 'contiguous': worker w samples only the w-th of num_workers contiguous shards (non-IID)
  c.data.corrupt_workers = ()  # worker ids whose training data is corrupted (tests, benchmarks)
  c.data.corruption = "token_swap"  # 'token_swap' (random tokens) | 'shuffle' (within the window)
  # | 'other_text' (windows of data.corruption_path instead)
  c.data.corruption_prob = 0.3  # token_swap: per token; other_text: per window
  c.data.corruption_path = ""  # other_text: a plain-text file the corrupted workers read
  c.data.val_fraction = 0.1  # tail kept for validation (text, or a .bin without val_path)
