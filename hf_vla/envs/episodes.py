"""The one episode loop: closed-loop episodes of a chunking policy in N envs at once.

`hf_vla.evaluate`, rollouts during training (`hf_vla.training.rollouts`, through `evaluate_checkpoint`) and the benchmarks run
their episodes here. Each env slot runs one episode at a time with receding-horizon chunks (`n_action_steps` actions
of each predicted chunk are executed, then the next chunk is predicted from the current observation; with an
`inference_delay` d the robot executes d more actions of the old chunk while the policy works, and switches to the new
chunk at index d, optionally continuing it with real-time chunking). At each control step the slots that need a chunk
are served by one policy call (`PolicyRunner` requests of equal shapes share one forward), then every live env steps
(in parallel when the envs are `hf_vla.envs.worker.InWorker`s). A slot whose episode ended stops stepping and starts the
next seed, or stays idle when none is left.

Each episode is a pure function of its seed: the env is reset with it and the policy's noise generator is seeded with
it (`policy.reset(seed=...)`), so an episode's outcome does not depend on how many envs run beside it or in which
order episodes finish (tested: `num_envs` 1 and 4 give the same success and steps per seed).
"""

from __future__ import annotations

import logging
import math
import os
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from hf_vla.cli import progress_bar
from hf_vla.errors import ConfigError

logger = logging.getLogger("hf_vla.envs.episodes")
_DIED = object()  # what `EpisodeRunner._guard` returns when an env worker died and was restarted


def default_num_envs(episodes: int) -> int:
    """As lerobot-eval chooses its `eval.batch_size`: 70% of the cores (each env worker needs about one; the rest is
    for the policy), at most the episodes and at most 64."""
    return max(1, min(math.floor((os.cpu_count() or 4) * 0.7) or 1, episodes, 64))


def check_dims(policy, env, where: str) -> None:
    """The policy's head reads the env's state and writes its actions (in-process; a server checks per request)."""
    from hf_vla.serving.policy import stat_dims

    if not hasattr(policy, "processor"):
        return
    stats = policy.processor.norm_stats[policy.head_name()]
    state_space = getattr(env.observation_space, "spaces", {}).get("observation.state")
    for name, theirs, ours in (("action", env.action_space.shape[0], stat_dims(stats["actions"])),
                               ("state", state_space.shape[0] if state_space is not None else None,
                                stat_dims(stats["state"]))):
        if theirs is not None and theirs != ours:
            raise ConfigError(f"{where} has {theirs} {name} dims but the checkpoint's head {policy.head_name()!r} has "
                              f"{ours}: a checkpoint trained on another robot or env")


@dataclass
class Episode:
    seed: int
    success: bool
    steps: int
    reward: float  # the sum of the env's rewards
    # at the steps where the robot switched to a new chunk (see EvalResult)
    boundary_jump: float = float("nan")
    boundary_jerk: float = float("nan")
    interior_jerk: float = float("nan")
    video: str | None = None
    noise_seed: int | None = None  # the policy's noise seed (the env seed unless `run(noise_seeds=...)` says)
    step_rewards: list[float] = field(default_factory=list, repr=False)  # the env's reward at each step
    discarded: bool = False  # its env worker died mid-episode: not an outcome (see `EpisodeRunner(restart=...)`)
    log: object = field(default=None, repr=False)  # the policy's `episode_log()` (its frames when it records them)
    # pi0.5's high-level inference: [step, subtask] where the subtask the policy acted on changed, with the env
    # expert's own stage at that step as a third item where the env has one (None: no subtask)
    subtasks: list | None = None
    # chunks whose subtask was decoded where the env's expert could say its stage, and those where both agreed
    subtask_checks: int = 0
    subtask_hits: int = 0

    def record(self) -> dict:
        record = {"seed": self.seed, "success": self.success, "steps": self.steps, "reward": round(self.reward, 6)}
        if self.subtasks:
            record["subtasks"] = self.subtasks
        if self.subtask_checks:
            record["subtask_hits"], record["subtask_checks"] = self.subtask_hits, self.subtask_checks
        return record


