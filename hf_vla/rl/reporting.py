"""What `RLTrainer` reports: the rollout metrics of each update (success, return and length per task, throughput,
KL, clipping), the held-out evaluation with the deterministic sampler the policy is deployed with, and the model
card's RL summary. A mixin of `RLTrainer`."""

from __future__ import annotations

import math
import time

from hf_vla.rl.config import EVAL_SEED


class RLReporting:
    # ---- metrics ---------------------------------------------------------------------------------------------------
    def _metric(self, name: str, value: float) -> None:
        self._rl_metrics.setdefault(name, []).append(float(value))

    def _log_rollouts(self, episodes: dict, rows: list, transitions: list, used: list, seconds: float, planned: int):
        from accelerate.utils import gather_object

        mine = (rows, (len(transitions), len(used), self.engine.discarded))
        both = gather_object([mine]) if self.accelerator.num_processes > 1 else [mine]
        gathered, counts = [b[0] for b in both], [b[1] for b in both]
        per_task: dict = {}
        for rank_rows in gathered:
            for task, successes, returns, steps in rank_rows:
                entry = per_task.setdefault(task, ([], [], []))
                entry[0].extend(successes), entry[1].extend(returns), entry[2].extend(steps)
        all_success = [s for v in per_task.values() for s in v[0]]
        self._episodes_total += len(all_success)
        for task, (successes, returns, steps) in per_task.items():
            if task:
                self._metric(f"rollout/{task}/success", sum(successes) / len(successes))
                self._metric(f"rollout/{task}/return", sum(returns) / len(returns))
                self._metric(f"rollout/{task}/episode_length", sum(steps) / len(steps))
        self._metric("rollout/success", sum(all_success) / max(1, len(all_success)))
        self._metric("rollout/return", sum(r for v in per_task.values() for r in v[1]) / max(1, len(all_success)))
        self._metric("rollout/episode_length", sum(s for v in per_task.values() for s in v[2]) / max(1, len(all_success)))
        self._metric("rollout/episodes_per_s", len(all_success) / max(seconds, 1e-9) / max(1, len(gathered)))
        self._metric("rollout/episodes", self._episodes_total)
        self._metric("rollout/decisions", sum(c[0] for c in counts))
        self._metric("rollout/decisions_used", sum(c[1] for c in counts))
        self._metric("rollout/discarded_episodes", sum(c[2] for c in counts))
        # the Gaussian steps' std and entropy per action element, over this rank's decisions (fixed by the noise level
        # under Flow-SDE, the task's where it has its own; no entropy at level 0)
        stds = [s for level in self._levels(transitions) or [self.sde.noise_level] for s in self.sde.stds(level)]
        self._metric("noise_std", sum(stds) / len(stds))
        if min(stds) > 0:
            self._metric("entropy", sum(0.5 * math.log(2 * math.pi * math.e * s * s) for s in stds) / len(stds))

    def log(self, logs: dict, start_time: float | None = None) -> None:
        # TRL's way: the metrics gathered since the last log, averaged, beside the Trainer's.
        if "loss" in logs or "train_loss" in logs:
            for name, values in self._rl_metrics.items():
                if values:
                    logs[name] = values[-1] if name.startswith("rollout/episodes") else sum(values) / len(values)
            self._rl_metrics = {}
        return super().log(logs, start_time)

    # ---- held-out evaluation ---------------------------------------------------------------------------------------
    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict:
        """Held-out success: `eval_episodes` per task on seeds from 10,000 (never rolled out), deterministic sampling
        as deployed; the ranks share the seeds. Logged as `eval_success` and `eval_<task>/success`."""
        from accelerate.utils import gather_object

        args = self.args
        started = time.perf_counter()
        model = self.accelerator.unwrap_model(self.model)
        was_training = model.training
        seeds = {task: [EVAL_SEED + i for i in range(args.eval_episodes)][args.process_index::args.world_size]
                 for task in self.rl_settings["tasks"]}
        import contextlib

        try:  # with EMA, the averaged weights are what is evaluated (and saved), as in SFT
            with contextlib.nullcontext() if self._ema is None else self._ema.swapped():
                episodes, _ = self.engine.run(self._policy(stochastic=False), seeds, desc="held-out evaluation",
                                              progress=self._shows_progress())
        finally:
            model.train(was_training)
        outcome = {task: [e.success for e in items if not e.discarded] for task, items in episodes.items()}
        if self.accelerator.num_processes > 1:
            merged: dict = {}
            for part in gather_object([outcome]):
                for task, values in part.items():
                    merged.setdefault(task, []).extend(values)
            outcome = merged
        metrics = {}
        for task, values in outcome.items():
            if task:
                metrics[f"{metric_key_prefix}_{task}/success"] = sum(values) / max(1, len(values))
        rates = [sum(v) / max(1, len(v)) for v in outcome.values()]
        metrics[f"{metric_key_prefix}_success"] = sum(rates) / max(1, len(rates))
        metrics[f"{metric_key_prefix}_episodes"] = sum(len(v) for v in outcome.values())
        metrics[f"{metric_key_prefix}_runtime"] = round(time.perf_counter() - started, 2)
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics

    # ---- the model card --------------------------------------------------------------------------------------------
    def rl_summary(self) -> dict:
        """Start checkpoint, method, budget and held-out success before -> after (and best), from the log history."""
        evals = [(int(e["step"]), e["eval_success"]) for e in self.state.log_history if "eval_success" in e]
        args = self.args
        critic = f" (critic on the VLM prefix, GAE gamma {args.gamma:g} lambda {args.lam:g})" \
            if args.algorithm == "ppo" else ""
        return {
            "start": args.model_name_or_path, "env": self.rl_settings["env"],
            "tasks": [t for t in self.rl_settings["tasks"] if t],
            "method": (f"filtered behaviour cloning (flow matching on the rollouts' "
                       f"{'successful' if args.reward == 'success' else 'above-group-mean'} episodes; rollouts with "
                       f"{args.noise_schedule} noise, level {self._level_text()}, {self.sde.num_steps} denoising "
                       "steps)"
                       if args.algorithm == "filtered_bc" else
                       f"{args.algorithm.upper()}{critic} on Flow-SDE likelihoods ({args.noise_schedule} noise, "
                       f"level {self._level_text()}, "
                       f"{self.sde.num_steps} denoising steps), clip [{1 - args.epsilon:g}, {1 + args.epsilon_high:g}], "
                       f"beta {args.beta:g}, reward {args.reward}")
                      + (f"; plus supervised training's loss (weight {args.bc_coef:g}) on the expert data "
                         f"{', '.join(d['name'] for d in args.bc_datasets)}" if args.bc_datasets else ""),
            "updates": self.state.global_step, "episodes": self._episodes_total,
            "max_steps": args.max_steps, "max_train_minutes": args.max_train_minutes, "stopped_by": self.stopped_by,
            # the whole train() call, held-out evaluations included
            "minutes": round(sum(e.get("train_runtime", 0) for e in self.state.log_history) / 60, 1),
            "eval_episodes": args.eval_episodes,
            "before": evals[0][1] if evals and evals[0][0] == 0 else None,
            "after": evals[-1][1] if evals else None,
            "best": (self.state.best_metric, self.state.best_model_checkpoint),
        }

    def create_model_card(self, model_name: str | None = None, base_model: str | None = None, **kwargs):
        from hf_vla.hub.card import render_model_card

        if not self.is_world_process_zero():
            return None
        summary = self.rl_summary()
        # the arguments that bound the run: a time-budgeted run's max_steps is only a ceiling
        card = render_model_card(self, model_name=model_name, base_model=base_model,
                                 extra_args={"max_train_minutes": self.args.max_train_minutes}
                                 if self.args.max_train_minutes is not None else None)
        stopped = f"stopped by {summary['stopped_by']}" if summary["stopped_by"] else f"max_steps={summary['max_steps']}"

        before = "–" if summary["before"] is None else f"{100 * summary['before']:.1f}%"
        after = "–" if summary["after"] is None else f"{100 * summary['after']:.1f}%"
        card.text += (
            "\n\n## Reinforcement-learning fine-tuning (hf_vla.rl)\n\n"
            f"- start checkpoint: `{summary['start']}`\n- env: {summary['env']} "
            f"{', '.join(summary['tasks'])}\n- method: {summary['method']}\n"
            f"- budget: {summary['updates']} updates ({stopped}), {summary['episodes']} rollout episodes, "
            f"{summary['minutes']} min\n- held-out success ({summary['eval_episodes']} episodes per task, seeds from "
            f"{EVAL_SEED}): {before} before -> {after} after"
            + (f" (best {100 * summary['best'][0]:.1f}%, {summary['best'][1]})" if summary["best"][0] is not None
               else "") + "\n")
        if self.args.should_save:
            import os

            card.save(os.path.join(self.args.output_dir, "README.md"))
        return card
