"""RECAP's mechanism on ColorReach (docs/recap.md), from a start that reads its prompt:

    python -m benchmarks.closed_loop.recap_mechanism                 # every stage, resumable
    python -m benchmarks.closed_loop.recap_mechanism --stage probe   # one stage

Stages (each skipped where its output exists; figures merged into `benchmarks/results/recap_cpu.json` under
`mechanism`):
- `start`: the demo recipe (`configs/demo.json`: 1,000 expert episodes, 5,000 steps) with room in the prompt for the
  indicator (`tokenizer_max_length` 40);
- `probe`: does the start read its prompt? On held-out seeds, the same scene asked for its true colour and for another
  present one: the first chunk's aim (open loop: the target its summed displacement points at) and the closed-loop
  outcome (the first target reached) for each;
- `data`: 200 expert episodes and 200 decoys (the scripted expert drives to another target while the prompt names
  the true one: `ColorReachWithExpert(decoy=True)`);
- `arms`: from the start, at equal steps and one schedule: behaviour cloning on the mixture (`bc_mixture`); the
  advantage-conditioned policy on the true labels (`oracle_text`: experts positive, decoys negative, the indicator
  in the prompt; and `oracle_embedding`, the indicator read by the expert); and on a learned value model's annotation
  (`learned_value`: value models trained cross-fitted on both, `recap annotate`, the default form: the embedding);
- `evaluate`: each conditioned arm asked "positive", "negative", with no indicator and "positive" at beta 2.5; the
  named-target rate (success), the decoy rate (reached another target first), per arm, on `--episodes` held-out
  seeds; plus the diagnostics (held-out flow MSE with the true and the flipped indicator, ||v_c - v_u|| / ||v_u||).
- `plateau`, `collect`: the start on targets anywhere (`layout: "random"`), and 200 of its episodes recorded;
- `oracle_arms`: from the start, on the demonstrations and those episodes, labels of every kind (`--seeds`, `--arms`);
- `headline`: RECAP two rounds against continued BC and BC with the collected episodes at equal wall minutes;
- `guidance`: the conditioned policies on the plateau at cfg_beta 0, 1 and 2.5;
- `corrections`: the start's episodes with the expert taking over where the policy goes astray (RECAP's
  corrections), RECAP on them against behaviour cloning on the same executed actions and the DAgger aggregate.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
WORK = REPO / "data_cache" / "recap_mechanism"
RESULTS = REPO / "benchmarks" / "results" / "recap_cpu.json"
SEED = 10_000  # held-out evaluation seeds from here (recordings use others)
PROMPT_TOKENS = 40
CONTROL = "delta_xy"


def _env() -> dict:
    return dict(os.environ, HF_HUB_OFFLINE="1", WANDB_MODE="offline", OMP_NUM_THREADS=os.environ.get(
        "OMP_NUM_THREADS", "2"))


def _run(command: list[str], log: Path) -> float:
    started = time.perf_counter()
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        done = subprocess.run(command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=_env())
    if done.returncode != 0:
        sys.exit(f"{' '.join(command[:5])} ... failed (exit {done.returncode}); its output: {log}")
    return time.perf_counter() - started


def _dataset(root: Path, name: str, **extra) -> dict:
    return {"root": str(root), "name": name, "cameras": ["observation.image"], "state_key": "observation.state",
            "action_key": "action", "control_mode": CONTROL, **extra}


def stage_start(results: dict) -> None:
    from hf_vla.envs.recording import RecordArguments, record

    if not (WORK / "expert_1000" / "meta" / "info.json").exists():
        record(RecordArguments(env="color_reach", output=WORK / "expert_1000", episodes=1000, seed=0), progress=True)
    if (WORK / "start" / "model.safetensors").exists():
        return
    seconds = _run([sys.executable, "-m", "hf_vla.train", str(REPO / "configs" / "demo.json"),
                    "--datasets", json.dumps([_dataset(WORK / "expert_1000", "color_reach")]),
                    "--generate_demo_data", "false", "--model_config.tokenizer_max_length", str(PROMPT_TOKENS),
                    "--output_dir", str(WORK / "start"), "--disable_tqdm", "true"], WORK / "start.log")
    results["start_run"] = {"recorded_episodes": 1000, "steps": 5000, "wall_seconds": round(seconds, 1)}


# ---- closed-loop evaluation with the named target tracked -----------------------------------------------------------
class _Tracked:
    """ColorReach that records which target the agent reaches first (within the success radius), and asks for
    `ask` instead of the env's own goal: "true", or "swapped" (another present colour, drawn from the seed)."""

    def __init__(self, ask: str = "true", **kwargs):
        from hf_vla.envs.reach import ColorReachEnv

        self.env, self.ask = ColorReachEnv(**kwargs), ask
        self.metadata, self.observation_space, self.action_space = (self.env.metadata, self.env.observation_space,
                                                                    self.env.action_space)
        self.first: str | None = None
        self.named: str | None = None
        self.start_agent = None

    def reset(self, seed=None, options=None):
        observation, info = self.env.reset(seed=seed)
        if self.ask == "swapped":
            others = sorted(name for name in self.env.targets if name != self.env.goal)
            self.env.goal = others[np.random.default_rng([seed, 7]).integers(len(others))]
            self.env.task = f"move to the {self.env.goal} target"
            info = dict(info, task=self.env.task)
        self.first, self.named, self.start_agent = None, self.env.goal, self.env.agent.copy()
        return observation, info

    def step(self, action):
        observation, _, _, truncated, info = self.env.step(action)
        for name, position in self.env.targets.items():
            if self.first is None and np.linalg.norm(self.env.agent - position) < self.env.success_radius:
                self.first = name
        done = self.first is not None
        info = dict(info, is_success=self.first == self.named)
        return observation, float(done), done, truncated and not done, info

    def render(self):
        return self.env.render()

    def close(self):
        pass

    @property
    def unwrapped(self):
        return self.env


