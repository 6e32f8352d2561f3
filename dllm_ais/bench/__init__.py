"""`dllm-ais bench NAME`: benchmarks that print ratios measured in one run beside the device and settings.

One module per benchmark, each runnable as `python -m dllm_ais.bench.NAME` with the same options:
`rollout` (fast diffusion decoders against the official algorithm), `sampler` (sampler overhead and engine sync),
`mismatch` (trainer-engine KL and ESS per precision), `routing` (a mixture of experts' engine-trainer routing
disagreement per precision, split against replayed routing), `memory` (estimator peak memory), `step` (one GRPO step's
shares and the log-prob pass's memory), `precision` (the precision ladder's throughput, sync and step memory on one
CUDA GPU at LLaDA-8B's shape). `common` holds what they share.
"""
