"""Where a training run's numbers go: metrics.jsonl and completions.jsonl (main process), the console and the
progress bar, and the experiment trackers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from dllm_ais.config import GRPOConfig
from dllm_ais.metrics import MetricsLog, console_line, eval_line, mismatch_warnings, plot_metrics
from dllm_ais.trackers import log_table, tracker_init_kwargs


class RunReporter:
    """The run's logs (None on other processes than the main one), its progress bar and trackers."""

    def __init__(self, config: GRPOConfig, accelerator, log: MetricsLog | None, completions_log: MetricsLog | None,
                 progress):
        self.config, self.accelerator = config, accelerator
        self.log, self.completions_log, self.progress = log, completions_log, progress
        self.warned: set[str] = set()  # mismatch metrics whose verl warning level was reported

    @classmethod
    def open(cls, config: GRPOConfig, accelerator, step: int, resume_from: Path | None) -> "RunReporter":
        """Open the logs in `output_dir` (a resumed run keeps the records up to `step` from its checkpoint's run),
        start the trackers and a progress bar at `step`."""
        output_dir, log, completions_log = Path(config.output_dir), None, None
        if accelerator.is_main_process:
            resume_step = step if resume_from else None
            previous = resume_from and resume_from.parent
            log = MetricsLog(output_dir, resume_step, previous and previous / "metrics.jsonl")
            if config.log_completions:
                completions_log = MetricsLog(output_dir, resume_step, previous and previous / "completions.jsonl",
                                             name="completions.jsonl")
        if config.report_to:
            accelerator.init_trackers("dllm-ais", config=config.to_dict(),
                                      init_kwargs=tracker_init_kwargs(config.run_name, config.output_dir))
        progress = tqdm(total=config.max_steps, initial=step, desc="GRPO", disable=not accelerator.is_main_process,
                        dynamic_ncols=True)
        return cls(config, accelerator, log, completions_log, progress)

    @property
    def records(self) -> list[dict[str, Any]]:
        return self.log.records if self.log else []

    def report(self, step: int, metrics: dict[str, float], samples: list[dict[str, Any]] | None,
               best: str) -> bool:
        """Every `logging_steps` and at every validation: a metrics.jsonl line, the progress bar, a console line
        (with `best`, the best validation score so far, when scored) and the completion `samples` (completions.jsonl
        and a tracker table); trackers get the metrics every step. A mismatch metric crossing verl's warning level
        is reported once. Returns whether this step was logged (and its samples with it)."""
        logged = step % self.config.logging_steps == 0 or "eval/reward" in metrics
        if self.log is not None:
            if logged:
                self.log.write(metrics)
                self.progress.set_postfix(reward=f"{metrics['reward']:.3f}",
                                          alpha=f"{metrics.get('ais/alpha', 0.0):.2f}")
                tqdm.write(console_line(step, self.config.max_steps, metrics))
            if "eval/reward" in metrics:
                tqdm.write(eval_line(step, metrics, best))
            for key, message in mismatch_warnings(metrics).items():
                if key not in self.warned:
                    self.warned.add(key)
                    tqdm.write(f"warning: step {step}: {message}")
        rows = [{"step": step, **sample} for sample in samples] if logged and samples is not None else None
        for row in rows if rows is not None and self.completions_log is not None else ():
            self.completions_log.write(row)
        if self.config.report_to:
            self.accelerator.log(metrics, step=step)
            if rows:
                log_table(self.accelerator.trackers, "completions", rows, step)
        return logged

    def finish(self, held_out: dict[str, float] | None, closing_line: str | None, final: Path) -> None:
        """The held-out metrics' record and line, the metrics plot and where everything is (main process)."""
        if held_out is not None:
            self.log.write(held_out)
            tqdm.write(closing_line)
        plot = plot_metrics(self.log.records, Path(self.config.output_dir) / "metrics.png")
        tqdm.write(f"metrics: {self.log.path}" + (f" | plot: {plot}" if plot else "") + f" | model: {final}")

    def plot(self) -> None:
        plot_metrics(self.log.records, Path(self.config.output_dir) / "metrics.png")

    def close(self) -> None:
        self.progress.close()
        for jsonl in (self.log, self.completions_log):
            if jsonl is not None:
                jsonl.close()
        if self.config.report_to:
            self.accelerator.end_training()