class _Asking:
    """A processor that asks for one advantage indicator (True, False, None) in every call."""

    def __init__(self, processor, advantage):
        self._processor, self._advantage = processor, advantage

    def __getattr__(self, name):
        return getattr(self._processor, name)

    def __call__(self, *args, **kwargs):
        kwargs["advantage"] = self._advantage
        return self._processor(*args, **kwargs)


def closed_loop(weights: Path, episodes: int, ask: str = "true", advantage="auto", cfg_beta=None,
                envs: int = 16, env_kwargs: dict | None = None, **runner_kwargs) -> dict:
    """`episodes` held-out episodes; the named-target rate (success), the other-target rate, none reached.
    `runner_kwargs`: more `PolicyRunner` settings (best-of-N's `best_of`, `selector`, `critic`)."""
    import torch

    from hf_vla.deployment.contract import read
    from hf_vla.envs.episodes import EpisodeRunner
    from hf_vla.serving.policy import ObservationMap, load_policy

    torch.set_num_threads(int(_env()["OMP_NUM_THREADS"]))
    contract = read(weights)
    runner = load_policy(weights, obs_map=ObservationMap(cameras=["observation.image"]), cfg_beta=cfg_beta,
                         **runner_kwargs)
    if advantage != "auto":
        runner.processor = _Asking(runner.processor, advantage)
    slots = [_Tracked(ask, image_size=32, max_steps=40, **(env_kwargs or {})) for _ in range(envs)]
    outcomes = []
    loop = EpisodeRunner(slots, runner, n_action_steps=contract.n_action_steps, chunk_size=runner.model.config.chunk_size)
    original = loop._finish

    def finish(slot, output_dir):
        outcomes.append("named" if slot.env.first == slot.env.named else "none" if slot.env.first is None else "other")
        return original(slot, output_dir)

    loop._finish = finish
    loop.run(list(range(SEED, SEED + episodes)), progress=False)
    counts = {key: outcomes.count(key) / len(outcomes) for key in ("named", "other", "none")}
    return {"named_target_rate": round(counts["named"], 4), "decoy_rate": round(counts["other"], 4),
            "none_rate": round(counts["none"], 4), "success": round(counts["named"], 4), "episodes": len(outcomes)}


def first_chunk_aim(weights: Path, episodes: int, ask: str) -> float:
    """Open loop: the share of scenes whose first chunk's summed displacement points (highest cosine) at the target
    the prompt names."""
    import torch

    from hf_vla.serving.policy import ObservationMap, load_policy

    torch.set_num_threads(int(_env()["OMP_NUM_THREADS"]))
    runner = load_policy(weights, obs_map=ObservationMap(cameras=["observation.image"]))
    hits = 0
    for seed in range(SEED, SEED + episodes):
        env = _Tracked(ask, image_size=32, max_steps=40)
        observation, info = env.reset(seed=seed)
        runner.reset(seed=seed)
        chunk = runner(observation, task=info["task"])
        move = np.asarray(chunk).sum(0)
        aims = {name: float(np.dot(move, p - env.env.agent) / (np.linalg.norm(move) * np.linalg.norm(p - env.env.agent)
                                                                + 1e-9)) for name, p in env.env.targets.items()}
        hits += max(aims, key=aims.get) == env.named
    return round(hits / episodes, 4)


def stage_probe(results: dict, episodes: int) -> None:
    start = WORK / "start"
    results["start"] = {"prompt_probe": {
        "first_chunk_aims_at_named_true": first_chunk_aim(start, episodes, "true"),
        "first_chunk_aims_at_named_swapped": first_chunk_aim(start, episodes, "swapped"),
        "closed_loop_true": closed_loop(start, episodes, "true"),
        "closed_loop_swapped": closed_loop(start, episodes, "swapped"),
        "aims_at_swapped_target": None}}
    probe = results["start"]["prompt_probe"]
    probe["aims_at_swapped_target"] = probe["closed_loop_swapped"]["named_target_rate"]


