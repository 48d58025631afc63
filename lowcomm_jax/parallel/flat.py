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
import math
from typing import Any

import jax
import jax.numpy as jnp
import optax


@dataclasses.dataclass(frozen=True)
class ParamLayout:
  """Where each leaf of a parameter tree lives in the flat vector, grouped into fragments.

  Leaves are stored fragment by fragment (tree order inside each), so fragment p is the
  contiguous slice `bounds[p]` of the buffer: its sync is one all-reduce and one outer
  update on that slice (Streaming DiLoCo). With one fragment the order is the tree's.
  """
  abstract: Any  # the tree of jax.ShapeDtypeStruct
  treedef: Any
  shapes: tuple[tuple[int, ...], ...]  # per leaf, tree order
  offsets: tuple[int, ...]  # per leaf, tree order
  size: int
  leaf_fragment: tuple[int, ...] = ()  # per leaf, tree order ((): every leaf in fragment 0)
  bounds: tuple[tuple[int, int], ...] = ()  # per fragment: [start, end) in the buffer

  @classmethod
  def of(cls, tree, leaf_fragment=None) -> "ParamLayout":
    """The layout of `tree` (arrays or ShapeDtypeStructs, all of one dtype); leaf i goes to
    fragment `leaf_fragment[i]` (tree order; default: one fragment)."""
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)
    leaves, treedef = jax.tree.flatten(abstract)
    dtypes = {x.dtype for x in leaves}
    if len(dtypes) != 1:
      raise ValueError("a flat parameter buffer needs one dtype; the tree has "
                       f"{sorted(map(str, dtypes))}")
    fragment = tuple(leaf_fragment) if leaf_fragment is not None else (0,) * len(leaves)
    count = max(fragment) + 1
    if len(fragment) != len(leaves) or sorted(set(fragment)) != list(range(count)):
      raise ValueError(f"leaf_fragment must give each of the {len(leaves)} leaves a "
                       f"fragment, using every index 0..{count - 1}")
    sizes = [math.prod(x.shape) for x in leaves]
    order = sorted(range(len(leaves)), key=lambda i: (fragment[i], i))
    offsets, bounds, at = [0] * len(leaves), [], 0
    for p in range(count):
      start = at
      for i in order:
        if fragment[i] == p:
          offsets[i], at = at, at + sizes[i]
      bounds.append((start, at))
    return cls(abstract, treedef, tuple(x.shape for x in leaves), tuple(offsets), sum(sizes),
               fragment, tuple(bounds))

  def __hash__(self):  # `abstract` (a dict) follows from treedef, shapes and dtype
    return hash((self.treedef, self.shapes, self.offsets, self.leaf_fragment, self.bounds))

  @property
  def num_fragments(self) -> int:
    return max(len(self.bounds), 1)

  def _order(self) -> list[int]:
    """Leaf indices in buffer order."""
    return sorted(range(len(self.shapes)), key=lambda i: self.offsets[i])

  def ravel(self, tree) -> jax.Array:
    """The tree's leaves, flattened and concatenated in buffer order: [size]. (Per worker:
    under vmap.)"""
    leaves = self.treedef.flatten_up_to(tree)
    for x, shape in zip(leaves, self.shapes):  # e.g. an unpadded tier tree would fit silently
      if x.shape != shape:
        raise ValueError(f"leaf of shape {x.shape} where the layout has {shape}")
    return jnp.concatenate([leaves[i].reshape(-1) for i in self._order()])

  def unravel(self, flat: jax.Array):
    """The tree view of `flat` ([size]); XLA fuses the slices into their consumers."""
    return self.treedef.unflatten([jax.lax.slice_in_dim(flat, o, o + math.prod(s)).reshape(s)
                                   for o, s in zip(self.offsets, self.shapes)])

  def fragment(self, p: int) -> "ParamLayout":
    """The layout of fragment p's own buffer (`flat[bounds[p][0]:bounds[p][1]]`): a tree of
    its leaves only, same paths (tier masks and per-tensor codecs key on them)."""
    if not self.bounds:
      return self
    paths = jax.tree_util.tree_flatten_with_path(self.abstract)[0]
    sub = {}
    for i, (path, leaf) in enumerate(paths):
      if self.leaf_fragment[i] == p:
        node = sub
        for key in path[:-1]:
          node = node.setdefault(_key(key), {})
        node[_key(path[-1])] = leaf
    return ParamLayout.of(sub)

  def fragment_slice(self, flat: jax.Array, p: int) -> jax.Array:
    """Fragment p's part of a flat buffer (its last axis)."""
    start, end = self.bounds[p] if self.bounds else (0, self.size)
    return jax.lax.slice_in_dim(flat, start, end, axis=flat.ndim - 1)

  def fragment_update(self, flat: jax.Array, part: jax.Array, p: int) -> jax.Array:
    """`flat` with fragment p's part replaced by `part` (last axis)."""
    if self.num_fragments == 1:
      return part
    start = self.bounds[p][0]
    return jax.lax.dynamic_update_slice_in_dim(flat, part, start, axis=flat.ndim - 1)


def _key(entry):
  """A tree path entry's dict key (DictKey.key, SequenceKey.idx)."""
  for attr in ("key", "idx", "name"):
    if hasattr(entry, attr):
      return getattr(entry, attr)
  raise TypeError(f"unsupported tree path entry {entry!r}")


def tree_view(tx: optax.GradientTransformation, layout: ParamLayout, *,
              stacked: bool = False) -> optax.GradientTransformationExtraArgs:
  """`tx`, which needs the parameters' tensors, applied to flat updates and parameters.

  Its state stays tree-shaped (a codec's per-tensor error buffers, AdamW's moments); extra
  args (tier weights, say) are passed through as the trees the caller built. `stacked`: tx
  returns one update per worker ([R, ...] leaves), raveled to [R, size].
  """
  ravel = jax.vmap(layout.ravel) if stacked else layout.ravel
  tx = optax.with_extra_args_support(tx)

  def init_fn(params):
    return tx.init(layout.unravel(params))

  def update_fn(updates, state, params=None, **extra_args):
    tree_params = None if params is None else layout.unravel(params)
    updates, state = tx.update(layout.unravel(updates), state, tree_params, **extra_args)
    return ravel(updates), state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