def boundary_metrics(actions: list[np.ndarray], switches: list[int]) -> tuple[float, float, float]:
    """Mean |a_k - a_(k-1)| and |a_(k+1) - 2 a_k + a_(k-1)| at the chunk switches k, and the latter elsewhere."""
    if len(actions) < 3:
        return float("nan"), float("nan"), float("nan")
    a = np.stack(actions).astype(np.float64)
    jump = np.linalg.norm(np.diff(a, axis=0), axis=-1)  # jump[k - 1] = |a_k - a_(k-1)|
    jerk = np.linalg.norm(a[2:] - 2 * a[1:-1] + a[:-2], axis=-1)  # jerk[k - 1] is centred on a_k
    at = np.zeros(len(a), dtype=bool)
    at[[k for k in switches if 0 < k < len(a) - 1]] = True
    inner = at[1:-1]
    if not inner.any():
        return float("nan"), float("nan"), float(jerk.mean())
    return float(jump[at[1:]].mean()), float(jerk[inner].mean()), float(jerk[~inner].mean()) if (~inner).any() else float("nan")


@dataclass
class _Slot:
    """One env and the episode it runs."""

    env: object
    policy: object
    index: int = -1  # the episode's position in `seeds`
    seed: int = 0
    noise_seed: int = 0
    task: str = ""
    observation: dict | None = None
    pending_observation: dict | None = None  # with an inference delay: what the next chunk is predicted from
    pending_at: int = 0  # the step that observation was taken at (a MEM policy's past is sampled from it)
    queue: deque = field(default_factory=deque)  # actions to execute before the next policy call
    request: dict | None = None  # the next policy call: observation and RTC arguments (None: still executing)
    after_queue: str = "request"  # what follows the queue: "request", "delay" (execute the delay, then request)
    chunk: np.ndarray | None = None
    executed: list = field(default_factory=list)
    switches: list = field(default_factory=list)
    frames: list | None = None
    reward: float = 0.0
    rewards: list = field(default_factory=list)
    success: bool = False
    done: bool = True
    group: object = None  # the slot's task when the runner holds several tasks' envs
    stepped: tuple | None = None  # an in-process env's step outcome, between `_send_step` and `_receive_step`
    subtasks: list = field(default_factory=list)  # [step, subtask(, expert's)] at each change of the subtask acted on
    expert_stages: bool = True  # whether the env can say its expert's stage (`subtask_text`), until it cannot
    subtask_checks: int = 0  # chunks acting on a decoded subtask where the expert's stage was known
    subtask_hits: int = 0  # ... and the decoded subtask was the expert's stage


