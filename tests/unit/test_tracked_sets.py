"""Changes of tracked sets (key frequencies, heads, head pairs) on the console: named in words,
printed by default only for the sets a probe announces, all of them with `verbose`."""

import phasewatch.probes  # noqa: F401  (registers the probes' key declarations)
from phasewatch.callbacks.probes import ProbeRunner
from phasewatch.probes.keys import is_announced, tracked_name


def test_sets_are_named_in_words_and_only_announced_ones_by_default():
    assert tracked_name("match_heads").startswith("compiled heads and the learned heads")
    assert tracked_name("k_pairs").startswith("K-composing head pairs")
    assert tracked_name("previous_token_heads") == "previous token heads"  # undeclared words: the name itself
    assert is_announced("key_freqs") and is_announced("induction_heads")
    assert not is_announced("match_heads") and not is_announced("q_pairs")


def test_the_callback_prints_announced_changes_and_the_rest_with_verbose(capsys):
    for verbose, expected in ((False, 2), (True, 4)):
        callback = ProbeRunner(names=[], verbose=verbose)
        for step, freqs, pairs in ((10, ["1"], ["L0H0-L1H0"]), (20, ["1", "6"], ["L0H1-L1H0"]),
                                   (30, ["1", "6"], ["L0H1-L1H0"]), (40, ["6"], []), ):
            callback._track(step, "key_freqs", freqs, member="m03" if step == 40 else None)
            callback._track(step, "q_pairs", pairs)
        lines = capsys.readouterr().out.splitlines()
        assert len(lines) == expected, lines
        assert lines[0] == "phasewatch: step 20: key frequencies (the Fourier frequencies the model computes with) {1} -> {1, 6}"
        assert any(line.startswith("phasewatch: member m03, step 40: key frequencies") for line in lines)
        assert any("Q-composing head pairs (earlier-later) {L0H0-L1H0} -> {L0H1-L1H0}" in line for line in lines) == verbose
