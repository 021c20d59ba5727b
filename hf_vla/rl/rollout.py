"""Rollouts for RL: the episode loop of evaluation (`hf_vla.envs.episodes.EpisodeRunner`) with a stochastic policy that
records what the update needs.

`StochasticPolicy` is a `PolicyRunner` whose chunks come from the Flow-SDE sampler (`hf_vla.rl.flow`): every policy call
keeps the model inputs, the sampled chain x_1 .. x_0 and its per-step log-probabilities as a `Transition`. The episode
loop is the one `hf_vla.evaluate` runs: envs in worker processes, one batched policy call per control step across live
envs, each episode a function of its env seed and noise seed (the Gaussian steps' normals are drawn per request from
the slot's generator, so batching does not change an episode). `RolloutEngine` holds the envs of every task for the
whole run and restarts an env whose worker died (its episode is discarded and counted).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import torch

from hf_vla.rl.flow import FlowSDE, sample_chain, step_log_probs
from hf_vla.serving.policy import PolicyRunner, PreparedRequest, RequestError, batch_requests, decode_subtasks

logger = logging.getLogger("hf_vla.rl")


@dataclass
class Transition:
    """One policy decision: a chunk sampled from an observation, as the update recomputes it."""

    inputs: dict  # the model's inputs (`hf_vla.serving.policy.model_input_keys`), each [1, ...]
    chain: torch.Tensor  # [K+1, chunk, max_action_dim], normalised; chain[-1] is the chunk
    log_probs: torch.Tensor  # [K] per denoising step, over the executed steps and the head's action dims
    means: torch.Tensor  # [K, chunk, max_action_dim]: the Gaussian steps' means under the rollout weights
    noise_seed: int  # the episode's
    index: int  # its position in the episode
    value: float | None = None  # the critic's estimate at the observation (PPO)
    level: float | None = None  # the noise level it was sampled with (its task's; None: the sde's noise_level)


def decision_mask(config, n_action_steps: int, action_dims: int | None = None) -> torch.Tensor:
    """[chunk, max_action_dim]: the elements of a chunk the likelihood covers, the executed steps' real action dims
    (what the env receives; the rest of the chunk and the padded dims never reach it)."""
    mask = torch.zeros(config.chunk_size, config.max_action_dim)
    mask[:n_action_steps, : action_dims or config.max_action_dim] = 1.0
    return mask


@dataclass
class StochasticPolicy(PolicyRunner):
    """A `PolicyRunner` sampling with `sde` (Flow-SDE) and recording a `Transition` per call (one list per fork)."""

    sde: FlowSDE | None = None
    n_action_steps: int = 1
    action_dims: int | None = None  # the head's real action dims (the rest is padding); default all
    with_value: bool = False  # also record the critic's value of each observation (PPO)
    task_noise_levels: dict | None = None  # {task: noise level} for tasks that explore at a level of their own
    task: str | None = None  # the benchmark task of the env this copy serves (`RolloutEngine` sets it per slot)

    def __post_init__(self):
        super().__post_init__()
        if self.sde is None:
            raise ValueError("StochasticPolicy needs an sde (hf_vla.rl.flow.FlowSDE)")
        self.transitions: list[Transition] = []
        self.noise_seed = 0
        self._calls = 0

    def fork(self) -> StochasticPolicy:
        from dataclasses import replace

        return replace(self)  # __post_init__ gives the copy its own generator and transition list

    def reset(self, seed: int | None = None) -> None:
        super().reset(seed)
        self.noise_seed, self._calls = int(seed if seed is not None else 0), 0

    @property
    def level(self) -> float:
        """The noise level of this copy's chunks: its task's in `task_noise_levels`, else the sde's."""
        return float((self.task_noise_levels or {}).get(self.task, self.sde.noise_level))

    def mask(self) -> torch.Tensor:
        return decision_mask(self.model.config, self.n_action_steps, self.action_dims)

    def prepare(self, observation: dict, task: str | None = None, head=None, continuation=None,
                subtask: str | None = None) -> PreparedRequest:
        if continuation is not None and (continuation.inference_delay or continuation.executed_steps is not None
                                         or continuation.prev_chunk_left_over is not None):
            raise RequestError("RL rollouts sample independent chunks (no real-time chunking)")
        # an advantage-conditioned policy (RECAP) acts on "positive" as everywhere; without guidance (cfg_beta 1):
        # the chain's likelihood is that of the one velocity it sampled with
        request = super().prepare(observation, task, head, continuation, cfg_beta=1.0, subtask=subtask)
        config = self.model.config
        # the Gaussian steps' normals, from this slot's generator: the episode does not depend on its batch-mates
        request.step_noise = torch.randn(1, self.sde.num_steps, config.chunk_size, config.max_action_dim,
                                         generator=self.generator)
        request.level = self.level
        return request

    def sample_batch(self, requests: list[PreparedRequest]) -> torch.Tensor:
        self._subtasks(requests)
        inputs, noise = batch_requests(requests, self.device)
        step_noise = torch.cat([r.step_noise for r in requests]).to(self.device)
        levels = [r.level for r in requests]  # one per chunk: a batch holds every task's envs
        chain, means, *value = sample_chain(self.model, inputs, noise, step_noise, self.sde, value=self.with_value,
                                            levels=levels)
        if min(levels) > 0:
            log_probs = step_log_probs(chain, means, self.sde, self.mask().to(chain.device), levels)
        else:  # the deterministic sampler (filtered_bc's noise_level 0): no density to record
            log_probs = torch.zeros(chain.shape[0], self.sde.num_steps)
        for i, request in enumerate(requests):
            request.chain, request.log_probs, request.means = chain[i].cpu(), log_probs[i].cpu(), means[i].cpu()
            request.value = float(value[0][i]) if value else None
        return chain[:, -1].cpu()

    def _subtasks(self, requests: list[PreparedRequest]) -> None:
        """pi0.5's high-level inference in a rollout: each request's subtask decoded first where it asks for one
        (the joint layout's tokens join its inputs; the factorised layout's second prompt replaces them), and every
        subtask span padded to `subtask_max_tokens`, so the update batches transitions of any subtask lengths."""
        if requests[0].decode_subtask:
            decode_subtasks(self.model, requests, batch_requests(requests, self.device)[0])
            for request in requests:
                if request.reprompt is not None:
                    request.inputs = dict(request.reprompt(*request.decoded))
                else:
                    request.inputs = dict(request.inputs, subtask_ids=request.decoded[0][None],
                                          subtask_mask=request.decoded[1][None])
        width = getattr(self.model.config, "subtask_max_tokens", 0)
        for request in requests:
            if "subtask_ids" in request.inputs and request.inputs["subtask_ids"].shape[1] < width:
                extra = width - request.inputs["subtask_ids"].shape[1]
                request.inputs["subtask_ids"] = torch.nn.functional.pad(request.inputs["subtask_ids"], (0, extra))
                request.inputs["subtask_mask"] = torch.nn.functional.pad(request.inputs["subtask_mask"], (0, extra))

    def finish(self, request: PreparedRequest, chunk: torch.Tensor) -> np.ndarray:
        self.transitions.append(Transition(dict(request.inputs), request.chain,
                                           request.log_probs, request.means, self.noise_seed, self._calls,
                                           request.value, request.level))
        self._calls += 1
        return super().finish(request, chunk)