class EpisodeRunner:
    """Runs episodes of `policy` in `envs` (one slot each).

    envs: a list, or `{task: [envs]}` to run several tasks' episodes at once (each task's seeds in its own envs, one
        batched policy call per control step across the live envs of every task); `run` then takes seeds per task.

    policy: a `PolicyRunner`, a `RemotePolicy` or any callable `policy(observation, task, inference_delay=,
        executed_steps=) -> chunk`; with several envs it must have `fork()` (a copy with its own noise generator and
        chunk memory, or its own server connection). `reset(seed=)` is called at each episode start when present.
    restart: with it, an env whose worker process dies (`EnvWorkerError`) is closed and replaced by `restart(slot)`,
        and the episode it ran is returned with `discarded=True` (counted, not an outcome) instead of ending the run;
        without it (evaluation), the error ends the run.
    """

    def __init__(self, envs: list, policy, n_action_steps: int, inference_delay: int = 0, rtc: bool = False,
                 chunk_size: int | None = None, restart=None):
        grouped = {key: list(value) for key, value in envs.items()} if isinstance(envs, dict) else {None: list(envs)}
        flat = [(group, env) for group, members in grouped.items() for env in members]
        if not flat:
            raise ConfigError("no env to run episodes in")
        if not 1 <= n_action_steps <= (chunk_size or n_action_steps):
            raise ConfigError(f"n_action_steps={n_action_steps}: must be 1..{chunk_size or 'the chunk size'} (actions "
                              f"executed from each chunk)")
        if inference_delay < 0:
            raise ConfigError(f"inference_delay={inference_delay}: must be >= 0")
        if inference_delay and chunk_size is not None and n_action_steps + inference_delay > chunk_size:
            raise ConfigError(f"n_action_steps ({n_action_steps}) + inference_delay ({inference_delay}) exceeds the "
                              f"chunk size ({chunk_size}): the robot would run out of actions while waiting")
        if len(flat) > 1 and not hasattr(policy, "fork"):
            raise ConfigError(f"{type(policy).__name__} cannot serve {len(flat)} envs at once (it has no fork()); "
                              "run one env")
        policies = [policy] + [policy.fork() for _ in flat[1:]]
        self.slots = [_Slot(env, p, group=group) for (group, env), p in zip(flat, policies)]
        self.n_action_steps, self.inference_delay, self.rtc = n_action_steps, inference_delay, rtc
        self.rtc_methods: set = set()
        self.restart = restart
        self.discarded = 0  # episodes lost to a dead env worker (with `restart`)

    # ---- the loop ------------------------------------------------------------------------------------------------
    def run(self, seeds: list[int] | dict, save_videos: int = 0, output_dir: str | Path | None = None,
            progress: bool = True, desc: str = "closed-loop episodes",
            noise_seeds: list[int] | dict | None = None) -> list[Episode] | dict:
        """One episode per seed; the results in seed order. `noise_seeds[i]` seeds the policy's noise in episode i
        (default: its env seed), so several episodes can start from one env seed and differ in the policy's noise
        (the groups of GRPO). With envs per task, `seeds` and `noise_seeds` are `{task: [seeds]}` and so are the
        results; every task's episodes run at once, their GIFs in `output_dir` named by task, or each task's in its
        own folder when `output_dir` is `{task: folder}`."""
        grouped = isinstance(seeds, dict)
        if not grouped:
            seeds = {None: list(seeds)}
            noise_seeds = None if noise_seeds is None else {None: list(noise_seeds)}
        unknown = set(seeds) - {slot.group for slot in self.slots}
        if unknown:
            raise ValueError(f"seeds for {sorted(map(str, unknown))}, which this runner has no envs for")
        noise = {}
        for group, members in seeds.items():
            given = (noise_seeds or {}).get(group)
            if given is not None and len(given) != len(members):
                raise ValueError(f"{len(given)} noise seeds for {len(members)} episodes")
            noise[group] = list(given) if given is not None else list(members)
        pending = {group: iter([(i, seed, noise[group][i]) for i, seed in enumerate(members)])
                   for group, members in seeds.items()}
        results: dict[tuple, Episode] = {}
        successes = 0
        bar = progress_bar(sum(len(m) for m in seeds.values()), desc, "episodes", enabled=progress)
        try:
            for group, index, episode in self._stream(pending, save_videos, output_dir):
                results[group, index] = episode
                successes += episode.success
                bar.update(1)
                if not episode.discarded:
                    bar.set_postfix(success=f"{successes}/{len(results) - self.discarded}")
        finally:
            bar.close()
        out = {group: [results[group, i] for i in range(len(members))] for group, members in seeds.items()}
        return out if grouped else out[None]

    def episodes(self, seeds, save_videos: int = 0, output_dir: str | Path | None = None):
        """The episodes as they end (completion order), each seed drawn from the iterable `seeds` only when a slot
        starts its episode, so a consumer that stops early has drawn no seed it did not run (expert recording and
        DAgger keep what they need this way). A policy's `episode_log()`, when it has one, is each episode's `log`."""
        if {slot.group for slot in self.slots} != {None}:
            raise ValueError("episodes() runs a runner without task groups; use run() for envs per task")
        for _, _, episode in self._stream({None: ((i, seed, seed) for i, seed in enumerate(seeds))}, save_videos,
                                          output_dir):
            yield episode

    def _stream(self, pending: dict, save_videos: int, output_dir):
        """(group, index, Episode) for every episode as it ends, including those lost to a dead env worker."""
        for slot in self.slots:
            yield from self._start_guarded(slot, pending, save_videos)
        while any(not slot.done for slot in self.slots):
            self._serve_requests([slot for slot in self.slots if not slot.done and slot.request is not None])
            stepping = [slot for slot in self.slots if not slot.done and slot.queue]
            sent = []
            for slot in stepping:
                if self._guard(slot, _send_step, slot, slot.queue[0]) is not _DIED:
                    sent.append(slot)
                else:
                    yield self._discard(slot)
                    yield from self._start_guarded(slot, pending, save_videos)
            for slot in sent:
                outcome = self._guard(slot, _receive_step, slot)
                if outcome is _DIED:
                    yield self._discard(slot)
                    yield from self._start_guarded(slot, pending, save_videos)
                    continue
                self._after_step(slot, outcome)
                if slot.done:
                    yield slot.group, slot.index, self._finish(slot, output_dir)
                    yield from self._start_guarded(slot, pending, save_videos)

    # ---- dead env workers (with `restart`) ---------------------------------------------------------------------
    def _guard(self, slot: _Slot, function, *args):
        """`function(*args)`, or `_DIED` when the slot's env worker died and `restart` replaced it."""
        from hf_vla.envs.worker import EnvWorkerError

        try:
            return function(*args)
        except EnvWorkerError as error:
            if self.restart is None:
                raise
            logger.warning("%s; episode with seed %d discarded, env restarted", error, slot.seed)
            try:
                slot.env.close()
            except Exception:  # noqa: BLE001  (the worker is gone)
                pass
            slot.env = self.restart(next(i for i, s in enumerate(self.slots) if s is slot))
            return _DIED

    def _discard(self, slot: _Slot) -> tuple:
        self.discarded += 1
        return slot.group, slot.index, Episode(slot.seed, False, len(slot.executed), slot.reward,
                                               noise_seed=slot.noise_seed, step_rewards=slot.rewards, discarded=True)

    def _start_guarded(self, slot: _Slot, pending: dict, save_videos: int):
        """Start the slot's next episode; yields the episodes lost to a worker that died while resetting."""
        while self._guard(slot, self._start, slot, pending, save_videos) is _DIED:
            self.discarded += 1
            yield slot.group, slot.index, Episode(slot.seed, False, 0, 0.0, noise_seed=slot.noise_seed,
                                                  discarded=True)

    def _start(self, slot: _Slot, pending: dict, save_videos: int) -> None:
        drawn = next(pending.get(slot.group, iter(())), None)
        if drawn is None:
            slot.done = True
            return
        slot.index, slot.seed, slot.noise_seed = drawn
        slot.done, slot.rewards, slot.executed = True, [], []  # until the reset below succeeds
        observation, info = slot.env.reset(seed=slot.seed)
        if hasattr(slot.policy, "reset"):
            slot.policy.reset(seed=slot.noise_seed)  # the episode's noise: a function of its seed alone
        _observe(slot.policy, observation, self.inference_delay)
        slot.task = info.get("task") or getattr(getattr(slot.env, "unwrapped", slot.env), "task", "") or ""
        slot.frames = [slot.env.render()] if slot.index < save_videos else None
        slot.observation, slot.done, slot.success, slot.reward = observation, False, False, 0.0
        slot.executed, slot.switches, slot.queue, slot.chunk = [], [], deque(), None
        slot.subtasks, slot.expert_stages, slot.subtask_checks, slot.subtask_hits = [], True, 0, 0
        slot.request = {"observation": observation, "inference_delay": 0, "executed_steps": None, "first": True,
                        "taken_at": 0}

    def _serve_requests(self, slots: list[_Slot]) -> None:
        if not slots:
            return
        stages = [_expert_stage(s) if getattr(s.policy, "subtask", None) in ("auto", "oracle") else None
                  for s in slots]
        # every step was observed (`_observe`): the request's observation is `lag` steps behind the newest
        chunks = _call_policies([(s.policy, s.request["observation"], s.task, s.request["inference_delay"],
                                  s.request["executed_steps"],
                                  stage if getattr(s.policy, "subtask", None) == "oracle" else None,
                                  len(s.executed) - s.request["taken_at"])
                                 for s, stage in zip(slots, stages)])
        for slot, chunk, stage in zip(slots, chunks, stages):
            if slot.request["inference_delay"] or slot.request["executed_steps"] is not None:
                self.rtc_methods.add(getattr(slot.policy, "last_rtc_method", None))
            first = slot.request["first"]
            subtask = getattr(slot.policy, "last_subtask", None)
            # at the step its chunk's actions start at: the subtask acted on (and the expert's own stage)
            entry = [len(slot.executed), subtask] + ([stage] if stage is not None else [])
            if stage is not None and subtask is not None and getattr(slot.policy, "subtask", None) == "auto":
                slot.subtask_checks += 1
                slot.subtask_hits += int(subtask == stage)
            if subtask is not None and (not slot.subtasks or slot.subtasks[-1][1:] != entry[1:]):
                slot.subtasks.append(entry)
            slot.request, slot.chunk = None, np.asarray(chunk)
            start = 0 if first else self.inference_delay
            if not first:
                slot.switches.append(len(slot.executed))
            slot.queue = deque(slot.chunk[start:self.n_action_steps])
            slot.after_queue = "delay" if self.inference_delay else "request"
            self._advance(slot)

    def _advance(self, slot: _Slot) -> None:
        """With the queue empty: the next phase (execute the delay's actions, or ask for the next chunk)."""
        while not slot.queue and not slot.done and slot.request is None:
            if slot.after_queue == "delay":
                # the observation the next chunk is predicted from; the robot executes d more actions meanwhile
                slot.pending_observation, slot.pending_at = slot.observation, len(slot.executed)
                slot.queue = deque(slot.chunk[self.n_action_steps:self.n_action_steps + self.inference_delay])
                slot.after_queue = "delayed request"
            elif slot.after_queue == "delayed request":
                slot.request = {"observation": slot.pending_observation, "first": False,
                                "inference_delay": self.inference_delay if self.rtc else 0,
                                "executed_steps": self.n_action_steps if self.rtc else None,
                                "taken_at": slot.pending_at}
            else:
                slot.request = {"observation": slot.observation, "inference_delay": 0, "executed_steps": None,
                                "first": False, "taken_at": len(slot.executed)}

    def _after_step(self, slot: _Slot, outcome) -> None:
        observation, reward, terminated, truncated, info = outcome
        slot.executed.append(np.asarray(slot.queue.popleft()))
        if hasattr(slot.policy, "after_step"):  # a policy that keeps a per-step log (expert recording, DAgger)
            slot.policy.after_step(slot.executed[-1], outcome)
        slot.observation = observation
        if not (terminated or truncated):
            _observe(slot.policy, observation)
        slot.reward += float(reward)
        slot.rewards.append(float(reward))
        if slot.frames is not None:
            slot.frames.append(slot.env.render())
        slot.success = slot.success or bool(info.get("is_success", False))
        if terminated or truncated:
            slot.done = True
            return
        self._advance(slot)

    def _finish(self, slot: _Slot, output_dir) -> Episode:
        jump, jerk, interior = boundary_metrics(slot.executed, slot.switches)
        episode = Episode(slot.seed, slot.success, len(slot.executed), slot.reward, jump, jerk, interior,
                          noise_seed=slot.noise_seed, step_rewards=slot.rewards,
                          log=slot.policy.episode_log() if hasattr(slot.policy, "episode_log") else None,
                          subtasks=[list(item) for item in slot.subtasks] or None,
                          subtask_checks=slot.subtask_checks, subtask_hits=slot.subtask_hits)
        if isinstance(output_dir, dict):  # a folder per task: the names need not say the task
            output_dir, group = output_dir.get(slot.group), None
        else:
            group = slot.group
        if slot.frames is not None and output_dir is not None:
            outcome = "success" if slot.success else "failure"
            name = f"rollout_{slot.index:03d}_{outcome}.gif" if group is None else \
                f"rollout_{group}_{slot.index:03d}_{outcome}.gif"
            episode.video = save_gif(slot.frames, Path(output_dir) / name,
                                     caption=f"{slot.task} ({outcome}, seed {slot.seed})",
                                     subtitles=slot.subtasks or None)
        return episode


