"""RLTrainer's side of `export/run_settings.py`: a resume checked against the settings the checkpoint was trained
with, and a continued run's new optimizer values put over the ones transformers restores from the checkpoint."""

from __future__ import annotations

import sys

from verifiers_rl.errors import TrainingError
from verifiers_rl.export.run_settings import (
    Resume,
    decide,
    env_identity,
    optimizer_values,
    run_settings,
    start_over,
    take_new_values,
)


class SettingsResume:
    resume_plan: Resume | None = None

    def run_settings(self) -> dict:
        """This run's settings as a checkpoint records them; the environment as vf-rl's config names it (so the
        plan, made before anything is loaded, and the trainer agree), else as the loaded environment says."""
        config = getattr(self, "run_config", None) or {}
        env = env_identity(config["env"]) if "env" in config else env_identity(env=self.env)
        return run_settings(self.args, self.model_path, env)

    def resume_decision(self, requested=True) -> Resume:
        """What train(resume_from_checkpoint=requested) does in output_dir (run_settings.decide); remembered, so
        the optimizer load and the run record follow it."""
        args = self.args
        self.resume_plan = decide(
            args.output_dir, self.run_settings(), args.max_steps, args.on_settings_change, requested
        )
        return self.resume_plan

    def settled_resume(self, requested):
        """train()'s `resume_from_checkpoint` once the settings are checked: changed settings raise one line, a
        restart removes the old run first (None: start over); returns (resume, finished)."""
        if not requested:
            self.resume_plan = None
            return None, False
        plan = self.resume_decision(requested)
        if plan.stops:
            raise TrainingError(plan.line())
        if plan.kind == "finished":
            if self.is_world_process_zero():
                print(f"verifiers-rl: {plan.line()}", file=sys.stderr, flush=True)
            return None, True
        if plan.kind == "restart":
            if self.is_world_process_zero():
                removed = start_over(self.args.output_dir)
                print(f"verifiers-rl: {plan.line()} ({', '.join(removed)})", file=sys.stderr, flush=True)
            self.accelerator.wait_for_everyone()
            return None, False
        return requested, False

    def _load_optimizer_and_scheduler(self, checkpoint) -> None:
        plan = self.resume_plan
        fresh = None
        if checkpoint and plan is not None and plan.kind == "resume" and plan.changed:
            fresh = optimizer_values(self.optimizer, self.lr_scheduler)  # built from this run's settings
        super()._load_optimizer_and_scheduler(checkpoint)
        if fresh is not None:
            take_new_values(self.optimizer, self.lr_scheduler, fresh)
