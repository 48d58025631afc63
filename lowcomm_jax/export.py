"""`--export_merged`: a LoRA run's model as one Hugging Face checkpoint (base + scaled
adapters), from the run's latest checkpoint."""

import json
import pathlib

import jax

from lowcomm_jax.checkpoint import Checkpointer, abstract_with_shardings
from lowcomm_jax.model import hf_export, lora


def export_merged(r, workdir: str | pathlib.Path, out: str | pathlib.Path) -> pathlib.Path:
  """Writes `out`/model.safetensors + config.json: the frozen base with every adapted
  kernel replaced by W + (α/r)·A·B, A and B from the workdir's latest checkpoint. The
  safetensors metadata names the base and the checkpoint's round. `r`: the run, built."""
  c = r.config
  if c.lora.rank == 0:
    raise ValueError("--export_merged needs a LoRA run (lora.rank > 0)")
  ckpt = Checkpointer(pathlib.Path(workdir) / "checkpoints", max_to_keep=c.keep_checkpoints)
  try:
    step = ckpt.latest_round()
    if step is None:
      raise ValueError(f"{workdir}: no checkpoint to export; run it first")
    state = ckpt.restore_state(step, abstract_with_shardings(r.state_spec.abstract,
                                                             r.state_spec.shardings))
  finally:
    ckpt.close()
  adapters = r.model.layout.unravel(state.params)
  base = jax.tree.map(lambda x: x.astype("float32"), r.frozen)
  merged = lora.merge(base, adapters, scale=c.lora.alpha / c.lora.rank)
  meta = {"lora_base": c.model.init_from or f"seeded init (seed {c.seed})",
          # a bfloat16-stored base is exported as it was trained on: bfloat16-rounded
          "lora_base_dtype": c.lora.base_dtype,
          "lora": json.dumps({"rank": c.lora.rank, "alpha": c.lora.alpha,
                              "targets": list(c.lora.targets)}),
          "round": str(step)}
  return hf_export.save_safetensors(out, r.model.cfg, merged, metadata=meta)
