"""Tensor parallelism over the mesh's 'model' axis with a choice of synchronization points.

Megatron layout inside `jax.shard_map`: attention heads split over devices (QKV
column-parallel, output projection row-parallel), MLP column- then row-parallel, embeddings,
LayerNorms and the output head replicated. Every row-parallel matmul yields a *partial*
output per device; a sync point all-reduces the partials accumulated since the last one:

    x_sync (replicated)   acc (this device's partial outputs since the last sync)
    a block's attention / MLP reads the device-local residual x_sync + acc
    sync:  x_sync ← x_sync + psum(acc);  acc ← 0

Plans (`SyncPlan.kind`) choose the sync points:
  standard   after every attention and every MLP (2 per block, exact Megatron)
  spd        after every MLP only: attention partials stay on the device that made them and
             are folded into the block's MLP all-reduce (1 per block)
  grouped    after the MLP of every k-th block (n_layer / k per forward)
  selective  spd, plus an attention sync in the blocks listed in `attn_sync_layers`
Between syncs each device computes exactly; only the inputs it reads differ from the
unsharded model (it sees its own partials, not the others'). With one device on 'model'
every plan is the unsharded model. Row-parallel biases (identical on every device) are added
to the replicated residual directly, not summed.

Inside the runner (per-worker `vmap` over 'replica' around this shard_map) jax 0.10.2's Shardy
lowering rejects the nesting; runs with model.tp.size > 1 compile their programs under the
GSPMD partitioner (`partitioner`, a scoped setting).

Parallel-residual blocks (GPT-NeoX) read one input for attention and MLP, so their attention
sync point merges into the MLP's.
"""

import contextlib
import dataclasses

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from lowcomm_jax.model.gpt import _rotary
from lowcomm_jax.model.presets import GPTConfig

SYNC_PLANS = ("standard", "spd", "grouped", "selective")


@dataclasses.dataclass(frozen=True)
class SyncPlan:
  kind: str = "standard"
  layers_per_group: int = 1  # grouped: blocks between all-reduces
  attn_sync_layers: tuple[int, ...] = ()  # selective: blocks that keep the attention sync

  def sync_after(self, n_layer: int, parallel_residual: bool = False) -> list[tuple[bool, bool]]:
    """Per block: (sync after its attention, sync after its MLP)."""
    out = []
    for i in range(n_layer):
      if self.kind == "standard":
        attn, mlp = True, True
      elif self.kind == "spd":
        attn, mlp = False, True
      elif self.kind == "grouped":
        attn, mlp = False, (i + 1) % self.layers_per_group == 0
      elif self.kind == "selective":
        attn, mlp = i in self.attn_sync_layers, True
      else:
        raise ValueError(f"unknown sync plan {self.kind!r}; use one of {SYNC_PLANS}")
      if parallel_residual:  # one input for both halves: a single sync point per block
        attn, mlp = False, attn or mlp
      out.append((attn, mlp))
    out[-1] = (out[-1][0], True)  # the head needs the replicated residual
    return out

  def syncs_forward(self, n_layer: int, parallel_residual: bool = False) -> int:
    return sum(a + m for a, m in self.sync_after(n_layer, parallel_residual))


