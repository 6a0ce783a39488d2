"""Known answers for the learned-vs-compiled measures (probes/tracr.py)."""

import pytest
import torch

from phasewatch.probes.tracr import attention_match, cka_matrix, cka_side, linear_cka, pattern_overlap, probe_accuracy, site_name


def test_pattern_overlap_is_one_for_equal_patterns_and_the_target_mass_for_one_hot():
    g = torch.Generator().manual_seed(0)
    a = torch.softmax(torch.randn(3, 5, 6, generator=g), -1)
    assert torch.allclose(pattern_overlap(a, a), torch.ones(3), atol=1e-12)
    target = torch.zeros(5, 6)
    target[torch.arange(5), torch.tensor([5, 4, 3, 2, 1])] = 1.0  # a reversal lookup
    expected = a[:, torch.arange(5), torch.tensor([5, 4, 3, 2, 1])].mean(-1)
    assert torch.allclose(pattern_overlap(a, target), expected)
    assert torch.allclose(pattern_overlap(a, target), (a * target).sum(-1).mean(-1))  # docs/reference.md: sum_k A S
    uniform = torch.full((5, 6), 1 / 6)
    assert float(pattern_overlap(target, uniform)) == pytest.approx(1 / 6)


def test_linear_cka_known_answers():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(400, 8, generator=g, dtype=torch.float64)
    q, _ = torch.linalg.qr(torch.randn(8, 8, generator=g, dtype=torch.float64))
    assert linear_cka(x, x) == pytest.approx(1.0)
    assert linear_cka(x, 3.0 * x @ q + 5.0) == pytest.approx(1.0)  # rotation, scale and shift invariant
    assert linear_cka(x, torch.cat([x, torch.zeros(400, 3, dtype=torch.float64)], 1)) == pytest.approx(1.0)
    y = torch.randn(400, 8, generator=g, dtype=torch.float64)
    assert linear_cka(x, y) < 0.1  # independent representations
    # half of the directions shared: CKA of [a, b] with [a, c] for independent isotropic blocks is 1/2
    a, b, c = (torch.randn(20000, 4, generator=g, dtype=torch.float64) for _ in range(3))
    assert linear_cka(torch.cat([a, b], 1), torch.cat([a, c], 1)) == pytest.approx(0.5, abs=0.02)


def test_linear_probe_reads_linear_codes_and_not_noise():
    g = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 4, (600,), generator=g)
    codes = torch.randn(4, 16, generator=g)
    x = codes[labels] + 0.1 * torch.randn(600, 16, generator=g)
    assert probe_accuracy(x[:300], labels[:300], x[300:], labels[300:]) == 1.0
    noise = torch.randn(600, 16, generator=g)
    assert abs(probe_accuracy(noise[:300], labels[:300], noise[300:], labels[300:]) - 0.25) < 0.1


def test_site_names_follow_transformer_lens_hooks():
    assert site_name("blocks.0.hook_resid_pre") == "resid_pre0"
    assert site_name("blocks.3.hook_resid_post") == "resid_post3"


def test_the_cka_matrix_holds_linear_cka_of_every_pair():
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(200, d, generator=g) for d in (3, 8)]
    ys = [2.0 * xs[0] + 1.0, torch.randn(200, 4, generator=g), torch.zeros(200, 2)]
    matrix = cka_matrix(xs, ys)
    assert matrix.shape == (2, 3) and matrix[0, 0] == pytest.approx(1.0)
    for i, x in enumerate(xs):
        for j, y in enumerate(ys):
            assert float(matrix[i, j]) == pytest.approx(linear_cka(x, y), abs=1e-12)
    # the tracr probe prepares the compiled side once per run
    assert torch.equal(cka_matrix(xs, prepared=cka_side(ys)), matrix)


def test_the_cka_matrix_counts_a_column_that_several_representations_share_in_each():
    """A compiled residual stream keeps what earlier layers wrote: later sites repeat earlier
    sites' columns to the last bit. cka_side keeps each distinct column once and counts it in
    every site that has it; the matrix is still linear CKA of every pair."""
    g = torch.Generator().manual_seed(2)
    first, written, extra = (torch.randn(300, d, generator=g, dtype=torch.float64) for d in (4, 3, 2))
    ys = [first, torch.cat([first, written], 1), torch.cat([written, first, extra, first[:, :1]], 1)]
    side = cka_side(ys)
    assert side.columns.shape == (300, 9)  # 4 + 3 + 2 distinct columns
    assert side.counts.sum(0).tolist() == [4, 7, 10]  # the last one has first[:, 0] twice
    rotation = torch.linalg.qr(torch.randn(4, 4, generator=g, dtype=torch.float64))[0]
    xs = [torch.randn(300, 5, generator=g), 2.0 * first @ rotation + 1.0, torch.zeros(300, 3)]
    matrix = cka_matrix(xs, prepared=side)
    for i, x in enumerate(xs):
        for j, y in enumerate(ys):
            assert float(matrix[i, j]) == pytest.approx(linear_cka(x, y), abs=1e-12)
    assert matrix[1, 0] == pytest.approx(1.0) and matrix[2].eq(0).all()


def shift(n: int, by: int) -> torch.Tensor:
    """An [n, n] pattern: each query attends `by` positions back (the first `by` to position 0)."""
    return torch.nn.functional.one_hot((torch.arange(n) - by).clamp_min(0), n).double()


def test_attention_match_finds_the_head_and_the_two_head_path_that_make_a_compiled_pattern():
    """Hand-built patterns on 6 positions: compiled head L0H0 looks 1 back, L1H0 looks 2 back.
    The learned model's L0H2 looks 1 back, its L1H3 1 back, every other head at position 0: the
    best single head for L0H0 is L0H2 (overlap 1); looking 2 back is no single head's, but head 3
    of layer 1 reading through head 2 of layer 0 (paths[ref, 1, 3, 0, 2]) does it exactly."""
    n, uniform = 6, shift(6, 6)  # every query at position 0
    learned = torch.stack([torch.stack([uniform, uniform, shift(n, 1), uniform]),
                           torch.stack([uniform, uniform, uniform, shift(n, 1)])])  # [layer, head, q, k]
    compiled = torch.stack([shift(n, 1)[None], shift(n, 2)[None]])  # [layer, 1 head, q, k]
    batch = 3
    patterns, ref_patterns = [learned.expand(batch, -1, -1, -1, -1)], [compiled.expand(batch, -1, -1, -1, -1)]
    single, paths = attention_match(patterns, ref_patterns, [(0, 0), (1, 0)])
    assert single.shape == (2, 2, 4) and paths.shape == (2, 2, 4, 2, 4)
    assert single[0, 0, 2] == 1.0 and int(single[0].argmax()) == 2  # L0H2
    assert single[1].max() < 0.5  # no single head looks 2 back
    assert paths[1, 1, 3, 0, 2] == 1.0
    assert torch.unravel_index(paths[1].argmax(), paths[1].shape) == (1, 3, 0, 2)
    assert paths[1, 1, 2, 0, 3] < 0.5  # the other way round (head 2 of layer 1 through head 3 of layer 0) is not it
    # two lengths: the mean of each length's mean
    short = [p[:, :, :, :4, :4] for p in patterns], [p[:, :, :, :4, :4] for p in ref_patterns]
    both = attention_match(patterns + short[0], ref_patterns + short[1], [(1, 0)])
    one = attention_match(short[0], short[1], [(1, 0)])
    assert torch.allclose(both[1], (paths[1:] + one[1]) / 2)
