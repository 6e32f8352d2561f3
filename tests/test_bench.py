"""`dllm-ais bench NAME`: every benchmark at a tiny shape, its figures printed beside the device and settings."""

import pytest

from dllm_ais.cli import main
from dllm_ais.quantization import PRECISIONS

ROLLOUT = ["bench", "rollout", "--num-prompts", "4", "--batch", "4", "--block-length", "16"]


def test_rollout_benchmark_runs_the_chosen_variants_beside_the_official_algorithm(capsys):
    assert main([*ROLLOUT, "--gen-lengths", "16", "--variants", "dual"]) == 0
    out = capsys.readouterr().out
    rows = [line.split()[0] for line in out.splitlines() if line.endswith("thread(s)]")]
    assert rows == ["official", "dual"] and out.startswith("device: cpu")
    with pytest.raises(SystemExit):
        main([*ROLLOUT, "--variants", "dual,bogus"])
    assert "unknown ['bogus']; choose from official, prefix, dual, dual+refresh" in capsys.readouterr().err


def test_rollout_benchmark_dual_cache_refreshed_every_step_reproduces_the_official_algorithm(capsys):
    """dual+refresh at interval 1 recomputes the cache before every step: the official algorithm's greedy tokens,
    so its paired differences from the official algorithm are exactly zero."""
    assert main([*ROLLOUT, "--gen-lengths", "32", "--variants", "dual,dual+refresh",
                 "--refresh-interval", "1", "64"]) == 0
    rows = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()
            if line.endswith("thread(s)]")}
    assert set(rows) == {"official", "dual", "dual+refresh/1", "dual+refresh/64"}
    agreement = {name: float(row[3]) for name, row in rows.items()}  # share of the official greedy tokens
    assert agreement["dual+refresh/1"] == 1.0 and agreement["dual"] < 1.0
    assert rows["dual+refresh/1"][8:11] == ["+0.0000", "±", "0.0000"]  # reward Δ vs official ± SE, paired
    # Refreshed every 64 steps, past a 16-token block's 16 steps: only at block starts, the plain dual cache.
    assert agreement["dual+refresh/64"] == agreement["dual"]


