"""Study tools outside the library's one way through, runnable as `python -m dllm_ais.experimental.<name>`:
`diagnose_fast_rollouts` (what a fast diffusion decoder changes in a batch) and `learning_diagnostics` (is a run
learning from its rewards: shuffled-reward control, gradient signal-to-noise)."""
