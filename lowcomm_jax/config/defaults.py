"""Every configuration field, with its default and what it means: the schema of record.

It ships with the package, so a non-editable install keeps every check that compares a
config with the defaults and every field's meaning in `--print_config` (config/doc.py reads
the comments here, and a section declared beside its owner from its `config_defaults`).
configs/base.py hands it to config files; they start from `get_config()` and change a few
fields. Any field can be overridden on the command line:
`--config.outer.lr=0.5 --config.data.batch_mode=same`. Values are checked once at start-up
(lowcomm_jax/config/check.py) before any compute.
"""

import os
from typing import Callable

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  """Every field at its default: the run's own sections here, then those declared beside
  their owners (`declared_sections`: codecs, aggregation, the runtimes', each algorithm's)."""
  c = ml_collections.ConfigDict()
  for section in (_run, _devices, _outer, _runtime, _model, _data):
    section(c)
  for dotted, declare in declared_sections():
    *parents, name = dotted.split(".")
    node = c
    for parent in parents:
      node = node[parent]
    node[name] = declare()
  return c


def declared_sections() -> list[tuple[str, Callable[[], ml_collections.ConfigDict]]]:
  """(dotted section, the function that declares its fields) of each section declared
  beside its owner, in the order --print_config lists them: the processes' join
  (parallel/distributed.py), the inner optimizer (programs/optimizers.py), how
  contributions combine (aggregate/), the attacks, the codecs (compress/), the Ray
  runtime's and the simulator's own (their checks' modules), then every algorithm with a
  section of its own. config/doc.py reads their comments from the same functions."""
  from lowcomm_jax import aggregate, algorithms, compress
  from lowcomm_jax.aggregate import attack
  from lowcomm_jax.parallel import distributed
  from lowcomm_jax.programs import optimizers
  from lowcomm_jax.runtimes.ray import checks as ray_checks
  from lowcomm_jax.sim import checks as sim_checks
  owners = [("distributed", distributed.config_defaults),
            ("optimizer", optimizers.config_defaults),
            ("aggregate", aggregate.config_defaults), ("attack", attack.config_defaults),
            ("compress", compress.config_defaults), ("ray", ray_checks.config_defaults),
            ("sim", sim_checks.config_defaults)]
  return owners + [(a.config_section, a.config_defaults) for a in algorithms.REGISTRY.values()
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
  """Each worker's devices (the processes' join is parallel/distributed.py's section)."""
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


def _runtime(c: ml_collections.ConfigDict) -> None:
  """Which runtime runs the run (runtimes.RUNTIMES; each declares its own section beside
  its checks)."""
  # --- runtime (lowcomm_jax/runtimes/: the table RUNTIMES) -------------------------------
  c.runtime = "spmd"  # 'spmd': jax.distributed, lockstep processes | 'simulator': virtual
  # | workers on a virtual clock, one process (sim.*) | 'ray': a JAX process per worker and
  # | server; asynchronous algorithms; workers join, leave or crash (ray.*)
  c.collective_form = "auto"  # how a synchronous round's workers combine their updates,
  # | in the simulator and on Ray (the lockstep runtime's are XLA's): 'direct' (every pair at
  # | once, in two steps: Ray's runtimes/ray/forms/direct.py) | 'hierarchical' (inside each
  # | region, then across regions) | 'ring' (the simulator only) | 'server' (a parameter
  # | server's rounds: pulls, then contributions) | 'auto' (the faster in the simulator's
  # | model, sim/collectives.py: ring or hierarchical there, direct or hierarchical on Ray)


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
