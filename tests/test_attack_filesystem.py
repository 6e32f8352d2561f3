"""Attacks on what dllm-ais removes or replaces on disk (issue 47): no removal ever follows a symbolic link, export
and sft never replace a run's checkpoint, its final model or their own source, a resume from an earlier checkpoint
keeps the branch it leaves (and never resumes it later), and a damaged newest checkpoint is kept aside while the
resumed run goes on through its step."""

import json
import os
import shutil
from pathlib import Path

import pytest

from dllm_ais.cli import main
from dllm_ais.config import ConfigError
from dllm_ais.run_dir import (MARKER, OutputExistsError, atomic_directory, check_destination, clean_leftovers,
                              discard_directory, remove_directory, run_checkpoints)
from dllm_ais.run_lock import release_run_lock
from test_trainer import make_trainer


def snapshot(root):
    """Every file under `root` (links not followed) with its bytes: what must stay untouched."""
    return {os.path.relpath(os.path.join(directory, name), root): Path(directory, name).read_bytes()
            for directory, _, names in os.walk(root) for name in names}


def published(tmp_path, source):
    """The user's own directory `pub`: a copy of the dllm-ais directory `source` (its marker included, so that it
    looks like ours through a link) plus a file dllm-ais never wrote."""
    pub = tmp_path / "pub"
    shutil.copytree(source, pub)
    (pub / "mine.txt").write_text("precious")
    return pub