@dataclass
class RolloutEngine:
    """The envs of every task (`num_envs` each, built once) and the episodes run in them: every task's at once, one
    batched policy call per control step across the live envs of all tasks.

    env_id: `metaworld`, `libero` or a gymnasium id; tasks: the benchmark's task names (`[None]` for a gymnasium id).
    """

    env_id: str
    tasks: list
    num_envs: int
    env_kwargs: dict = field(default_factory=dict)
    n_action_steps: int = 1
    chunk_size: int | None = None

    def __post_init__(self):
        from hf_vla.evaluation.envs import _make_envs

        self.envs: dict = {}
        try:
            for task in self.tasks:
                self.envs[task] = _make_envs(self.env_id, task, self.num_envs, self.env_kwargs, None)
        except BaseException:
            self.close()
            raise
        self.discarded = 0

    def _restart(self, task, slot: int):
        from hf_vla.evaluation.envs import make_env

        env = make_env(self.env_id, task, self.env_kwargs, worker=self.num_envs > 1)
        self.envs[task][slot] = env
        return env

    def run(self, policy, seeds: dict, noise_seeds: dict | None = None, progress: bool = False, desc: str = "rollouts"):
        """Episodes of `policy` per task (`seeds[task]`, `noise_seeds[task]` aligned): `{task: [Episode]}` (in seed
        order, dead-worker episodes marked `discarded`), and for a `StochasticPolicy` the transitions of every slot."""
        from hf_vla.envs.episodes import EpisodeRunner

        tasks = [task for task in self.tasks if seeds.get(task)]
        if not tasks:
            return {}, []
        # every task's episodes at once: one batched policy call per control step across the live envs of all tasks
        places = [(task, i) for task in tasks for i in range(len(self.envs[task]))]
        runner = EpisodeRunner({task: self.envs[task] for task in tasks}, policy, self.n_action_steps,
                               chunk_size=self.chunk_size, restart=lambda flat: self._restart(*places[flat]))
        for slot in runner.slots:  # each copy of the policy serves one task's env (its noise level, if its own)
            if isinstance(slot.policy, StochasticPolicy):
                slot.policy.task = slot.group
        noise = {task: noise_seeds[task] for task in tasks if task in (noise_seeds or {})}
        episodes = runner.run({task: seeds[task] for task in tasks}, progress=progress, desc=desc,
                              noise_seeds=noise or None)
        self.discarded += runner.discarded
        transitions = []
        for slot in runner.slots:
            transitions += getattr(slot.policy, "transitions", [])
            if hasattr(slot.policy, "transitions"):
                slot.policy.transitions = []
        return episodes, transitions

    def close(self):
        from hf_vla.evaluation.envs import _close

        for envs in self.envs.values():
            _close(envs)
        self.envs = {}


__all__ = ["RolloutEngine", "StochasticPolicy", "Transition", "decision_mask"]
