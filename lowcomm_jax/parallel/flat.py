"""θ_global as one flat buffer, and views of it as the model's parameter tree.

The global state (θ_global, the outer rule's momentum) and every pseudo-gradient are stored
as one flat vector. The outer step is then one all-reduce and one fused elementwise update
over a single buffer, instead of a concatenate before the all-reduce, a split after it and
one small update kernel per tensor, which cost as much as the transfer itself where the
fabric is fast (BENCHMARKS.md, issue 3). Code that needs the tensors (the model, MatFormer
tier slicing, per-tensor codecs, AdamW's weight-decay mask) unravels a view inside its own
jitted program, where XLA fuses the slices into their consumers.
"""

import dataclasses
import itertools
import math
from typing import Any

import jax
import jax.numpy as jnp
import optax


@dataclasses.dataclass(frozen=True)
class ParamLayout:
  """Where each leaf of a parameter tree lives in the flat vector (leaf order, row-major)."""
  abstract: Any  # the tree of jax.ShapeDtypeStruct
  treedef: Any
  shapes: tuple[tuple[int, ...], ...]
  offsets: tuple[int, ...]
  size: int

  @classmethod
  def of(cls, tree) -> "ParamLayout":
    """The layout of `tree` (arrays or ShapeDtypeStructs, all of one dtype)."""
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)
    leaves, treedef = jax.tree.flatten(abstract)
    dtypes = {x.dtype for x in leaves}
    if len(dtypes) != 1:
      raise ValueError("a flat parameter buffer needs one dtype; the tree has "
                       f"{sorted(map(str, dtypes))}")
    sizes = [math.prod(x.shape) for x in leaves]
    offsets = tuple(itertools.accumulate([0] + sizes[:-1]))
    return cls(abstract, treedef, tuple(x.shape for x in leaves), offsets, sum(sizes))

  def ravel(self, tree) -> jax.Array:
    """The tree's leaves, flattened and concatenated: [size]. (Per worker: under vmap.)"""
    leaves = self.treedef.flatten_up_to(tree)
    for x, shape in zip(leaves, self.shapes):  # e.g. an unpadded tier tree would fit silently
      if x.shape != shape:
        raise ValueError(f"leaf of shape {x.shape} where the layout has {shape}")
    return jnp.concatenate([x.reshape(-1) for x in leaves])

  def unravel(self, flat: jax.Array):
    """The tree view of `flat` ([size]); XLA fuses the slices into their consumers."""
    return self.treedef.unflatten([jax.lax.slice_in_dim(flat, o, o + math.prod(s)).reshape(s)
                                   for o, s in zip(self.offsets, self.shapes)])


def tree_view(tx: optax.GradientTransformation, layout: ParamLayout
              ) -> optax.GradientTransformationExtraArgs:
  """`tx`, which needs the parameters' tensors, applied to flat updates and parameters.

  Its state stays tree-shaped (a codec's per-tensor error buffers, AdamW's moments); extra
  args (tier weights, say) are passed through as the trees the caller built.
  """
  tx = optax.with_extra_args_support(tx)

  def init_fn(params):
    return tx.init(layout.unravel(params))

  def update_fn(updates, state, params=None, **extra_args):
    tree_params = None if params is None else layout.unravel(params)
    updates, state = tx.update(layout.unravel(updates), state, tree_params, **extra_args)
    return layout.ravel(updates), state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
