"""Outer algorithms as optax GradientTransformations applied to pseudo-gradients."""

from lowcomm_jax.outer.diloco import ddp_outer, diloco_outer, pseudo_gradient, replica_mean