def plan_problems(plan: SyncPlan, cfg: GPTConfig, tp: int) -> list[str]:
  """Why `plan` cannot run `cfg` on `tp` devices (empty when it can)."""
  problems = []
  if plan.kind not in SYNC_PLANS:
    problems.append(f"model.tp.sync={plan.kind!r}: use one of {SYNC_PLANS}")
  if tp < 1 or cfg.n_head % tp:
    problems.append(f"model.tp.size={tp}: must divide n_head={cfg.n_head} (heads are split "
                    "over the 'model' axis)")
  if tp >= 1 and cfg.d_ff % tp:
    problems.append(f"model.tp.size={tp}: must divide d_ff={cfg.d_ff}")
  if plan.kind == "grouped" and (plan.layers_per_group < 1
                                 or cfg.n_layer % plan.layers_per_group):
    problems.append(f"model.tp.layers_per_group={plan.layers_per_group}: must divide "
                    f"n_layer={cfg.n_layer}")
  bad = [i for i in plan.attn_sync_layers if not 0 <= i < cfg.n_layer]
  if plan.kind == "selective" and bad:
    problems.append(f"model.tp.attn_sync_layers={list(plan.attn_sync_layers)}: layers {bad} "
                    f"are outside 0..{cfg.n_layer - 1}")
  if plan.kind != "selective" and plan.attn_sync_layers:
    problems.append(f"model.tp.attn_sync_layers={list(plan.attn_sync_layers)}: only the "
                    "'selective' plan reads it; set model.tp.sync=selective or clear it")
  if plan.kind != "grouped" and plan.layers_per_group != 1:
    problems.append(f"model.tp.layers_per_group={plan.layers_per_group}: only the 'grouped' "
                    "plan reads it; set model.tp.sync=grouped or leave it at 1")
  if cfg.dtype != "float32":
    problems.append(f"model.dtype={cfg.dtype!r}: tensor-parallel blocks compute in float32 "
                    "so far; set --config.model.dtype=float32")
  if cfg.dropout:
    problems.append(f"model.dropout={cfg.dropout}: tensor-parallel blocks run without dropout; "
                    "set it to 0")
  return problems


# --- Parameter layout ---------------------------------------------------------------------

def _block_layout(cfg: GPTConfig):
  """(reshape to the split layout, its PartitionSpec) per block leaf."""
  d, h = cfg.d_model, cfg.n_head
  hd = d // h
  return {
      ("attn", "qkv", "kernel"): ((d, 3, h, hd), P(None, None, "model", None)),
      ("attn", "qkv", "bias"): ((3, h, hd), P(None, "model", None)),
      ("attn", "proj", "kernel"): ((h, hd, d), P("model", None, None)),
      ("mlp", "fc_kernel"): (None, P(None, "model")),
      ("mlp", "fc_bias"): (None, P("model")),
      ("mlp", "proj_kernel"): (None, P("model", None)),
  }


def _map_blocks(params, cfg: GPTConfig, fn):
  layout = _block_layout(cfg)

  def leaf(path, x):
    keys = tuple(getattr(k, "key", None) for k in path)
    if keys[0] == "blocks" and keys[2:] in layout:
      return fn(x, *layout[keys[2:]])
    return fn(x, None, P())
  return jax.tree_util.tree_map_with_path(leaf, params)


def split_layout(params, cfg: GPTConfig):
  """The GPT parameter tree reshaped so heads are a separate axis (no data moves)."""
  return _map_blocks(params, cfg, lambda x, shape, _: x.reshape(shape) if shape else x)


def param_specs(params, cfg: GPTConfig):
  """PartitionSpecs of `split_layout(params)` over the 'model' axis."""
  return _map_blocks(params, cfg, lambda x, shape, spec: spec)


# --- Forward ------------------------------------------------------------------------------

def _layer_norm(x, p):
  mean = x.mean(-1, keepdims=True)
  var = jnp.square(x - mean).mean(-1, keepdims=True)
  y = (x - mean) * jax.lax.rsqrt(var + 1e-5) * p["scale"]
  return y + p["bias"] if "bias" in p else y


def _attention_partial(p, x, cfg: GPTConfig):
  """This device's heads: its share of the attention output projection (a partial sum;
  the projection's bias, which every device holds, is added by the caller)."""
  b, l, _ = x.shape
  qkv = jnp.einsum("bld,dthk->tblhk", x, p["qkv"]["kernel"])
  if "bias" in p["qkv"]:
    qkv = qkv + p["qkv"]["bias"][:, None, None]
  q, k, v = qkv[0], qkv[1], qkv[2]
  if cfg.position == "rotary":
    rot = 2 * int(cfg.head_dim * cfg.rotary_fraction / 2)
    if rot:
      q, k = _rotary(q, rot), _rotary(k, rot)
  y = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=cfg.attention)
  return jnp.einsum("blhk,hkd->bld", y, p["proj"]["kernel"])


def _mlp_partial(p, x):
  h = x @ p["fc_kernel"]
  if "fc_bias" in p:
    h = h + p["fc_bias"]
  return jax.nn.gelu(h, approximate=False) @ p["proj_kernel"]


