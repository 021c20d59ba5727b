"""How far are a DAgger recording's chunk targets from what the expert would do? (Meta-World, issue #65)

    python -m benchmarks.closed_loop.dagger_labels data_cache/mw_dagger_arm/dagger/dagger_data_1 --chunk 16

A chunked policy trains on the chunk `[action_t, ..., action_{t+H-1}]` of each frame. In an expert recording those
are the expert's own next actions, so the chunk is the expert's plan from state t. In a DAgger recording each frame's
`action` is the expert's label at the state the *policy* reached, so the chunk strings together the expert's reactions
to states the policy's own later actions produced: not a plan anyone would execute from state t. This replays each
recorded episode from its seed with the actions that were executed (`policy_action`, or the expert's `action` where
`intervention` is 1), checks the replay reaches every recorded state, and at every frame compares the recorded chunk
with the expert's plan from that state (`MetaWorldEnv.expert_plan`: the expert simulated H steps ahead on the same
simulator, restored after). Offset 0 is the frame's own label, equal to the plan's first action by construction (the
check of the replay); the figures are over offsets 1..H-1 inside the episode. JSON per task: the mean absolute
difference per action dimension (xyz, gripper; actions are in [-1, 1]), the share of chunk steps where it exceeds 0.5
in some dimension, and the same for the plan against the expert's executed continuation (0: the expert recording).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np


def _episodes(root: Path) -> tuple[dict, list[dict]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    marker = json.loads((root / "meta" / "hf_vla_record.json").read_text())
    table = pa.concat_tables([pq.read_table(path) for path in sorted((root / "data").glob("*/*.parquet"))])
    episode_index = table["episode_index"].to_numpy()
    columns = {name: np.asarray(table[name].to_pylist(), dtype=np.float64) for name in
               ("observation.state", "action", "policy_action", "intervention")}
    episodes, index = [], 0
    for task, summary in marker["tasks"].items():  # the recording's order: task by task, episode by episode
        for entry in summary["episodes"]:
            rows = np.flatnonzero(episode_index == index)
            if len(rows) != entry["steps"]:
                raise SystemExit(f"{root}: episode {index} has {len(rows)} frames, its summary {entry['steps']}")
            episodes.append({"task": task, "seed": entry["seed"], "index": index,
                             **{name: values[rows] for name, values in columns.items()}})
            index += 1
    return marker, episodes


def label_gap(root: Path, chunk: int = 16, max_episodes: int | None = None) -> dict:
    from hf_vla.envs.metaworld import MetaWorldEnv

    marker, episodes = _episodes(root)
    per_task: dict[str, dict] = {}
    envs: dict[str, MetaWorldEnv] = {}
    for episode in episodes[:max_episodes]:
        task = episode["task"]
        env = envs.get(task) or envs.setdefault(task, MetaWorldEnv(task, image_size=marker.get("image_size", 96),
                                                                    **(marker.get("env_kwargs") or {})))
        observation, _ = env.reset(seed=episode["seed"])
        labels, n = episode["action"], len(episode["action"])
        executed = np.where(episode["intervention"].reshape(n, -1)[:, :1] > 0, episode["action"], episode["policy_action"])
        plans = []
        for t in range(n):
            if not np.allclose(observation["observation.state"], episode["observation.state"][t], atol=1e-5):
                raise SystemExit(f"{root}: episode {episode['index']} ({task}, seed {episode['seed']}) departs from "
                                 f"the recording at frame {t}: the replay does not reproduce it")
            plans.append(env.expert_plan(chunk))
            observation = env.step(executed[t])[0]
        stats = per_task.setdefault(task, {"episodes": 0, "gaps": [], "offset0": 0.0})
        stats["episodes"] += 1
        for t in range(n):
            real = min(chunk, n - t)
            stats["offset0"] = max(stats["offset0"], float(np.abs(plans[t][0] - labels[t]).max()))
            if real > 1:
                stats["gaps"].append(np.abs(plans[t][1:real] - labels[t + 1: t + real]))
    for env in envs.values():
        env.close()
    report = {"recording": str(root), "chunk": chunk, "tasks": {}}
    for task, stats in per_task.items():
        gaps = np.concatenate(stats["gaps"]) if stats["gaps"] else np.zeros((0, 4))
        report["tasks"][task] = {
            "episodes": stats["episodes"], "chunk_steps": len(gaps),
            "mean_abs_gap_xyz_gripper": [round(float(v), 4) for v in gaps.mean(0)] if len(gaps) else None,
            "share_over_0.5": round(float((gaps > 0.5).any(1).mean()), 4) if len(gaps) else None,
            "offset0_max_gap": round(stats["offset0"], 6)}
    every = [np.concatenate(s["gaps"]) for s in per_task.values() if s["gaps"]]
    if every:
        gaps = np.concatenate(every)
        report["mean_abs_gap_xyz_gripper"] = [round(float(v), 4) for v in gaps.mean(0)]
        report["share_over_0.5"] = round(float((gaps > 0.5).any(1).mean()), 4)
    return report


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("recording", type=Path, help="a DAgger recording (hf_vla.record --strategy dagger)")
    parser.add_argument("--chunk", type=int, default=16, help="the policy's chunk size (the training chunk)")
    parser.add_argument("--max_episodes", type=int, default=None)
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args(argv)
    report = label_gap(args.recording, args.chunk, args.max_episodes)
    text = json.dumps(report, indent=2)
    if args.output:
        args.output.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