def stage_data() -> None:
    from hf_vla.envs.recording import RecordArguments, record

    if not (WORK / "expert_200" / "meta" / "info.json").exists():
        record(RecordArguments(env="color_reach", output=WORK / "expert_200", episodes=200, seed=20_000),
               progress=True)
    if not (WORK / "decoy_200" / "meta" / "info.json").exists():
        record(RecordArguments(env="color_reach", output=WORK / "decoy_200", episodes=200, seed=30_000),
               env_kwargs={"decoy": True}, progress=True)


def _train(datasets: list[dict], out: Path, steps: int, *extra: str) -> float:
    """From the start at one schedule: warmup 100 steps to a peak of 3e-4, cosine to 10% (`--arm_steps`)."""
    if (out / "model.safetensors").exists():
        return 0.0
    return _run([sys.executable, "-m", "hf_vla.train", str(REPO / "configs" / "demo.json"), "--model_name_or_path",
                 str(WORK / "start"), "--model_config", "null", "--norm_stats_from", str(WORK / "start"),
                 "--datasets", json.dumps(datasets), "--generate_demo_data", "false", "--validation_ratio", "0",
                 "--max_steps", str(steps), "--learning_rate", "3e-4", "--lr_scheduler_type", "cosine_with_min_lr",
                 "--lr_scheduler_kwargs", json.dumps({"min_lr_rate": 0.1}), "--warmup_steps", "100",
                 "--output_dir", str(out), "--disable_tqdm", "true", "--stream_open_blocks", "64", *extra],
                out.with_suffix(".log"))


def _train_value(datasets: list[dict], out: Path) -> float:
    """A value model from the start's backbone: 600 steps, warmup 50 to 3e-4, cosine (skipped where it exists)."""
    if (out / "model.safetensors").exists():
        return 0.0
    return _run([sys.executable, "-m", "hf_vla.train", str(REPO / "configs" / "demo.json"), "--policy", "pi05_value",
                 "--model_name_or_path", str(WORK / "start"), "--model_config", "null", "--datasets",
                 json.dumps(datasets), "--generate_demo_data", "false", "--validation_ratio", "0", "--max_steps", "600",
                 "--learning_rate", "3e-4", "--lr_scheduler_type", "cosine", "--lr_scheduler_kwargs", "{}",
                 "--warmup_steps", "50", "--output_dir", str(out), "--disable_tqdm", "true"], out.with_suffix(".log"))


def _cross_fitted(value_datasets, prefix: Path, datasets: list[dict], annotated: Path, positive_fraction: str,
                  log: Path) -> tuple[list[float], float]:
    """Two value models from the start's backbone at `{prefix}0` and `{prefix}1`, each on `value_datasets(fold)` (the
    episodes of that fold held out), then `recap annotate` of `datasets` with both into `annotated`: every episode
    judged by the model that did not train on it. Each step skipped where its output exists; -> the seconds of each
    value model and of the annotation."""
    folds = [Path(f"{prefix}{fold}") for fold in range(2)]
    seconds = [_train_value(value_datasets(fold), out) for fold, out in enumerate(folds)]
    if annotated.exists():
        return seconds, 0.0
    return seconds, _run([sys.executable, "-m", "hf_vla.recap", "annotate", "--value", *map(str, folds), "--datasets",
                          json.dumps(datasets), "--positive_fraction", positive_fraction, "--output", str(annotated)],
                         log)


def stage_arms(results: dict, steps: int) -> None:
    expert, decoy = WORK / "expert_200", WORK / "decoy_200"
    timings = results.setdefault("arm_seconds", {})
    timings["bc_mixture"] = _train([_dataset(expert, "expert"), _dataset(decoy, "decoy")], WORK / "bc_mixture", steps)
    oracle = [_dataset(expert, "expert", advantage={"value": True, "dropout": 0.3}),
              _dataset(decoy, "decoy", advantage={"value": False, "dropout": 0.3})]
    timings["oracle_text"] = _train(oracle, WORK / "oracle_text", steps, "--model_config",
                                    json.dumps({"advantage_indicator": "text"}))
    timings["oracle_embedding"] = _train(oracle, WORK / "oracle_embedding", steps, "--model_config",
                                         json.dumps({"advantage_indicator": "embedding"}))
    # the learned value: two value models, each holding out one fold of both datasets, then annotate
    annotated = WORK / "annotated"
    seconds, annotate = _cross_fitted(
        lambda fold: [_dataset(expert, "expert", success=True, hold_out_fold=[fold, 2]),
                      _dataset(decoy, "decoy", success=False, hold_out_fold=[fold, 2])], WORK / "value_fold",
        [_dataset(expert, "expert", success=True), _dataset(decoy, "decoy", success=False)], annotated, "0.5",
        WORK / "annotate.log")
    timings["value_fold0"], timings["value_fold1"] = seconds
    if annotate:
        timings["annotate"] = annotate
    learned = [_dataset(annotated / "expert", "expert", advantage={"key": "advantage_positive", "dropout": 0.3}),
               _dataset(annotated / "decoy", "decoy", advantage={"key": "advantage_positive", "dropout": 0.3})]
    timings["learned_value"] = _train(learned, WORK / "learned_value", steps)
    results["label_agreement"] = _label_agreement(annotated)
    results.setdefault("diagnostics", {})["mechanism_annotation"] = positive_rates(annotated)


