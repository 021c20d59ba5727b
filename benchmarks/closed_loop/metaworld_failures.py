"""Where a Meta-World policy fails: the geometry of its held-out episodes on reach-v3 and push-v3.

    python -m benchmarks.closed_loop.metaworld_failures --checkpoint data_cache/metaworld_bench/hf_vla --episodes 50

The checkpoint runs as `hf_vla.evaluate` runs it (the one episode loop, its deployment contract: image size, episode
limit, actions per chunk; seeds from 10,000, deterministic sampling), with the env's hidden state read at every step:
the hand, the goal and (push) the puck. Printed as JSON:

- reach: the final hand-to-goal distance (success is <= 5 cm) and how far the final hand position follows the goal:
  the least-squares slope of final hand on goal per axis (1: the hand goes where the goal is; 0: the same place
  whatever the goal) and the success a goal-blind policy would have (goals within 5 cm of the mean final hand);
- push: the closest the hand came to the puck (and how often within 5 cm), the final puck-to-goal distance against
  the starting one (success is <= 5 cm), and the final hand-to-goal distance in the table's plane (small when the arm
  goes to the goal marker instead of the puck).

A perception failure (the policy does not locate the goal or the puck in the image) reads as slopes near 0 and
goal-blind success near the policy's; a control failure as slopes near 1 with final distances just over 5 cm.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")


class Traced:
    """A `MetaWorldEnv` that keeps the hand, goal and object positions of each of its episodes, by seed."""

    def __init__(self, env, traces: dict):
        self.env, self.traces, self.seed = env, traces, None

    def __getattr__(self, name):
        return getattr(self.env, name)

    def _state(self) -> dict:
        inner = self.env.inner._env
        raw = self.env.inner.raw_obs
        return {"hand": np.asarray(raw[:3], dtype=float).tolist(), "object": np.asarray(raw[4:7], dtype=float).tolist(),
                "goal": np.asarray(inner._target_pos, dtype=float).tolist()}

    def reset(self, *, seed=None, options=None):
        out = self.env.reset(seed=seed, options=options)
        self.seed = seed
        self.traces[seed] = {"states": [self._state()], "success": False}
        return out

    def step(self, action):
        out = self.env.step(action)
        trace = self.traces[self.seed]
        trace["states"].append(self._state())
        trace["success"] = trace["success"] or bool(out[4].get("is_success"))
        return out


def slope(x: np.ndarray, y: np.ndarray) -> float:
    x = x - x.mean()
    return float((x * (y - y.mean())).sum() / max((x * x).sum(), 1e-12))


def reach_summary(traces: dict) -> dict:
    goal = np.array([t["states"][0]["goal"] for t in traces.values()])
    hand = np.array([t["states"][-1]["hand"] for t in traces.values()])
    dist = np.linalg.norm(hand - goal, axis=1)
    blind = np.linalg.norm(goal - hand.mean(axis=0), axis=1)
    return {"success": float(np.mean([t["success"] for t in traces.values()])),
            "final_distance_m": {"median": float(np.median(dist)), "mean": float(dist.mean()),
                                 "within_10cm": float((dist <= 0.10).mean())},
            "final_hand_on_goal_slope": {axis: round(slope(goal[:, i], hand[:, i]), 3) for i, axis in enumerate("xyz")},
            "goal_spread_m": {axis: round(float(goal[:, i].std()), 3) for i, axis in enumerate("xyz")},
            "goal_blind_success": float((blind <= 0.05).mean())}


def push_summary(traces: dict) -> dict:
    rows = []
    for t in traces.values():
        hand = np.array([s["hand"] for s in t["states"]])
        puck = np.array([s["object"] for s in t["states"]])
        goal = np.array(t["states"][0]["goal"])
        rows.append({"success": t["success"], "closest_hand_puck": float(np.linalg.norm(hand - puck, axis=1).min()),
                     "final_puck_goal": float(np.linalg.norm(puck[-1, :2] - goal[:2])),
                     "start_puck_goal": float(np.linalg.norm(puck[0, :2] - goal[:2])),
                     "final_hand_goal_xy": float(np.linalg.norm(hand[-1, :2] - goal[:2]))})
    closest = np.array([r["closest_hand_puck"] for r in rows])
    return {"success": float(np.mean([r["success"] for r in rows])),
            "closest_hand_to_puck_m": {"median": float(np.median(closest)), "touched_within_5cm": float((closest <= 0.05).mean())},
            "final_puck_to_goal_m": {"median": float(np.median([r["final_puck_goal"] for r in rows])),
                                     "start_median": float(np.median([r["start_puck_goal"] for r in rows]))},
            "final_hand_to_goal_xy_m": {"median": float(np.median([r["final_hand_goal_xy"] for r in rows]))}}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--tasks", default="reach-v3,push-v3")
    parser.add_argument("--episodes", type=int, default=50)
    parser.add_argument("--seed", type=int, default=10_000)
    parser.add_argument("--output", default=None, help="also write the JSON here")
    args = parser.parse_args()

    from hf_vla.deployment.contract import head_spec
    from hf_vla.envs.metaworld import MetaWorldEnv
    from hf_vla.envs.settings import EnvRequest, evaluation_settings
    from hf_vla.evaluation.runner import ChunkTiming, run_episodes
    from hf_vla.hub.resolve import resolve_contract
    from hf_vla.serving.policy import ObservationMap, load_policy

    contract = resolve_contract(args.checkpoint)  # what hf_vla.evaluate would run it with
    settings = evaluation_settings(contract, EnvRequest("metaworld", args.tasks, args.episodes),
                                   contract.chunk_size if contract else None)
    image_size, limit = settings["image_size"].value, settings["max_episode_steps"].value
    steps = int(settings["n_action_steps"].value)
    spec = head_spec(contract, None)
    policy = load_policy(args.checkpoint, obs_map=ObservationMap(cameras=settings["cameras"].value or None),
                         num_camera_slots=len(spec["cameras"]) if spec else None)
    recorded = ((spec or {}).get("benchmark") or {}).get("env_kwargs") or {}  # a crop: rendered as it was recorded
    result = {"checkpoint": args.checkpoint, "episodes": args.episodes, "seeds_from": args.seed,
              "image_size": image_size, "max_episode_steps": limit, "n_action_steps": steps, "env_kwargs": recorded}
    for task in args.tasks.split(","):
        traces: dict = {}
        env = Traced(MetaWorldEnv(task, image_size=image_size, max_episode_steps=limit, **recorded), traces)
        run_episodes(env, policy, range(args.seed, args.seed + args.episodes),
                     ChunkTiming(steps, chunk_size=policy.model.config.chunk_size), progress=True)
        env.close()
        result[task] = (reach_summary if task.startswith("reach") else push_summary)(traces)
        print(json.dumps({task: result[task]}), flush=True)
    text = json.dumps(result, indent=2)
    print(text)
    if args.output:
        Path(args.output).write_text(text + "\n")


if __name__ == "__main__":
    main()
