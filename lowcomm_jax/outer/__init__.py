"""Outer algorithms as optax GradientTransformations applied to pseudo-gradients."""

from lowcomm_jax.outer.diloco import diloco_outer, pseudo_gradient
from lowcomm_jax.outer.dylu import dylu_inner_steps