def link(path, target):
    """Replace `path` by a symbolic link to `target` (the attack)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    path.symlink_to(target, target_is_directory=True)
    return path


def refused_in_one_line(argv, capsys, *expected):
    """`dllm-ais ARGV` is refused in one line holding every `expected` text."""
    capsys.readouterr()
    assert main(argv) == 2, argv
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and all(text in error for text in expected), error


def finished_run(tokenizer, run):
    """A real tiny run in `run`: 2 steps, a checkpoint after each, then final/."""
    make_trainer(tokenizer, run, max_steps=2, save_steps=1).train()
    return run


@pytest.mark.parametrize("name", ["final", "checkpoint-2"])
def test_a_linked_run_output_is_refused_and_its_target_untouched(tokenizer, tmp_path, capsys, name):
    """`mv R/final pub; ln -s $PWD/pub R/final`, then `train --overwrite_output_dir=true`, a resume, or the link
    planted while the run writes that directory: each is refused in one line, and pub keeps every file."""
    run = finished_run(tokenizer, tmp_path / "R")
    pub = published(tmp_path, run / name)
    before = snapshot(pub)
    link(run / name, pub)
    refused_in_one_line(["train", f"--output_dir={run}", "--overwrite_output_dir=true"], capsys,
                        f"{run / name} is a symbolic link")
    with pytest.raises(ConfigError, match="is a symbolic link"):
        make_trainer(tokenizer, run, max_steps=3, save_steps=1, resume_from_checkpoint=True)
    assert snapshot(pub) == before

    (run / name).unlink()
    trainer = make_trainer(tokenizer, run, max_steps=2, save_steps=1, overwrite_output_dir=True)
    link(run / name, pub)  # planted after the run's checks, before it writes that directory
    with pytest.raises(OutputExistsError, match="is a symbolic link"):
        trainer.train()
    assert snapshot(pub) == before and (run / name).is_symlink()
    release_run_lock(run)


def test_export_and_sft_overwrite_never_replace_a_runs_checkpoint_final_or_the_source(tokenizer, tmp_path, capsys):
    run = finished_run(tokenizer, tmp_path / "R")
    with atomic_directory(tmp_path / "export") as staging:  # an earlier export (what `dllm-ais export` writes)
        (staging / "model.safetensors").write_bytes(b"weights")
    before = snapshot(tmp_path)
    checkpoint, final, export = run / "checkpoint-2", run / "final", tmp_path / "export"
    refused_in_one_line(["export", str(final), str(checkpoint), "--overwrite"], capsys,
                        f"{checkpoint} is a training run's checkpoint-N")
    refused_in_one_line(["export", str(checkpoint), str(final), "--overwrite"], capsys,
                        f"{final} is a training run's final model")
    for source in (final, export):
        refused_in_one_line(["export", str(source), str(source), "--overwrite"], capsys, "is never replaced")
    refused_in_one_line(["export", str(final / "adapter_config.json"), str(final), "--overwrite"], capsys,
                        "is never replaced")
    for destination, kind in ((checkpoint, "checkpoint-N"), (final, "final model")):
        refused_in_one_line(["sft", "--output_dir", str(destination), "--overwrite", "--steps", "1"], capsys,
                            f"{destination} is a training run's {kind}")
    refused_in_one_line(["sft", "--model", str(export), "--output_dir", str(export), "--overwrite", "--steps", "1"],
                        capsys, "is never replaced")
    assert snapshot(tmp_path) == before


@pytest.mark.slow
def test_a_resume_from_an_earlier_checkpoint_keeps_the_branch_it_leaves_and_never_resumes_it(tokenizer, tmp_path,
                                                                                               capsys):
    """A 6-step run saving every 2 steps, resumed from checkpoint-2 up to step 4, then `resume_from_checkpoint=true`
    up to step 6: it continues the new branch (its checkpoint-4), not the stale checkpoint-6; the branch left
    behind — its checkpoints, final/ and every metrics line — is kept in one directory, named in one line."""
    run = tmp_path / "R"
    make_trainer(tokenizer, run, max_steps=6, save_steps=2).train()
    first = snapshot(run)
    capsys.readouterr()
    branch = make_trainer(tokenizer, run, max_steps=4, save_steps=2, save_total_limit=2,
                          resume_from_checkpoint=str(run / "checkpoint-2"))
    warning = capsys.readouterr().err
    [aside] = run.glob("abandoned-after-step-2-*")
    assert [line for line in warning.splitlines() if str(aside) in line] == [
        f"warning: resuming from {run / 'checkpoint-2'} leaves the later steps of this run behind: checkpoint-4, "
        f"checkpoint-6, final and the run's logs are kept in {aside} (never resumed from here; resume from one of "
        "them into another --output_dir to go on with that branch)"]
    branch.train()
    kept = snapshot(aside)
    for name in ("checkpoint-4", "checkpoint-6", "final"):  # moved whole, byte for byte
        assert {k: v for k, v in kept.items() if k.startswith(name + "/")} == \
               {k: v for k, v in first.items() if k.startswith(name + "/")}
    assert kept["metrics.jsonl"] == first["metrics.jsonl"]  # steps 3-6 of the branch left behind, kept
    assert [json.loads(line)["step"] for line in kept["metrics.jsonl"].splitlines() if b'"loss"' in line] == \
        [1, 2, 3, 4, 5, 6]

    resumed = make_trainer(tokenizer, run, max_steps=6, save_steps=2, save_total_limit=2, resume_from_checkpoint=True)
    assert resumed.resume_from == run / "checkpoint-4" and resumed.global_step == 4
    resumed.train()
    assert [path.name for _, path in run_checkpoints(run)] == ["checkpoint-4", "checkpoint-6"]
    assert snapshot(aside) == kept  # never pruned, never replaced
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
    assert steps == [1, 2, 3, 4, 5, 6]


def test_a_damaged_newest_checkpoint_is_kept_aside_and_the_resumed_run_goes_on(tokenizer, tmp_path, capsys):
    """One flipped byte in checkpoint-3's marker: the resume falls back to checkpoint-2 and trains through step 3
    (writing a new checkpoint-3) to the end; the damaged one is kept, byte for byte, and named."""
    run = tmp_path / "R"
    make_trainer(tokenizer, run, max_steps=3, save_steps=1).train()
    marker = bytearray((run / "checkpoint-3" / MARKER).read_bytes())
    marker[1] ^= 0x20
    (run / "checkpoint-3" / MARKER).write_bytes(bytes(marker))
    damaged = snapshot(run / "checkpoint-3")
    capsys.readouterr()
    resumed = make_trainer(tokenizer, run, max_steps=4, save_steps=1, resume_from_checkpoint=True)
    assert resumed.resume_from == run / "checkpoint-2"
    assert resumed.train().steps == 4
    warning = capsys.readouterr().err
    [aside] = run.glob("abandoned-after-step-2-*")
    assert f"skipped {run / 'checkpoint-3'}: its marker" in warning
    assert f"behind: checkpoint-3, final and the run's logs are kept in {aside}" in warning
    assert snapshot(aside / "checkpoint-3") == damaged
    assert [path.name for _, path in run_checkpoints(run)] == [f"checkpoint-{step}" for step in (1, 2, 3, 4)]


@pytest.mark.slow
def test_no_removal_follows_a_link(tokenizer, tmp_path, capsys):
    """A symbolic link planted at every path dllm-ais removes or replaces — leftovers `.tmp-`/`.old-`/`.trash-`,
    an export's or an SFT model's destination, anywhere inside a checkpoint that `save_total_limit` prunes or that
    `--overwrite_output_dir` replaces, and the directories handed to the one removal helper — leaves its target
    untouched: a link at the top is refused or left alone, a link inside is unlinked, never followed."""
    run = finished_run(tokenizer, tmp_path / "R")
    pub = published(tmp_path, run / "final")  # carries dllm-ais' marker: it looks like ours through a link
    before = snapshot(pub)
    leftovers = [link(run / name, pub) for name in (".tmp-final-0123abcd", ".old-final", ".trash-final-0123abcd")]
    clean_leftovers(run)
    assert all(path.is_symlink() for path in leftovers)
    for path in leftovers:
        path.unlink()
    for destination in (tmp_path / "exported", tmp_path / "sft"):
        link(destination, pub)
    refused_in_one_line(["export", str(run / "final"), str(tmp_path / "exported"), "--overwrite"], capsys,
                        "is a symbolic link")
    refused_in_one_line(["sft", "--output_dir", str(tmp_path / "sft"), "--overwrite", "--steps", "1"], capsys,
                        "is a symbolic link")
    for remove in (remove_directory, discard_directory):
        with pytest.raises(OutputExistsError, match="is a symbolic link"):
            remove(tmp_path / "exported")
    assert snapshot(pub) == before

    (run / "checkpoint-1" / "deep").mkdir()
    for inside in (run / "checkpoint-1" / "pub", run / "checkpoint-1" / "deep" / "pub", run / "final" / "pub"):
        link(inside, pub)
    resumed = make_trainer(tokenizer, run, max_steps=4, save_steps=1, save_total_limit=1, resume_from_checkpoint=True)
    link(run / "checkpoint-2", pub)  # swapped for a link once resumed from: the pruning passes it by
    resumed.train()
    assert [path.name for _, path in run_checkpoints(run)] == ["checkpoint-4"]  # checkpoint-1 and -3 pruned
    assert (run / "checkpoint-2").is_symlink() and not (run / "final" / "pub").exists()  # final/ replaced
    (run / "checkpoint-2").unlink()
    (run / "checkpoint-4" / "pub").symlink_to(pub)
    make_trainer(tokenizer, run, max_steps=1, overwrite_output_dir=True).train()  # replaces checkpoint-4 and final/
    assert snapshot(pub) == before


def test_directories_written_before_kinds_were_recorded_keep_their_kind(tmp_path):
    """Markers of older versions carry no `kind`: a run's final/ or checkpoint is still never replaced by an export
    or an SFT model (a resumed run still replaces its own), and an older export still is."""
    def older(directory, **fields):
        directory.mkdir()
        (directory / MARKER).write_text(json.dumps({"written_by": "dllm-ais", **fields}))
        (directory / "model.safetensors").write_bytes(b"weights")
        return directory

    run = older(tmp_path / "R", run_directory=True)
    final, checkpoint = older(run / "final", pid=1), older(run / "checkpoint-3", run="abc", step=3)
    for directory, kind in ((final, "final model"), (checkpoint, "checkpoint-N"), (run, "output_dir of a training")):
        with pytest.raises(OutputExistsError, match=kind):
            check_destination(directory, overwrite=True)
    check_destination(final, overwrite=True, kind="final")
    check_destination(checkpoint, overwrite=True, kind="checkpoint")
    check_destination(older(tmp_path / "export", pid=1), overwrite=True)


# ------------------------------------------------------------------------------------------ issue 62: writes and links
RUN_FILE_NAMES = ("config.yaml", "metrics.jsonl", "completions.jsonl", "metrics.png", "best_checkpoint.json",
                  "held_out.json", MARKER)


def victims(tmp_path, names):
    """A user's file per name, each holding its own precious text: what a link planted in a run points at."""
    folder = tmp_path / "victims"
    folder.mkdir(exist_ok=True)
    for name in names:
        (folder / name.lstrip(".")).write_text(f"precious {name}\n")
    return {name: folder / name.lstrip(".") for name in names}


