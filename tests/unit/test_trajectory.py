"""PCA of checkpoint vectors: a path that changes direction keeps its two segments."""

import numpy as np

from phasewatch.cli.trajectory import pca_2d


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


def test_the_components_are_the_svds_with_the_path_running_forward():
    """Against numpy's SVD of the centred rows: the same coordinates up to each component's
    sign, and the same explained variance; the sign puts the last row ahead of the first."""
    rng = np.random.default_rng(1)
    rows = np.cumsum(rng.normal(size=(40, 300)) * np.linspace(3, 0.1, 300), 0)  # a random walk, uneven axes
    coords, ratio = pca_2d(rows)
    centred = rows - rows.mean(0)
    u, s, _ = np.linalg.svd(centred, full_matrices=False)
    want = u[:, :2] * s[:2]
    for j in range(2):
        sign = np.sign(want[-1, j] - want[0, j])
        np.testing.assert_allclose(coords[:, j], sign * want[:, j], rtol=1e-7, atol=1e-9 * s[0])
        assert coords[-1, j] >= coords[0, j]
    np.testing.assert_allclose(ratio, s[:2] ** 2 / (s ** 2).sum(), rtol=1e-10)
    assert np.all(pca_2d(np.ones((5, 4)))[1] == 0)  # no variance: no components, no division by 0


def test_the_sign_of_an_arcs_second_component_does_not_follow_rounding():
    """On an arc PC2 starts and ends at the same value: its sign then comes from its largest
    coordinate, so noise at the level of rounding cannot mirror the drawing."""
    angle = np.linspace(0, np.pi, 31)
    arc = np.column_stack([np.cos(angle), np.sin(angle), np.zeros(31)])
    for noise in (0.0, 1e-12, -1e-12):
        coords, _ = pca_2d(arc + noise * np.random.default_rng(2).normal(size=arc.shape))
        assert coords[-1, 0] > coords[0, 0]
        assert coords[np.argmax(np.abs(coords[:, 1])), 1] > 0  # the arc's middle is on the positive side