def _bias(p, name):
  return p.get(name, 0.0)


def _local_logits(params, tokens, cfg: GPTConfig, plan: SyncPlan):
  """Runs on one device of the 'model' axis (inside shard_map)."""
  _, l = tokens.shape
  x_sync = params["wte"]["embedding"][tokens]
  if "wpe" in params:
    x_sync = x_sync + params["wpe"]["embedding"][:l][None]
  acc = jnp.zeros_like(x_sync)

  def sync(x_sync, acc):
    return x_sync + jax.lax.psum(acc, "model"), jnp.zeros_like(acc)

  plan_points = plan.sync_after(cfg.n_layer, cfg.parallel_residual)
  for i, (attn_sync, mlp_sync) in enumerate(plan_points):
    p = params["blocks"][i]
    # Row-parallel biases are replicated: added to x_sync whole, so every device's local
    # residual has them at once (not only 1/tp of them until the next sync).
    local = x_sync + acc
    attn = _attention_partial(p["attn"], _layer_norm(local, p["ln1"]), cfg)
    if cfg.parallel_residual:
      acc = acc + attn + _mlp_partial(p["mlp"], _layer_norm(local, p["ln2"]))
      x_sync = x_sync + _bias(p["attn"]["proj"], "bias") + _bias(p["mlp"], "proj_bias")
    else:
      acc = acc + attn
      x_sync = x_sync + _bias(p["attn"]["proj"], "bias")
      if attn_sync:
        x_sync, acc = sync(x_sync, acc)
      acc = acc + _mlp_partial(p["mlp"], _layer_norm(x_sync + acc, p["ln2"]))
      x_sync = x_sync + _bias(p["mlp"], "proj_bias")
    if mlp_sync:
      x_sync, acc = sync(x_sync, acc)
  x = _layer_norm(x_sync, params["ln_f"])
  if "lm_head" in params:
    return (x @ params["lm_head"]["kernel"]).astype(jnp.float32)
  return (x @ params["wte"]["embedding"].T).astype(jnp.float32)


def tp_logits(params, tokens_BxL, cfg: GPTConfig, plan: SyncPlan, mesh):
  """Float32 logits [B, L, V] of the GPT with `params` (its usual tree), tensor-parallel over
  `mesh`'s 'model' axis with `plan`'s sync points. Batch rows stay replicated."""
  split = split_layout(params, cfg)
  fn = jax.shard_map(
      lambda p, t: _local_logits(p, t, cfg, plan), mesh=mesh,
      in_specs=(param_specs(params, cfg), P()), out_specs=P(), axis_names={"model"},
      # Unchecked: vma typing rejects this shard_map under the runner's
      # vmap(spmd_axis_name='replica') (that axis is Auto). Replicated inputs' gradients are
      # then summed once at this boundary (one more all-reduce per train step).
      check_vma=False)
  return fn(split, tokens_BxL)


def tp_loss(params, windows_BxL1, cfg: GPTConfig, plan: SyncPlan, mesh):
  """Mean next-token cross-entropy under `plan` (differentiable: a train step's loss)."""
  logits = tp_logits(params, windows_BxL1[:, :-1], cfg, plan, mesh)
  return optax.softmax_cross_entropy_with_integer_labels(logits, windows_BxL1[:, 1:]).mean()


def count_all_reduces(compiled_text: str) -> int:
  """All-reduce operations in compiled HLO text (sync and async-start forms)."""
  return sum(compiled_text.count(f" {op}(") for op in ("all-reduce", "all-reduce-start"))



def partitioner(plan: "SyncPlan | None") -> contextlib.AbstractContextManager:
  """The partitioner a run's programs must be compiled under: GSPMD for tensor parallelism,
  which lowers a shard_map over 'model' nested in vmap(spmd_axis_name='replica'); Shardy
  (jax 0.10.2's default) fails to verify it ('sdy.manual_computation op operand shape ...
  must match'). Scoped, not process-wide: jit keys its cache on the setting, so other runs
  in the same process keep Shardy. (The scoped form lives in jax._src.config.)"""
  if plan is None:
    return contextlib.nullcontext()
  from jax._src import config as jax_config
  return jax_config.use_shardy_partitioner(False)