def untouched(targets):
    return all(path.read_text() == f"precious {name}\n" for name, path in targets.items())


def observed_run(tokenizer, run, **overrides):
    """A tiny run that scores every step, saves a checkpoint after each and logs its completions."""
    return make_trainer(tokenizer, run, max_steps=3, save_steps=1, eval_steps=1, eval_size=4, log_completions=True,
                        **overrides)


@pytest.mark.parametrize("name", RUN_FILE_NAMES)
def test_a_run_file_swapped_for_a_link_during_the_run_is_never_written_through(tokenizer, tmp_path, monkeypatch,
                                                                               name):
    """The attack of issue 62 (`ln -sf ../../notes.txt outputs/race/metrics.png` once checkpoint-2 exists), for each
    of the run's files: the link's target keeps its bytes. The run either refuses in one line naming the link
    (a file it writes again), or finishes writing its log through the descriptor it holds (metrics.jsonl,
    completions.jsonl), never through the link."""
    from dllm_ais.checkpoint import Checkpointer

    run = tmp_path / "R"
    targets = victims(tmp_path, [name])
    save = Checkpointer.save_checkpoint

    def save_then_swap(self, state, validation=None):
        directory = save(self, state, validation)
        if state.global_step == 2:
            (run / name).unlink(missing_ok=True)
            (run / name).symlink_to(targets[name])
        return directory

    monkeypatch.setattr(Checkpointer, "save_checkpoint", save_then_swap)
    trainer = observed_run(tokenizer, run)
    try:
        trainer.train()
    except FileExistsError as refusal:
        assert f"{run / name} is a symbolic link" in str(refusal) and len(str(refusal).splitlines()) == 1
    finally:
        release_run_lock(run)
    assert untouched(targets) and (run / name).is_symlink()
    assert not [entry.name for entry in run.iterdir() if entry.name.startswith(".tmp-")]  # no staged file left


