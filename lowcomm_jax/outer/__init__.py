"""Outer algorithms as optax GradientTransformations applied to pseudo-gradients."""

from lowcomm_jax.outer.anchor import AnchorState, anchor_momentum
from lowcomm_jax.outer.delayed_nesterov import DelayedNesterovState, delayed_nesterov
from lowcomm_jax.outer.diloco import diloco_outer, pseudo_gradient
from lowcomm_jax.outer.halos import merge_global
from lowcomm_jax.outer.one_step_delay import OneStepDelayState, one_step_delay