def positive_rates(annotated: Path) -> dict:
    """An annotation's positive rate by episode outcome and by frame index (tenths of the 40-step limit)."""
    import pandas as pd
    import pyarrow.parquet as pq

    columns = ["episode_index", "frame_index", "advantage_positive", "next.success"]
    parts = [p for p in sorted(annotated.rglob("*.parquet")) if "data" in p.parts]
    frame = pd.concat(pq.read_table(p, columns=[c for c in columns if c in pq.read_schema(p).names]).to_pandas()
                      for p in parts)
    out = {"positive_rate": round(float(frame["advantage_positive"].mean()), 4)}
    if "next.success" in frame:
        success = frame.groupby("episode_index")["next.success"].transform("any")
        out["by_outcome"] = {name: round(float(frame["advantage_positive"][rows].mean()), 4) if rows.any() else None
                             for name, rows in (("success", success), ("failure", ~success))}
    bins = (frame["frame_index"] // 4).clip(upper=9) * 4
    out["by_frame_index"] = {f"{int(b)}-{int(b) + 3}": round(float(v), 4)
                             for b, v in frame.groupby(bins)["advantage_positive"].mean().items()}
    return out


def _label_agreement(annotated: Path) -> dict:
    """How often the learned annotation says positive on the experts' frames and on the decoys' frames."""
    import pyarrow.parquet as pq

    rates = {}
    for name in ("expert", "decoy"):
        values = np.concatenate([pq.read_table(p, columns=["advantage_positive"])["advantage_positive"].to_numpy()
                                 for p in sorted((annotated / name / "data").rglob("*.parquet"))])
        rates[f"positive_rate_{name}"] = round(float(values.mean()), 4)
    return rates


def _scene_chunks(seed: int, chunk: int, **env_kwargs):
    """A held-out scene (its first observation and task) with the scripted expert's first `chunk` actions towards the
    named target and a decoy expert's towards another one (`env_kwargs`: the layout, ...)."""
    import copy

    from hf_vla.envs.reach import ColorReachWithExpert

    out = []
    for decoy in (False, True):
        env = ColorReachWithExpert(seed, decoy=decoy, image_size=32, max_steps=40, **env_kwargs)
        observation, info = env.reset(seed=seed)
        rollout, actions = copy.deepcopy(env), []
        for _ in range(chunk):
            action = rollout.expert_action()
            actions.append(action)
            rollout.step(action)
        out.append((observation, info["task"], np.stack(actions)))
    return out


def diagnostics(weights: Path, scenes: int) -> dict:
    """On held-out scenes, with one noise and time per sample: the flow MSE of the expert's chunk (label positive) and
    of a decoy's (label negative) with the true and the flipped indicator, and ||v_c - v_u|| / ||v_u|| (asked positive
    against no indicator) on the expert's."""
    import torch

    from hf_vla.hub.resolve import load_pretrained

    torch.set_num_threads(int(_env()["OMP_NUM_THREADS"]))
    model, processor = load_pretrained(weights)
    model.eval()
    config, generator = model.config, torch.Generator().manual_seed(0)
    sums = {"true": [], "flipped": []}
    ratios = []
    for seed in range(SEED, SEED + scenes):
        for label, (observation, task, actions) in zip((True, False), _scene_chunks(seed, config.chunk_size)):
            noise = torch.randn(1, config.chunk_size, config.max_action_dim, generator=generator)
            t = torch.rand(1, generator=generator) * 0.9 + 0.05
            velocities = {}
            for name, asked in (("true", label), ("flipped", not label), ("none", None)):
                inputs = processor(images=torch.from_numpy(observation["observation.image"]).permute(2, 0, 1)[None],
                                   text=[task], state=observation["observation.state"][None],
                                   actions=torch.from_numpy(actions)[None], advantage=asked)
                target = inputs["actions"]
                x_t = t[:, None, None] * noise + (1 - t[:, None, None]) * target
                keys = ("input_ids", "attention_mask", "pixel_values", "pixel_attention_mask", "advantage_ids")
                with torch.no_grad():
                    v = model(noise=x_t, timestep=t, **{k: inputs[k] for k in keys if k in inputs}).logits
                velocities[name] = v
                if name != "none":
                    sums[name].append(float(((noise - target - v)[..., : actions.shape[-1]] ** 2).mean()))
            if label:
                ratios.append(float((velocities["true"] - velocities["none"]).norm() / velocities["none"].norm()))
    return {"flow_mse_true_indicator": round(float(np.mean(sums["true"])), 5),
            "flow_mse_flipped_indicator": round(float(np.mean(sums["flipped"])), 5),
            "velocity_change_positive_vs_none": round(float(np.mean(ratios)), 4), "scenes": scenes}


def stage_evaluate(results: dict, episodes: int) -> None:
    arms = results.setdefault("arms", {})
    arms["bc_mixture"] = closed_loop(WORK / "bc_mixture", episodes, advantage="auto")
    for arm in ("oracle_text", "oracle_embedding", "learned_value"):
        weights = WORK / arm
        results.setdefault("diagnostics", {})[arm] = diagnostics(weights, min(episodes, 100))
        arms[arm] = {"positive": closed_loop(weights, episodes, advantage=True),
                     "negative": closed_loop(weights, episodes, advantage=False),
                     "no_indicator": closed_loop(weights, episodes, advantage=None),
                     "guided": closed_loop(weights, episodes, advantage="auto", cfg_beta=2.5),
                     "cfg_beta_0": closed_loop(weights, episodes, advantage="auto", cfg_beta=0.0)}


# ---- the plateau: a start that reads its prompt, on targets anywhere (layout "random") ------------------------------
PLATEAU = {"layout": "random"}


def stage_collect(results: dict, episodes: int) -> None:
    """The start acting alone on the plateau (`--strategy policy`): every episode kept with `next.success`."""
    from hf_vla.envs.recording import RecordArguments, record

    out = WORK / "collected"
    if not (out / "meta" / "info.json").exists():
        record(RecordArguments(env="color_reach", output=out, episodes=episodes, seed=40_000, strategy="policy",
                               policy=str(WORK / "start")), env_kwargs=dict(PLATEAU), progress=True)
    results["collected"] = {"episodes": episodes, "success": round(_success_rate(out), 4)}


def _success_rate(root: Path) -> float:
    import pandas as pd
    import pyarrow.parquet as pq

    frame = pd.concat(pq.read_table(p, columns=["episode_index", "next.success"]).to_pandas()
                      for p in sorted((root / "data").rglob("*.parquet")))
    return float(frame.groupby("episode_index")["next.success"].any().mean())


def _labelled_copy(root: Path, out: Path, label) -> Path:
    """`root` with a per-frame `advantage_positive` column from `label(episode, frames)` -> bool `[n]` (frames: the
    episode's table), written as annotate writes it."""
    if (out / "meta" / "info.json").exists():
        return out
    from hf_vla.data.dataset_config import DatasetConfig
    from hf_vla.data.sources import LeRobotSource
    from hf_vla.recap.annotate import _write

    source = LeRobotSource(DatasetConfig(**_dataset(root, "x")), 0)
    per_frame = {}
    for row, episode in enumerate(source.episodes["episode_index"].tolist()):
        table = source._episode_rows(episode, row, int(source.episodes["length"][row]),
                                     ["episode_index", "observation.state", "next.success"]).to_pandas()
        nan = np.full(len(table), np.nan)
        per_frame[episode] = {"return": nan, "value": nan, "advantage": nan,
                              "positive": np.asarray(label(episode, table), dtype=bool)}
    _write(source, out, per_frame, {"labels": "benchmark oracle"})
    return out


def _dense_labels(seed0: int):
    """A step is positive where it moved at least 0.05 towards the named target (the scene from its episode seed:
    `--strategy policy` keeps every episode, so episode e ran seed `seed0 + e`)."""
    from hf_vla.envs.reach import ColorReachEnv

    def label(episode, table):
        env = ColorReachEnv(image_size=32, max_steps=40, **PLATEAU)
        env.reset(seed=seed0 + episode)
        goal = env.targets[env.goal]
        states = np.stack(table["observation.state"].to_numpy())
        distance = np.linalg.norm(states - goal, axis=1)
        progress = np.r_[distance[:-1] - distance[1:], 0.0]  # the last frame: no next state
        return progress >= 0.05

    return label


def _experience(size: int) -> tuple[Path, str, int]:
    """The start's own plateau episodes: `collected` (200, seeds from 40,000), or `collected_{size}` (seeds from
    60,000); the folder, the suffix its arms' folders carry and the first seed."""
    if size == 200:
        return WORK / "collected", "", 40_000
    out = WORK / f"collected_{size}"
    if not (out / "meta" / "info.json").exists():
        from hf_vla.envs.recording import RecordArguments, record

        record(RecordArguments(env="color_reach", output=out, episodes=size, seed=60_000, strategy="policy",
                               policy=str(WORK / "start")), env_kwargs=dict(PLATEAU), progress=True)
    return out, f"_{size}", 60_000


def stage_oracle_arms(results: dict, steps: int, episodes: int, seeds: list[int], save,
                      only: list[str] | None = None, experience: int = 200, guided: bool = False) -> None:
    """From the start at matched steps and data, on the demonstrations and the collected episodes: BC with collected,
    filtered BC, episode-outcome labels, dense per-step labels, constant "positive" and a learned (cross-fitted)
    value model's annotation; each evaluated on the plateau (and the conditioned ones at cfg_beta 2.5 with
    `guided`). `experience` other than 200: that many of the start's episodes, figures under
    `oracle_arms_{experience}`."""
    expert = WORK / "expert_200"
    collected, tag, seed0 = _experience(experience)
    outcome = _labelled_copy(collected, WORK / f"labels_outcome{tag}", lambda e, t: np.full(
        len(t), bool(t["next.success"].any())))
    dense = _labelled_copy(collected, WORK / f"labels_dense{tag}", _dense_labels(seed0))
    constant = _labelled_copy(collected, WORK / f"labels_constant{tag}", lambda e, t: np.ones(len(t), bool))
    import pandas as pd
    import pyarrow.parquet as pq

    table = pd.concat(pq.read_table(p, columns=["episode_index", "next.success"]).to_pandas()
                      for p in sorted((collected / "data").rglob("*.parquet")))
    wins = sorted(int(e) for e, ok in table.groupby("episode_index")["next.success"].any().items() if ok)
    keep = {str(e): [[0, 10_000]] for e in wins}
    learned = WORK / f"plateau_annotated{tag}"
    if only is None or "learned_value" in only:
        _cross_fitted(lambda fold: [_dataset(expert, "expert", success=True, hold_out_fold=[fold, 2]),
                                    _dataset(collected, "collected", hold_out_fold=[fold, 2])],
                      WORK / f"plateau_value{tag}_fold", [_dataset(collected, "collected")], learned, "0.4",
                      WORK / f"plateau_annotate{tag}.log")
        results.setdefault("diagnostics", {})[f"plateau_annotation{tag}"] = positive_rates(learned)
    positive = {"advantage": {"value": True, "dropout": 0.3}}
    by_key = {"advantage": {"key": "advantage_positive", "dropout": 0.3}}
    arms = {
        "continued_bc": [_dataset(expert, "expert")],
        "bc_with_collected": [_dataset(expert, "expert"), _dataset(collected, "collected")],
        "filtered_bc": [_dataset(expert, "expert"), _dataset(collected, "collected", keep_ranges=keep)],
        "outcome_labels": [_dataset(expert, "expert", **positive), _dataset(outcome, "collected", **by_key)],
        "dense_oracle": [_dataset(expert, "expert", **positive), _dataset(dense, "collected", **by_key)],
        "constant_positive": [_dataset(expert, "expert", **positive), _dataset(constant, "collected", **by_key)],
        "learned_value": [_dataset(expert, "expert", **positive), _dataset(learned, "collected", **by_key)],
    }
    found = results.setdefault(f"oracle_arms{tag}", {})
    if tag:
        found["experience"] = {"episodes": experience, "success": round(_success_rate(collected), 4)}
    for name in only or list(arms):
        datasets = arms[name]
        per_seed, per_seed_guided = [], []
        for seed in seeds:
            out = WORK / f"arm_{name}{tag}_seed{seed}"
            _train(datasets, out, steps, "--seed", str(seed))
            per_seed.append(closed_loop(out, episodes, env_kwargs=PLATEAU)["success"])
            if guided and "advantage" in datasets[0]:
                per_seed_guided.append(closed_loop(out, episodes, cfg_beta=2.5, env_kwargs=PLATEAU)["success"])
        found[name] = {"mean_success": round(float(np.mean(per_seed)), 4), "per_seed": per_seed,
                       "episodes": episodes, "seeds": seeds, "steps": steps}
        if per_seed_guided:
            found[name]["cfg_beta_2.5"] = round(float(np.mean(per_seed_guided)), 4)
        save()  # each arm as it ends
        print(json.dumps({name: found[name]}), flush=True)


def _runtime(out: Path) -> float:
    """A training run's own wall seconds (`all_results.json`'s train_runtime)."""
    return float(json.loads((out / "all_results.json").read_text())["train_runtime"])


def stage_headline(results: dict, steps: int, episodes: int, save, per_round: int = 200) -> None:
    """RECAP two rounds on the plateau against continued BC and BC with RECAP's collected episodes, each given RECAP's
    wall minutes (every job alone, the same threads): a round collects 200 episodes of the current policy, trains two
    cross-fitted value models on the demonstrations and everything collected, annotates everything collected, and
    trains the policy from the start (the base) on all of it. BC arms get the steps their measured rate fits in those
    minutes (less the collection for BC with collected: the episodes are RECAP's). `per_round` other than 200: that
    many episodes a round, figures under `headline_{per_round}`."""
    from hf_vla.envs.recording import RecordArguments, record

    expert, tag = WORK / "expert_200", "" if per_round == 200 else f"_{per_round}"
    found = results.setdefault(f"headline{tag}", {})
    seconds = {"collection": 0.0, "value": 0.0, "annotate": 0.0, "policy": 0.0}
    policy, collected = WORK / "start", []
    rounds = []
    for index in (1, 2):
        base = WORK / f"headline{tag}_round{index}"
        rollouts = base / "collected"
        if not (rollouts / "meta" / "info.json").exists():
            started = time.perf_counter()
            record(RecordArguments(env="color_reach", output=rollouts, episodes=per_round,
                                   seed=100_000 + 10_000 * index if tag else 50_000 + 1_000 * index,
                                   strategy="policy", policy=str(policy)), env_kwargs=dict(PLATEAU), progress=False)
            seconds["collection"] += time.perf_counter() - started
        collected.append(rollouts)
        names = [f"round{i + 1}" for i in range(len(collected))]
        annotated = base / "annotated"
        value, annotate = _cross_fitted(lambda fold, names=names: [_dataset(expert, "expert", success=True)] + [
            _dataset(root, name, hold_out_fold=[fold, 2]) for root, name in zip(collected, names)],
            base / "value_fold", [_dataset(r, n) for r, n in zip(collected, names)], annotated, "0.4",
            base / "annotate.log")
        seconds["value"] += sum(value)
        seconds["annotate"] += annotate
        parts = [annotated] if len(collected) == 1 else [annotated / name for name in names]
        datasets = [_dataset(expert, "expert", advantage={"value": True, "dropout": 0.3})] + [
            _dataset(part, name, advantage={"key": "advantage_positive", "dropout": 0.3})
            for part, name in zip(parts, names)]
        policy = base / "policy"
        _train(datasets, policy, steps)
        seconds["policy"] += _runtime(policy)
        rounds.append({"collected_success": round(_success_rate(rollouts), 4),
                       "positive_by_outcome": _positive_by_outcome(annotated, names)})
    total = sum(seconds.values())
    found["recap"] = {**closed_loop(policy, episodes, env_kwargs=PLATEAU), "rounds": rounds,
                      "seconds": {k: round(v, 1) for k, v in seconds.items()}, "minutes": round(total / 60, 2)}
    save()
    rate = steps / _runtime(policy)  # BC trains at the rate the RECAP policy did (the same model and batch)
    arms = {"continued_bc": ([_dataset(expert, "expert")], total),
            "bc_with_collected": ([_dataset(expert, "expert")] + [_dataset(r, n) for r, n in zip(collected, names)],
                                  total - seconds["collection"])}
    for name, (datasets, budget) in arms.items():
        out = WORK / f"headline{tag}_{name}"
        budget_steps = int(rate * budget)
        _train(datasets, out, budget_steps)
        found[name] = {**closed_loop(out, episodes, env_kwargs=PLATEAU), "steps": budget_steps,
                       "minutes": round(budget / 60, 2)}
        save()


def stage_guidance(results: dict, episodes: int, save) -> None:
    """On the plateau, each conditioned policy asked with no indicator (= cfg_beta 0), "positive" (cfg_beta 1, its
    default) and "positive" at cfg_beta 2.5: does the indicator move the plateau at all?"""
    policies = {"recap": WORK / "headline_round2" / "policy",
                **{arm: WORK / f"arm_{arm}_seed0" for arm in ("outcome_labels", "dense_oracle", "learned_value")}}
    found = results.setdefault("guidance_on_plateau", {})
    for name, weights in policies.items():
        if not weights.exists():
            continue
        found[name] = {"cfg_beta_0": closed_loop(weights, episodes, advantage=None, env_kwargs=PLATEAU)["success"],
                       "cfg_beta_1": closed_loop(weights, episodes, env_kwargs=PLATEAU)["success"],
                       "cfg_beta_2.5": closed_loop(weights, episodes, cfg_beta=2.5, env_kwargs=PLATEAU)["success"],
                       "episodes": episodes}
        save()
        print(json.dumps({name: found[name]}), flush=True)


def stage_corrections(results: dict, steps: int, episodes: int, save, threshold: float = 0.1) -> None:
    """RECAP's corrections on the plateau: 200 episodes of the start with the scripted expert taking over for 4 steps
    wherever the policy's action departs from its own by more than a step's length (HG-DAgger's gate:
    `hf_vla.record --strategy dagger --takeover_threshold 0.1`), annotated by two cross-fitted value models (the
    interventions positive). From the start at equal steps: the advantage-conditioned policy on the executed actions
    (`recap_corrections`), behaviour cloning on the same executed actions (`bc_executed`), and the DAgger aggregate
    (`dagger_labels`: the expert's label at every visited state, which a person taking over does not give).
    `threshold` other than 0.1: a gate that lets the policy stray further (fewer corrections), figures under
    `corrections_{threshold}`, without the DAgger aggregate."""
    from hf_vla.envs.recording import RecordArguments, record

    tag = "" if threshold == 0.1 else f"_{threshold:g}"
    expert, rollouts = WORK / "expert_200", WORK / f"corrections{tag}"
    if not (rollouts / "meta" / "info.json").exists():
        record(RecordArguments(env="color_reach", output=rollouts, episodes=200, seed=70_000, strategy="dagger",
                               policy=str(WORK / "start"), takeover_threshold=threshold, takeover_steps=4),
               env_kwargs=dict(PLATEAU), progress=True)
    executed = {"action_key": "executed_action"}
    annotated = WORK / f"corrections{tag}_annotated"
    _cross_fitted(lambda fold: [_dataset(expert, "expert", success=True),
                                _dataset(rollouts, "corrections", hold_out_fold=[fold, 2])],
                  WORK / f"corrections{tag}_value_fold", [_dataset(rollouts, "corrections")], annotated, "0.4",
                  WORK / f"corrections{tag}_annotate.log")
    import pandas as pd
    import pyarrow.parquet as pq

    table = pd.concat(pq.read_table(p, columns=["episode_index", "intervention", "next.success"]).to_pandas()
                      for p in sorted((rollouts / "data").rglob("*.parquet")))
    found = results.setdefault(f"corrections{tag}", {})
    found["collected"] = {"episodes": int(table["episode_index"].nunique()),
                          "success": round(float(table.groupby("episode_index")["next.success"].any().mean()), 4),
                          "intervention_rate": round(float(table["intervention"].astype(float).mean()), 4)}
    found["annotation"] = positive_rates(annotated)
    arms = {
        "recap_corrections": [_dataset(expert, "expert", advantage={"value": True, "dropout": 0.3}),
                              _dataset(annotated, "corrections", **executed,
                                       advantage={"key": "advantage_positive", "dropout": 0.3})],
        "bc_executed": [_dataset(expert, "expert"), _dataset(rollouts, "corrections", **executed)],
        "dagger_labels": [_dataset(expert, "expert"), _dataset(rollouts, "corrections")],
    }
    if tag:
        arms.pop("dagger_labels")
    for name, datasets in arms.items():
        out = WORK / f"arm_{name}{tag}_seed0"
        _train(datasets, out, steps, "--seed", "0")
        found[name] = {**closed_loop(out, episodes, env_kwargs=PLATEAU), "steps": steps}
        if "advantage" in datasets[0]:
            found[name]["cfg_beta_2.5"] = closed_loop(out, episodes, cfg_beta=2.5, env_kwargs=PLATEAU)["success"]
        save()
        print(json.dumps({name: found[name]}), flush=True)


def _positive_by_outcome(annotated: Path, names: list[str]) -> dict:
    summary = annotated / "meta" / "hf_vla_recap.json"
    entries = json.loads(summary.read_text()) if summary.exists() else json.loads(
        (annotated / "hf_vla_recap.json").read_text())
    entries = entries if isinstance(entries, list) else [entries]
    return {entry["dataset"]: entry["positive_fraction_by_outcome"] for entry in entries}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stage", choices=["start", "probe", "data", "arms", "evaluate", "plateau", "collect",
                                            "oracle_arms", "headline", "guidance", "corrections", "all"], default="all")
    parser.add_argument("--seeds", default="0,1", help="training seeds of the oracle arms")
    parser.add_argument("--episodes", type=int, default=200, help="held-out episodes per evaluation")
    parser.add_argument("--arm_steps", type=int, default=1500, help="training steps of every arm")
    parser.add_argument("--arms", default=None, help="oracle_arms: the arms to run, in this order (default: all)")
    parser.add_argument("--experience", type=int, default=200, help="oracle_arms: the start's plateau episodes")
    parser.add_argument("--guided", action="store_true", help="oracle_arms: also evaluate at cfg_beta 2.5")
    parser.add_argument("--rollouts", type=int, default=200, help="headline: episodes collected a round")
    parser.add_argument("--takeover_threshold", type=float, default=0.1, help="corrections: the expert's gate")
    args = parser.parse_args()
    WORK.mkdir(parents=True, exist_ok=True)
    everything = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    results = everything.setdefault("mechanism", {})
    results["settings"] = {"episodes": args.episodes, "arm_steps": args.arm_steps, "prompt_tokens": PROMPT_TOKENS,
                           "machine": "2-core CPU, no GPU"}

    def save():
        RESULTS.write_text(json.dumps(everything, indent=1) + "\n")

    stages = ["start", "probe", "data", "arms", "evaluate", "plateau", "collect", "oracle_arms", "headline",
              "guidance", "corrections"] if args.stage == "all" else [args.stage]
    for stage in stages:
        if stage == "start":
            stage_start(results)
        elif stage == "probe":
            stage_probe(results, args.episodes)
        elif stage == "data":
            stage_data()
        elif stage == "arms":
            stage_arms(results, args.arm_steps)
        elif stage == "evaluate":
            stage_evaluate(results, args.episodes)
        elif stage == "plateau":  # the start on the plateau: targets anywhere
            results["plateau_start"] = closed_loop(WORK / "start", args.episodes, env_kwargs=PLATEAU)
        elif stage == "collect":
            stage_collect(results, 200)
        elif stage == "oracle_arms":
            stage_oracle_arms(results, args.arm_steps, args.episodes, [int(s) for s in args.seeds.split(",")], save,
                              args.arms.split(",") if args.arms else None, args.experience, args.guided)
        elif stage == "headline":
            stage_headline(results, args.arm_steps, args.episodes, save, args.rollouts)
        elif stage == "guidance":
            stage_guidance(results, args.episodes, save)
        elif stage == "corrections":
            stage_corrections(results, args.arm_steps, args.episodes, save, args.takeover_threshold)
        save()
        print(json.dumps({stage: {k: v for k, v in results.items() if k != "settings"}}, indent=1), flush=True)


if __name__ == "__main__":
    main()