@pytest.mark.slow
def test_planted_staging_files_are_never_written_through(tokenizer, tmp_path):
    """The attack: `.tmp-held_out.json` (and every other fixed name a write used to stage at) planted as a link in
    a run folder before the run finishes. The run stages under fresh names of its own: every target keeps its
    bytes, every file of the run is a regular file, and a staged file left by an interrupted write is cleaned up
    while a link of that shape is left alone."""
    run = tmp_path / "R"
    finished_run(tokenizer, run)
    targets = victims(tmp_path, RUN_FILE_NAMES)
    for name, target in targets.items():
        (run / f".tmp-{name}").symlink_to(target)
    left = run / ".tmp-metrics.png-0123456789abcdef"  # what a write killed before its rename leaves
    left.write_bytes(b"half a plot")
    guessed = run / ".tmp-held_out.json-fedcba9876543210"
    guessed.symlink_to(targets["held_out.json"])
    observed_run(tokenizer, run, overwrite_output_dir=True).train()
    assert untouched(targets) and not left.exists() and guessed.is_symlink()
    for name in RUN_FILE_NAMES:
        assert (run / name).is_file() and not (run / name).is_symlink(), name
    assert json.loads((run / "held_out.json").read_text())["written_by"] == "dllm-ais"


def write_sites():
    """Every write of a file dllm-ais makes outside a staging directory, as (file name, the write into `folder`)."""
    import torch

    from dllm_ais.checkpoint_choice import write_held_out
    from dllm_ais.config import GRPOConfig, save_config
    from dllm_ais.evaluation import EvalResult
    from dllm_ais.metrics import MetricsLog, plot_metrics
    from dllm_ais.run_lock import hold_run_lock
    from dllm_ais.safe_files import copy_regular_file, write_file

    values = torch.full((2,), 0.5)
    result = EvalResult(values, values.clone(), {"reward": values})
    return {
        "held_out.json": lambda folder: write_held_out(GRPOConfig(output_dir=str(folder)), None, result, result),
        "config.yaml": lambda folder: save_config(GRPOConfig(), folder / "config.yaml"),
        "metrics.png": lambda folder: plot_metrics([{"step": 1, "reward": 0.5}], folder / "metrics.png"),
        "metrics.jsonl": lambda folder: MetricsLog(folder).close(),
        "comparison.md": lambda folder: write_file(folder / "comparison.md", "| arm |\n"),
        "copy.jsonl": lambda folder: copy_regular_file(__file__, folder / "copy.jsonl"),
        ".dllm-ais.lock": lambda folder: (hold_run_lock(folder), release_run_lock(folder)),
        MARKER: lambda folder: write_file(folder / MARKER, "{}"),  # a run's, a staging directory's, a manifest
    }