def _observe(policy, observation, lag: int = 0) -> None:
    """Every control step's observation to a policy that keeps the past (MEM: `PolicyRunner.observe`), once; `lag`:
    the steps a request's observation may lie behind the newest (the inference delay)."""
    if getattr(policy, "memory", None) is not None and hasattr(policy, "observe"):
        policy.memory.reserve(lag)
        policy.observe(observation)


def _send_step(slot: _Slot, action) -> None:
    """Start the slot's env step: asynchronous in a worker process (`InWorker.step_async`), else run now and kept."""
    if hasattr(slot.env, "step_async"):
        slot.env.step_async(action)
    else:
        slot.stepped = slot.env.step(action)


def _receive_step(slot: _Slot):
    if hasattr(slot.env, "step_wait"):
        return slot.env.step_wait()
    outcome, slot.stepped = slot.stepped, None
    return outcome


def _expert_stage(slot: _Slot) -> str | None:
    """The env expert's stage in words at the slot's current observation (`subtask_text`: Meta-World's), or None
    where the env has no expert stages."""
    if not slot.expert_stages:
        return None
    env = slot.env
    try:
        return env.call("subtask_text") if hasattr(env, "call") else getattr(env, "unwrapped", env).subtask_text()
    except Exception:  # noqa: BLE001 - an env without stages (any gymnasium env): asked no more
        slot.expert_stages = False
        return None


