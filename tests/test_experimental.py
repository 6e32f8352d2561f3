"""`python -m dllm_ais.experimental.diagnose_fast_rollouts`: the fast decoders' approximation split into parts."""

from dllm_ais.experimental import diagnose_fast_rollouts


def test_fast_rollout_diagnosis_shows_the_ratio_sees_a_cache_but_not_parallel_commits(capsys):
    """Parallel commits draw from exact logits (nothing for the ratio to see, fewer steps); a cache changes them."""
    diagnose_fast_rollouts.main(["--prompts", "4"])
    rows = {cells[0]: cells[1:] for cells in ([cell.strip() for cell in line.split("|")[1:-1]]
                                              for line in capsys.readouterr().out.splitlines() if line.startswith("| "))}
    assert set(diagnose_fast_rollouts.DECODERS) <= set(rows)
    assert rows["exact"][1] == rows["threshold 0.9"][1] == "0.00e+00"  # k3 seen by the ratio
    assert float(rows["dual cache"][1]) > 0 and float(rows["dual + threshold 0.9"][1]) > 0
    assert float(rows["threshold 0.9"][0]) < float(rows["exact"][0])  # steps per row
