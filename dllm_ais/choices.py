"""The option lists of the pipeline's stages, defined once and free of heavy imports.

Each stage imports its list from here and `GRPOConfig` offers them as field choices, so `dllm-ais --help` and
config validation never import torch. Add an option here and implement it in its stage.
"""

CACHE_MODES = ("none", "prefix", "dual")  # dllm_ais.sampling.diffusion: block KV cache
COMMIT_SCHEDULES = ("even", "time_linear")  # dllm_ais.sampling.diffusion: tokens committed per step (LLaDA, Dream)
CACHE_DTYPES = ("none", "fp8")  # dllm_ais.sampling.fp8_cache: storage of the block KV cache (none = the model's dtype)
FIDELITY_MODES = ("fixed", "adaptive")  # dllm_ais.fidelity: which decoder samples each generation batch
# dllm_ais.quantization: rollout engine precision (low-precision ladder: FP8, MX, NVFP4, int8, int4 groups)
PRECISIONS = ("bf16", "fp8", "fp8_tensor", "fp8_weight_only", "mxfp8", "int8", "mxfp4", "nvfp4", "nvfp4_weight_only",
              "int4", "int4_g128")
# dllm_ais.engine: the engine a quantized copy beside a high-precision trainer, or one model computing as the engine
PRECISION_FLOWS = ("split", "unified")
# The notches whose activation scale is taken over the whole input tensor: the numbers of a row depend on the batch
BATCH_SCALED_PRECISIONS = ("fp8_tensor", "nvfp4")
# dllm_ais.likelihood.DIFFUSION_ESTIMATORS: diffusion log-prob estimators
ESTIMATORS = ("one_step", "trajectory", "step_merge", "elbo", "spg")
# The estimators that replay the recorded denoising trajectory (one forward per step or per segment of steps): they
# score softmax(logits / τ) along the sampler's commit order, piece by piece.
TRAJECTORY_ESTIMATORS = ("trajectory", "step_merge")
SEQUENCE_ESTIMATORS = ("elbo", "spg")  # one estimate per completion, spread over its tokens (DiffusionEstimator)
# The trajectory-type estimators' commit order: the rollout's own, or the exact decoder's (a replay); and the logits
# the trajectory estimator scores a cached rollout with: the exact model's, or the rollout decoder's (`replays_decoder`)
LIKELIHOOD_ORDERS = ("rollout", "exact")
LIKELIHOOD_DECODERS = ("exact", "rollout")
CORRECTION_METHODS = ("none", "tis", "mis", "acr", "ais")  # dllm_ais.correction
IS_LEVELS = ("token", "sequence", "geometric")
ALPHA_RULES = ("adaptive", "gate", "oracle")
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")  # dllm_ais.loss
RATIO_TYPES = ("token", "ctpo")
REWARD_SCALINGS = ("none", "group", "batch")
SFT_MASKINGS = ("random", "prefix")  # dllm_ais.sft: masked-diffusion SFT masks


def replays_decoder(estimator: str, likelihood_order: str, likelihood_decoder: str, cache: str,
                    editing: bool = False) -> bool:
    """Whether the trajectory estimator scores the rollout decoder's own logits: `likelihood_decoder=rollout` with a
    block cache or token editing (`editing`: rollout.editing_threshold set), along the rollout's commit order. The
    trainer then replays the cached decoder, so the ratio sees the precision only and the fast decoder is the policy
    trained. Without a cache the decoder's logits are the exact model's and the trajectory replay is the same thing,
    but for token editing: only the decoder replay rebuilds the canvases its edits wrote and scores every write."""
    return (estimator == "trajectory" and likelihood_order == "rollout" and likelihood_decoder == "rollout"
            and (cache != "none" or editing))


def editing_estimator_problem(estimator: str) -> str:
    """Why token editing (rollout.editing_threshold) cannot go with `estimator` (a trajectory-type one) unless it
    replays the rollout's decoder: only `replays_decoder` rebuilds the canvases the edits wrote and scores every
    write; the exact replay scores each final token once at its commit step."""
    return (f"rollout.editing_threshold overwrites tokens, and likelihood.estimator={estimator} here replays the exact "
            "decoder, which cannot reproduce the edits: set likelihood.estimator=trajectory with "
            "experimental.likelihood_order=rollout and experimental.likelihood_decoder=rollout, a one-step estimator "
            "(one_step, elbo, spg), or rollout.editing_threshold=null")