def _call_policies(requests: list[tuple]) -> list[np.ndarray]:
    """One chunk per (policy, observation, task, inference_delay, executed_steps, subtask, lag). `PolicyRunner`s:
    validated and pre-processed each, then every group of requests that can share a forward (no RTC, equal input
    shapes) runs as one `sample_actions`; other policies are called one by one. `subtask`: the text a runner set to
    "oracle" acts on (the env expert's stage), else None; `lag`: steps the observation is behind the newest one the
    loop observed (a MEM policy's past is sampled from it)."""
    from hf_vla.serving.policy import Continuation, PolicyRunner

    chunks: list = [None] * len(requests)
    groups: dict = {}
    for i, (policy, observation, task, delay, executed, subtask, lag) in enumerate(requests):
        if isinstance(policy, PolicyRunner):
            recorded = lag if policy.memory is not None else None
            prepared = policy.prepare(observation, task, continuation=Continuation(delay, executed, recorded=recorded),
                                      subtask=subtask)
            key = prepared.batch_key()
            groups.setdefault((id(policy.model), key) if key is not None else ("alone", i), []).append((i, prepared))
        elif delay or executed is not None:
            chunks[i] = policy(observation, task, inference_delay=delay, executed_steps=executed)
        else:
            chunks[i] = policy(observation, task)
    for members in groups.values():
        runner = requests[members[0][0]][0]
        sampled = runner.sample_batch([prepared for _, prepared in members])
        for (i, prepared), chunk in zip(members, sampled):
            chunks[i] = requests[i][0].finish(prepared, chunk)
    return chunks