def test_sampler_benchmark_prints_the_overhead_and_every_precisions_sync(capsys):
    assert main(["bench", "sampler", "--d-model", "32", "--n-layers", "1", "--vocab", "64", "--batch", "2",
                 "--prompt-len", "8", "--gen-length", "16", "--block-length", "8", "--steps", "4", "--repeats", "1",
                 "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "ratio sampler/forwards = " in out and "batch=2 prompt_len=8 gen_length=16" in out
    syncs = [line for line in out.splitlines() if line.startswith("precision=")]
    assert [line.split()[0] for line in syncs] == [f"precision={p}" for p in PRECISIONS]
    assert all("device cpu" in line and "sync / one forward = " in line for line in syncs)
    flows = {line.split()[2]: line for line in out.splitlines() if line.startswith("flows at precision=")}
    assert list(flows) == [f"precision={p}" for p in PRECISIONS]
    ratios = {p: float(flows[f"precision={p}"].split("unified / split = ")[1].split(")")[0]) for p in PRECISIONS}
    assert ratios["bf16"] < 0.7 and all(ratios[p] < ratios["bf16"] for p in PRECISIONS if p != "bf16")  # one model


def test_mismatch_benchmark_is_zero_for_bf16_and_unified_and_positive_for_split_int4(capsys):
    assert main(["bench", "mismatch", "--models", "llada", "--precisions", "bf16,int4", "--prompts", "4"]) == 0
    out = capsys.readouterr().out
    rows = {(line.split("|")[2].strip(), line.split("|")[3].strip()): line.split("|")[4:-1]
            for line in out.splitlines() if line.startswith("| llada")}
    assert out.startswith("device: cpu") and set(rows) == {(p, f) for p in ("bf16", "int4") for f in ("split", "unified")}
    assert float(rows["int4", "split"][0]) > float(rows["bf16", "split"][0]) and float(rows["int4", "split"][0]) > 0
    assert float(rows["int4", "unified"][0]) == float(rows["bf16", "unified"][0]) == 0  # one flow: no mismatch


def test_mismatch_benchmark_scores_the_ladder_and_the_fp8_kv_cache_on_the_trajectory_canvases(capsys):
    assert main(["bench", "mismatch", "--models", "llada,qwen3", "--precisions", "bf16,mxfp4", "--prompts", "4",
                 "--flows", "split"]) == 0
    out = capsys.readouterr().out
    rows = {line.split("|")[3].strip(): [float(cell) for cell in line.split("|")[5:-1]] for line in out.splitlines()
            if line.startswith("| trajectory |")}
    assert set(rows) == {"bf16", "mxfp4", "bf16 + fp8 KV cache (dual)"}  # LLaDA only: Qwen3 has no trajectory
    assert rows["bf16"][:5] == [0.0, 0.0, 1.0, 0.0, 1.0]  # k3, max |Δ|, token ESS, |log ρ_seq|, sequence ESS
    for notch in ("mxfp4", "bf16 + fp8 KV cache (dual)"):
        assert rows[notch][0] > 0 and rows[notch][2] < 1 and rows[notch][4] < 1, notch


def test_precision_benchmark_runs_every_chosen_notch_at_the_tiny_shape_without_cuda(capsys):
    assert main(["bench", "precision", "--device", "cpu", "--precisions", "bf16,fp8_tensor,int4_g128", "--batch", "2",
                 "--prompt-length", "8", "--gen-length", "16", "--block-length", "8", "--steps", "4",
                 "--step-batch", "4", "--micro-batch", "2"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("no CUDA device") and "model: LLaDAModelLM hidden=64 layers=2" in out
    rollouts = [line for line in out.splitlines() if " tokens/s " in line]
    assert [line.split()[:6] for line in rollouts] == [  # the eager bf16 engine also with the FP8-stored cache
        ["bf16", "eager", "batch", "2", "cache", cache] for cache in ("none", "dual", "dual+fp8")] + [
        [precision, "eager", "batch", "2", "cache", cache] for precision in ("fp8_tensor", "int4_g128")
        for cache in ("none", "dual")]
    assert all(float(line.split()[7]) > 0 and "eager, kernels: " in line and "torchao 0.18.0" in line
               for line in rollouts)
    assert "(reference)" in rollouts[0] and "(× bf16 " in rollouts[3]
    assert "kernels: emulated: torchao Float8Tensor" in rollouts[3]
    steps = [line for line in out.splitlines() if line.startswith("train step")]
    assert [line.split()[2] for line in steps] == ["one_step", "trajectory"]
    assert all("peak memory n/a on cpu" in line for line in steps)
    whole = [line.split(" | ") for line in out.splitlines() if line.startswith("step ")]
    assert [line[0].split()[1:3] for line in whole] == [["bf16", "eager"], ["fp8", "eager"], ["fp8", "unified"]]
    assert all([part.split()[0] for part in line[1:7]] == ["sync", "rollout", "logp_rollout", "logp_old", "train",
                                                            "total"] for line in whole[:2])
    # one model: no ℓ_old pass, and no mismatch between the engine's log-probs and the trainer's
    assert [part.split()[0] for part in whole[2][1:6]] == ["sync", "rollout", "logp_rollout", "train", "total"]
    assert "one-step k3 0.00e+00" in whole[2]


def test_precision_benchmark_runs_dreams_shape(capsys):
    """`--shape dream-7b` benches a Dream (shifted logits, Qwen2.5's layout) through the same rollouts and step; on
    CPU at a tiny Dream shape."""
    assert main(["bench", "precision", "--device", "cpu", "--shape", "dream-7b", "--precisions", "bf16,fp8",
                 "--batch", "2", "--prompt-length", "8", "--gen-length", "16", "--block-length", "8", "--steps", "4",
                 "--parts", "rollouts,step", "--step-batch", "4", "--micro-batch", "2"]) == 0
    out = capsys.readouterr().out
    assert "model: DreamModel hidden=64 layers=2" in out
    rollouts = [line for line in out.splitlines() if " tokens/s " in line]
    assert {line.split()[0] for line in rollouts} == {"bf16", "fp8"}
    assert all(float(line.split()[7]) > 0 for line in rollouts)
    assert [line.split(" | ")[0].split()[1:3] for line in out.splitlines() if line.startswith("step ")] == [
        ["bf16", "eager"], ["fp8", "eager"], ["fp8", "unified"]]


def test_precision_benchmark_runs_llada2_minis_shape_tiny_with_fp8_experts(capsys):
    """`--shape llada2-mini` benches a LLaDA2 MoE (block-causal, in blocks of --block-length; LoRA on its experts too)
    through the same rollouts and step, its FP8 engine quantizing the experts; on CPU at a tiny LLaDA2 shape."""
    assert main(["bench", "precision", "--device", "cpu", "--shape", "llada2-mini", "--precisions", "bf16,fp8",
                 "--batch", "2", "--prompt-length", "8", "--gen-length", "16", "--block-length", "8", "--steps", "4",
                 "--parts", "rollouts,step", "--step-batch", "4", "--micro-batch", "2"]) == 0
    out = capsys.readouterr().out
    assert "model: LLaDA2MoeModelLM hidden=64 layers=2" in out and " failed: " not in out
    rollouts = [line for line in out.splitlines() if " tokens/s " in line]
    assert {(line.split()[0], line.split()[5]) for line in rollouts} == {
        (precision, cache) for precision in ("bf16", "fp8") for cache in ("none", "dual")}
    assert all(float(line.split()[7]) > 0 for line in rollouts)
    steps = [line.split(" | ")[0].split()[1:3] for line in out.splitlines() if line.startswith("step ")]
    assert steps == [["bf16", "eager"], ["fp8", "eager"]]


def test_precision_benchmark_reports_a_failing_notch_in_one_line_and_runs_the_others(capsys, monkeypatch):
    import dllm_ais.engine

    real_engine = dllm_ais.engine.RolloutEngine

    def engine(trainer, precision, **settings):
        if precision == "int8":
            raise RuntimeError("no int8 kernel here\nsecond line")
        return real_engine(trainer, precision=precision, **settings)

    monkeypatch.setattr(dllm_ais.engine, "RolloutEngine", engine)
    assert main(["bench", "precision", "--device", "cpu", "--precisions", "int8,int4", "--batch", "2",
                 "--prompt-length", "8", "--gen-length", "16", "--block-length", "8", "--steps", "4",
                 "--parts", "rollouts"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith(("int8", "int4"))]
    assert lines[0].startswith("int8") and "eager    failed: RuntimeError: no int8 kernel here |" in lines[0]
    assert [line.split()[:6] for line in lines[1:]] == [["int4", "eager", "batch", "2", "cache", cache]
                                                        for cache in ("none", "dual")]


@pytest.mark.slow  # four fresh processes
def test_memory_benchmark_measures_each_estimator_in_its_own_process(capsys):
    assert main(["bench", "memory", "--gen-length", "16", "--block-length", "16", "--batch", "2",
                 "--prompt-length", "8", "--steps", "4", "--segments", "2"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.startswith(("one_step", "trajectory", "step_merge"))]
    assert [(row[0], row[-4]) for row in rows] == [("one_step", "4"), ("trajectory", "4"), ("step_merge", "4"),
                                                   ("trajectory", "16")]
    assert [int(row[-3]) for row in rows] == [1, 4, 2, 16]  # forwards per scoring pass
    assert float(rows[0][-1]) == 1.0 and all(float(row[-2]) > 0 for row in rows)


def test_step_benchmark_prints_the_rollout_and_correction_shares(capsys):
    assert main(["bench", "step", "--part", "correction", "--batch", "4", "--gen-length", "8", "--repeats", "1",
                 "--warmup", "0"]) == 0
    out = capsys.readouterr().out
    assert "[step shares] device=cpu" in out and "completions=4 gen_length=8" in out
    shares = [float(line.split("median ")[1].split("%")[0]) for line in out.splitlines() if "median" in line]
    assert len(shares) == 2 and all(0 < share < 100 for share in shares)  # rollout, correction


@pytest.mark.slow  # two fresh processes
def test_step_benchmark_log_prob_memory_pass_computes_the_naive_log_probs(capsys):
    assert main(["bench", "step", "--part", "memory", "--vocab", "512", "--sequences", "2", "--prompt-length", "8",
                 "--completion-length", "16"]) == 0
    out = capsys.readouterr().out
    assert "[log-prob memory] device=cpu" in out and "vocab=512 sequences=2 prompt=8 completion=16" in out
    assert "ratio ours/naive: " in out  # at this size: "n/a", the growth is below the process's earlier peak
    naive, ours = (float(word) for word in out.split("sum of log-probs naive ")[1].split(" vs ours "))
    assert ours == pytest.approx(naive, rel=1e-4)  # the chunked one-step pass computes the naive log-probs