def editing_family_problem(model_type: str | None) -> str:
    """Why token editing cannot decode a model of `model_type`, which is not block-causal."""
    return (f"rollout.editing_threshold needs a block-causal family (LLaDA2.x), and model_type {model_type!r} is not "
            "one: set rollout.editing_threshold=null, or use a LLaDA2 model")


def routing_replay_problem(estimator: str, likelihood_order: str, replays_cached_decoder: bool, precision_flow: str,
                           precision: str, gradient_checkpointing: bool, diffusion: bool) -> str | None:
    """Why `experimental.routing_replay` cannot go with these settings (None when it can). The replay has the engine
    route the trainer's forwards on the canvases it sampled from, so only the trajectory replay of the rollout's own
    order, without a block cache, scores those canvases; the one-step and sequence estimators score fresh random
    canvases the engine never routed while sampling."""
    needs = []
    if not diffusion or estimator != "trajectory" or likelihood_order != "rollout":
        needs.append("likelihood.estimator=trajectory with experimental.likelihood_order=rollout (the canvases the "
                     "engine routed while sampling; the one-step estimator's fresh canvas has no rollout routing)")
    if replays_cached_decoder:
        needs.append("experimental.likelihood_decoder=exact or rollout.cache=none (cache-less replays)")
    if precision in BATCH_SCALED_PRECISIONS:
        needs.append(f"a per-row or per-block notch, not rollout.precision={precision} (its activation scale spans the "
                     "batch, so the engine's forward on the trainer's canvases routes otherwise than its sampling did)")
    if precision_flow != "split":
        needs.append("rollout.precision_flow=split (the unified flow's trainer routes by the engine's numerics "
                     "already)")
    if gradient_checkpointing:
        needs.append("gradient_checkpointing=false (its recomputation would route by the trainer's own router)")
    if not needs:
        return None
    return "experimental.routing_replay needs " + "; ".join(needs) + ", or set experimental.routing_replay=false"


def routing_record_problem(replays_cached_decoder: bool, routing_replay: bool, compile: bool | None,
                           gradient_checkpointing: bool, cfg_scale: float) -> str | None:
    """Why `experimental.routing_record` cannot go with these settings (None when it can): the record is forced by
    the trajectory estimator's replay of the cached decoder (`MaskedDiffusionSampler.decoder_logits`), and recorded
    by a Python hook in the eager engine's forwards."""
    needs = []
    if not replays_cached_decoder:
        needs.append("likelihood.estimator=trajectory with experimental.likelihood_decoder=rollout, "
                     "experimental.likelihood_order=rollout and a rollout.cache (the decoder replay, which forces the "
                     "record; the other estimators' canvases were never routed while sampling)")
    if routing_replay:
        needs.append("experimental.routing_replay=false (one routing replay at a time: the record, or the engine's "
                     "recomputation)")
    if compile is not False:
        needs.append("rollout.compile=false (a compiled engine's captured graphs run no recording hook)")
    if gradient_checkpointing:
        needs.append("gradient_checkpointing=false (its recomputation would route by the trainer's own router)")
    if cfg_scale > 0:
        needs.append("rollout.cfg_scale=0 (the record holds the conditional rows only)")
    if not needs:
        return None
    return "experimental.routing_record needs " + "; ".join(needs) + ", or set experimental.routing_record=false"


def block_fraction_problem(block_fraction: float, estimator: str) -> str | None:
    """Why `likelihood_block_fraction` cannot go with `estimator` (None when it can): drawing blocks of the
    denoising trajectory is for the estimators that replay it."""
    if block_fraction == 1 or estimator in TRAJECTORY_ESTIMATORS:
        return None
    return (f"experimental.likelihood_block_fraction={block_fraction} scores a random share of the denoising "
            f"trajectory's blocks, which likelihood.estimator={estimator} does not replay: set likelihood.estimator to "
            f"{' or '.join(TRAJECTORY_ESTIMATORS)}, or experimental.likelihood_block_fraction=1")
# dllm_ais.evaluation: `dllm-ais eval --protocol`: d1's, and each family record's own (models.families; a test checks)
EVAL_PROTOCOLS = ("d1", "dream", "sdar", "llada2")