def save_gif(frames: list[np.ndarray], path: Path, caption: str = "", subtitles: list | None = None) -> str:
    """The episode's frames as a GIF, enlarged (nearest) to at least 256 px wide, with `caption` (the instruction,
    the outcome) written in a band above the frames; `subtitles` (`[step, text, ...]` from that step on: the subtask
    the policy acted on) in a band below them. Frame 0 is the reset, frame k+1 follows action k."""
    from PIL import Image, ImageDraw, ImageFont

    path.parent.mkdir(parents=True, exist_ok=True)
    height, width = frames[0].shape[:2]
    scale = max(1, -(-256 // width))
    font = ImageFont.load_default()
    lines = _wrap(caption, font, width * scale - 8) if caption else []
    band = 4 + 14 * len(lines) if lines else 0
    below = 18 if subtitles else 0
    pictures = []
    for index, frame in enumerate(frames):
        picture = Image.new("RGB", (width * scale, height * scale + band + below), (255, 255, 255))
        picture.paste(Image.fromarray(np.asarray(frame)).resize((width * scale, height * scale), Image.NEAREST),
                      (0, band))
        draw = ImageDraw.Draw(picture)
        for i, line in enumerate(lines):
            draw.text((4, 2 + 14 * i), line, fill=(0, 0, 0), font=font)
        current = [entry[1] for entry in subtitles or () if entry[0] <= max(index - 1, 0)]
        if current:
            draw.text((4, height * scale + band + 3), f"subtask: {current[-1]}", fill=(0, 0, 160), font=font)
        pictures.append(picture)
    pictures[0].save(path, save_all=True, append_images=pictures[1:], duration=100, loop=0)
    return str(path)


def _wrap(text: str, font, width: int) -> list[str]:
    lines, line = [], ""
    for word in text.split():
        candidate = f"{line} {word}".strip()
        if line and font.getlength(candidate) > width:
            lines.append(line)
            line = word
        else:
            line = candidate
    return [*lines, line] if line else lines


__all__ = ["Episode", "EpisodeRunner", "boundary_metrics", "check_dims", "default_num_envs", "save_gif"]
