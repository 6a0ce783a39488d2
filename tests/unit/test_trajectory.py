"""PCA of checkpoint vectors: a path that changes direction keeps its two segments."""

import numpy as np

from phasewatch.trainers.trajectory import pca_2d


def test_an_l_shaped_path_comes_out_as_two_perpendicular_segments():
    rng = np.random.default_rng(0)
    d = 50
    a, b = np.linalg.qr(rng.normal(size=(d, 2)))[0].T  # two orthonormal directions
    first = [t * a for t in range(11)]  # phase 1: along a
    second = [10 * a + t * b for t in range(1, 11)]  # phase 2: along b
    rows = np.array(first + second) + 1e-3 * rng.normal(size=(21, d))
    coords, ratio = pca_2d(rows)
    assert ratio.sum() > 0.999 and ratio[0] >= ratio[1]
    u = coords[10] - coords[0]
    v = coords[20] - coords[10]
    cosine = u @ v / np.linalg.norm(u) / np.linalg.norm(v)
    assert abs(cosine) < 0.01  # the turn between the phases survives the projection
    assert abs(np.linalg.norm(u) - np.linalg.norm(v)) < 0.05  # and the lengths of the segments


def test_a_straight_path_has_one_component():
    steps = np.arange(20)[:, None] * np.ones((1, 8))
    coords, ratio = pca_2d(steps)
    assert ratio[0] > 0.999
    assert np.allclose(np.diff(coords[:, 0]), np.diff(coords[:, 0])[0])  # evenly spaced along PC1