@pytest.mark.parametrize("site", list(write_sites()))
def test_each_write_site_stages_under_a_fresh_name_and_refuses_a_link_in_place(tmp_path, site):
    """At each write site: a link planted at the name the write used to stage at is left alone (its target keeps
    its bytes, the file is written); a link planted at the destination itself is refused in one line naming it
    (the lock's record, which only names the holder, replaces it instead), its target untouched."""
    write = write_sites()[site]
    folder = tmp_path / "folder"
    folder.mkdir()
    targets = victims(tmp_path, ["staging", "destination"])
    destination = folder / site
    (folder / f".tmp-{site}").symlink_to(targets["staging"])
    write(folder)
    assert destination.is_file() and not destination.is_symlink() and untouched(targets)
    destination.unlink()
    destination.symlink_to(targets["destination"])
    if site == ".dllm-ais.lock":
        write(folder)
        assert not destination.is_symlink()
    else:
        with pytest.raises(FileExistsError, match="is a symbolic link"):
            write(folder)
        assert destination.is_symlink()
    assert untouched(targets)


def test_a_linked_output_dir_is_followed_once_and_named(tokenizer, tmp_path, capsys):
    """A run folder kept on another disk through a link (`ln -s /scratch/R runs/R`): train, `--overwrite_output_dir`
    and a resume all write to the link's target — resolved once and named in one line — never anywhere else; the
    link stays a link. Links inside the run stay refused (`test_a_linked_run_output_is_refused_...`)."""
    target = tmp_path / "scratch" / "R"
    named = tmp_path / "runs" / "R"
    named.parent.mkdir()
    named.symlink_to(target, target_is_directory=True)
    line = f"output_dir {named} is a link: writing to its target {target}"
    for overrides in ({}, {"overwrite_output_dir": True}):
        trainer = make_trainer(tokenizer, named, max_steps=2, save_steps=1, **overrides)
        assert line in capsys.readouterr().err and trainer.config.output_dir == str(target)
        trainer.train()
        assert named.is_symlink() and (target / "final").is_dir() and (target / "checkpoint-2").is_dir()
    resumed = make_trainer(tokenizer, named, max_steps=3, save_steps=1, resume_from_checkpoint=True)
    assert line in capsys.readouterr().err and resumed.resume_from == target / "checkpoint-2"
    assert resumed.train().steps == 3
    assert [path.name for _, path in run_checkpoints(target)] == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]
    assert sorted(p.name for p in named.parent.iterdir()) == ["R"] and named.is_symlink()


def test_an_export_or_sft_into_a_runs_folder_is_refused(tokenizer, tmp_path, capsys):
    """`dllm-ais export p/final p/final/sub`, into a run folder or a checkpoint, and `sft` into a run's final/: each
    is refused in one line before anything loads, and the run keeps every file."""
    run = finished_run(tokenizer, tmp_path / "R")
    before = snapshot(run)
    final, checkpoint = run / "final", run / "checkpoint-1"
    refused_in_one_line(["export", str(final), str(final / "sub")], capsys, "lies inside the command's source")
    refused_in_one_line(["export", str(final), str(run / "exported")], capsys,
                        f"{run / 'exported'} lies inside {run}, the output_dir of a training run")
    refused_in_one_line(["export", str(final), str(checkpoint / "sub")], capsys, "a training run's checkpoint-N")
    refused_in_one_line(["export", str(checkpoint), str(final / "sub")], capsys, "a training run's final model")
    refused_in_one_line(["sft", "--output_dir", str(final / "sft"), "--steps", "1"], capsys,
                        "a training run's final model")
    assert snapshot(run) == before
