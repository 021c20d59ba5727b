"""Rollout collection for `RLTrainer`: each rank's env seeds per update, the stochastic policy rolled out in the
episode loop, PPO's advantages (GAE with the critic) or GRPO's group baselines, the start policy's means for the KL,
and the update's micro-batches. A mixin of `RLTrainer`."""

from __future__ import annotations

import math
import time

import torch

from hf_vla.rl.flow import absorbing_bonus, chain_means, gae, group_advantages, step_kl


class RolloutCollection:
    def _shows_progress(self) -> bool:
        """Rollouts and held-out evaluations report their progress on the main process: a live bar on a terminal
        (unless `disable_tqdm`), one line per finished phase in a log (`hf_vla.cli.progress_bar`)."""
        import sys

        return self.is_world_process_zero() and (not self.args.disable_tqdm or not sys.stderr.isatty())

    def _policy(self, stochastic: bool):
        from hf_vla.rl.rollout import StochasticPolicy
        from hf_vla.serving.policy import ObservationMap, PolicyRunner

        model = self.accelerator.unwrap_model(self.model)
        settings = self.rl_settings
        common = dict(model=model, processor=self.processing_class, head=settings["head"],
                      obs_map=ObservationMap(cameras=settings["cameras"]), device=str(self.args.device),
                      num_camera_slots=settings["camera_slots"], memory_stride=settings["memory_stride"])
        if not stochastic:
            return PolicyRunner(**common)
        return StochasticPolicy(**common, sde=self.sde, n_action_steps=settings["n_action_steps"],
                                action_dims=settings["action_dims"], with_value=self.args.algorithm == "ppo",
                                task_noise_levels=self.args.task_noise_levels)

    def _levels(self, transitions: list) -> list[float] | None:
        """The noise level of each decision (its task's; the run's `noise_level` if not recorded), `None` for none."""
        return [self.sde.noise_level if tr.level is None else tr.level for tr in transitions] or None

    def _stochastic(self) -> bool:
        """Whether every task's rollouts sample with noise (a chain with a likelihood, and a KL to log)."""
        return min([self.sde.noise_level, *(self.args.task_noise_levels or {}).values()]) > 0

    def _level_text(self) -> str:
        own = self.args.task_noise_levels or {}
        return f"{self.args.noise_level:g}" + (
            f" ({', '.join(f'{task} {level:g}' for task, level in own.items())})" if own else "")

    def _mask(self) -> torch.Tensor:
        from hf_vla.rl.rollout import decision_mask

        settings = self.rl_settings
        return decision_mask(self.accelerator.unwrap_model(self.model).config, settings["n_action_steps"],
                             settings["action_dims"])

    def _seeds(self, generation: int) -> tuple[dict, dict]:
        """Env seeds and noise seeds per task of one rollout batch on this rank: `groups_per_update` env seeds, each
        `group_size` times with distinct noise seeds; a function of (generation, rank) alone, so a resumed run rolls
        out what the uninterrupted one would have."""
        args, tasks = self.args, self.rl_settings["tasks"]
        block = (generation * args.world_size + args.process_index) * args.groups_per_update
        seeds, noise = {}, {}
        for t, task in enumerate(tasks):
            seeds[task] = [args.episode_seed + block + g for g in range(args.groups_per_update)
                           for _ in range(args.group_size)]
            base = ((generation * args.world_size + args.process_index) * len(tasks) + t) * len(seeds[task])
            noise[task] = [10**9 + base + i for i in range(len(seeds[task]))]
        return seeds, noise

    def _prepare_inputs(self, inputs):
        # As TRL's GRPOTrainer: the batch is generated here, every num_iterations optimizer steps, and split into the
        # step's gradient-accumulation micro-batches.
        generation = self.state.global_step // self.args.num_iterations
        if self._buffer is None or generation != self._buffer_generation:
            self._buffer = self._generate(generation)
            self._buffer_generation = generation
        batch = self._buffer[self._micro % len(self._buffer)]
        self._micro += 1
        return batch

    @torch.no_grad()
    def _generate(self, generation: int) -> list[dict]:
        args = self.args
        started = time.perf_counter()
        model = self.accelerator.unwrap_model(self.model)
        was_training = model.training
        policy = self._policy(stochastic=True)
        seeds, noise_seeds = self._seeds(generation)
        try:
            episodes, transitions = self.engine.run(policy, seeds, noise_seeds, progress=self._shows_progress(), desc=f"rollouts (update {generation})")
        finally:
            model.train(was_training)
        seconds = time.perf_counter() - started
        # returns and advantages; GRPO: per episode, over its group (one task's episodes from one env seed, all on this
        # rank); PPO: per decision, GAE with the critic's values
        kept_by_noise, rows = {}, []
        for t, (task, items) in enumerate(episodes.items()):
            kept = [e for e in items if not e.discarded]
            if not kept:
                continue
            returns = torch.tensor([float(e.success) if args.reward == "success" else e.reward + self._bonus(e)
                                    for e in kept])
            rows.append((task, [e.success for e in kept], returns.tolist(), [e.steps for e in kept]))
            if args.algorithm == "ppo":
                kept_by_noise.update({e.noise_seed: (e, None, True) for e in kept})
                continue
            groups = torch.tensor([t * 10**9 + e.seed for e in kept])
            advantages, informative = group_advantages(returns * args.reward_scale, groups, scale=args.scale_rewards)
            if args.algorithm == "filtered_bc":  # imitate the successes, or (dense) the episodes above their group's mean
                chosen = [e.success for e in kept] if args.reward == "success" else (advantages > 0).tolist()
                kept_by_noise.update({e.noise_seed: (e, 1.0, bool(c)) for e, c in zip(kept, chosen)})
                continue
            for e, a, keep in zip(kept, advantages.tolist(), informative.tolist()):
                kept_by_noise[e.noise_seed] = (e, a, keep or not args.dynamic_sampling)
        used = [tr for tr in transitions if tr.noise_seed in kept_by_noise and kept_by_noise[tr.noise_seed][2]]
        if args.algorithm == "ppo":
            self._ppo_advantages(used, kept_by_noise)
        else:
            for tr in used:
                tr.advantage = kept_by_noise[tr.noise_seed][1]
        total = torch.tensor([float(len(used))], device=args.device)
        if self.accelerator.num_processes > 1:
            total = self.accelerator.reduce(total, reduction="sum")
        total = float(total.item())
        self._log_rollouts(episodes, rows, transitions, used, seconds, sum(len(v) for v in seeds.values()))
        if args.log_kl and self._stochastic():  # the start policy's means at the stored x_k: the KL along the
            # rollouts' chains (a deterministic chain, noise_level 0, has none)
            measured = used if args.beta > 0 else (used or transitions)[:256]
            self._reference_means(measured)
            if measured:
                kl = step_kl(torch.stack([tr.means for tr in measured]),
                             torch.stack([tr.reference_means for tr in measured]), self.sde,
                             self._mask(), self._levels(measured)).sum(dim=1)
                self._metric("kl_to_start", kl.mean().item())
        return self._micro_batches(used, transitions, total, generation)

    def _ppo_advantages(self, used: list, kept_by_noise: dict) -> None:
        """GAE per episode over its decisions (`hf_vla.rl.flow.gae`), rewards per decision (the env's over its executed
        steps, or 1 on the successful one), then advantages whitened over the rollout batch of every rank (PPO's
        usual normalisation; one process on the union gets the same numbers)."""
        args = self.args
        n = self.rl_settings["n_action_steps"]
        by_episode: dict = {}
        for tr in used:
            by_episode.setdefault(tr.noise_seed, []).append(tr)
        for noise_seed, decisions in by_episode.items():
            decisions.sort(key=lambda tr: tr.index)
            episode = kept_by_noise[noise_seed][0]
            rewards = torch.zeros(len(decisions), dtype=torch.float64)
            if args.reward == "dense":
                for i in range(len(decisions)):
                    rewards[i] = sum(episode.step_rewards[i * n:(i + 1) * n])
                rewards[-1] += self._bonus(episode, args.gamma)
            elif episode.success:
                rewards[-1] = 1.0
            values = torch.tensor([tr.value for tr in decisions], dtype=torch.float64)
            advantages, returns = gae(rewards * args.reward_scale, values, args.gamma, args.lam)
            for tr, a, r in zip(decisions, advantages.tolist(), returns.tolist()):
                tr.advantage, tr.value_target = a, r
        advantages = torch.tensor([tr.advantage for tr in used], dtype=torch.float64)
        returns = torch.tensor([tr.value_target for tr in used], dtype=torch.float64)
        values = torch.tensor([tr.value for tr in used], dtype=torch.float64)
        residual = returns - values
        stats = torch.stack([torch.tensor(float(len(used)), dtype=torch.float64), advantages.sum(),
                             (advantages ** 2).sum(), returns.sum(), (returns ** 2).sum(), residual.sum(),
                             (residual ** 2).sum(), values.sum()]).to(args.device)
        if self.accelerator.num_processes > 1:
            stats = self.accelerator.reduce(stats, reduction="sum")
        count, a_sum, a_sq, r_sum, r_sq, e_sum, e_sq, v_sum = stats.cpu().tolist()
        count = max(count, 1.0)

        def variance(total, squares):
            return max(squares / count - (total / count) ** 2, 0.0) * count / max(count - 1, 1.0)

        mean, std = a_sum / count, math.sqrt(variance(a_sum, a_sq))
        for tr in used:
            tr.advantage = (tr.advantage - mean) / (std + 1e-8)
        self._metric("value", v_sum / count)
        returns_variance = variance(r_sum, r_sq)
        if returns_variance > 0:  # 1: the critic explains the returns; 0: no better than their mean
            self._metric("explained_variance", 1 - variance(e_sum, e_sq) / returns_variance)

    def _bonus(self, episode, gamma: float = 1.0) -> float:
        """`absorbing_bonus` of an episode that ended in success before the episode limit (0 otherwise)."""
        limit, n = self.rl_settings["max_episode_steps"], self.rl_settings["n_action_steps"]
        if not episode.success or not limit or not episode.step_rewards:
            return 0.0
        executed = episode.steps - (math.ceil(episode.steps / n) - 1) * n
        return absorbing_bonus(episode.step_rewards[-1], int(limit) - episode.steps, executed, n, gamma)

    def _reference_means(self, transitions: list) -> None:
        """The start policy's means at each stored x_k (for the KL), in batches."""
        model = self.accelerator.unwrap_model(self.model)
        device = self.args.device
        for start in range(0, len(transitions), 64):
            part = transitions[start:start + 64]
            inputs = {k: torch.cat([tr.inputs[k] for tr in part]).to(device) for k in part[0].inputs}
            chain = torch.stack([tr.chain for tr in part]).to(device)
            if self.reference is not None:
                means = chain_means(self.reference, inputs, chain, self.sde, levels=self._levels(part))
            else:
                with model.disable_adapter():
                    means = chain_means(model, inputs, chain, self.sde, levels=self._levels(part))
            for tr, mean in zip(part, means.cpu()):
                tr.reference_means = mean

    def _micro_batches(self, used: list, transitions: list, total: float, generation: int):
        """The kept decisions, shuffled (seeded by the generation), in `gradient_accumulation_steps` micro-batches of
        the loss weight 1 / (kept decisions on all ranks); a part left empty holds one decision of weight 0, so every
        rank runs the same number of forward/backward passes."""
        parts = self.args.gradient_accumulation_steps
        order = torch.randperm(len(used), generator=torch.Generator().manual_seed(generation)).tolist()
        shuffled = [used[i] for i in order]
        batches = []
        policy_mask = self._mask()
        for p in range(parts):
            members = shuffled[p::parts]
            weight = 1.0 / total if members else 0.0
            if not members:
                members = [transitions[0]]
                if self.args.beta > 0 and not hasattr(members[0], "reference_means"):
                    self._reference_means(members)
            batch = {k: torch.cat([tr.inputs[k] for tr in members]) for k in members[0].inputs}
            batch["chain"] = torch.stack([tr.chain for tr in members])
            batch["levels"] = torch.tensor(self._levels(members))
            batch["old_log_probs"] = torch.stack([tr.log_probs for tr in members])
            batch["advantages"] = torch.tensor([getattr(tr, "advantage", 0.0) if weight else 0.0 for tr in members])
            if self.args.algorithm == "ppo":
                batch["returns"] = torch.tensor([getattr(tr, "value_target", tr.value) for tr in members])
                batch["old_values"] = torch.tensor([tr.value for tr in members])
            batch["weights"] = torch.full((len(members),), weight)
            batch["mask"] = policy_mask
            if self.args.beta > 0:
                batch["reference_means"] = torch.stack([tr.reference_means for tr in members])
            if self.args.algorithm == "filtered_bc":  # the supervised loss's sample identity: its noise and time seed
                batch["source_index"] = torch.zeros(len(members), dtype=torch.long)
                batch["episode_index"] = torch.tensor([tr.noise_seed for tr in members])
                batch["frame_index"] = torch.tensor([tr.index for tr in members])
            batches.append({k: v.to(self.args.device) for k, v in batch.items()})
        return batches
