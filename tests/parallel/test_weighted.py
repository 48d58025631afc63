"""The masked weighted mean (parallel/weighted.py) that every weighted sync divides with."""

import numpy as np

from lowcomm_jax.parallel import weighted


def test_the_weighted_mean_weighs_each_coordinate_and_is_zero_where_nothing_weighs():
  values = np.array([[1.0, 2.0, 3.0], [5.0, 6.0, 7.0]], np.float32)
  weights = np.array([[1.0, 0.0, 0.0], [3.0, 2.0, 0.0]], np.float32)  # coordinate 2: nobody
  mean = np.asarray(weighted.weighted_mean(weights, values))
  np.testing.assert_allclose(mean, [(1 + 15) / 4, 6.0, 0.0])
  assert np.isfinite(mean).all()


def test_divide_by_weight_broadcasts_and_keeps_zero_weight_at_zero():
  numerator = np.array([[2.0, 0.0], [4.0, 0.0]], np.float32)
  total = np.array([2.0, 0.0], np.float32)
  np.testing.assert_array_equal(np.asarray(weighted.divide_by_weight(numerator, total)),
                                [[1.0, 0.0], [2.0, 0.0]])
