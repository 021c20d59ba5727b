"""First-move decision accuracy of a ColorReach checkpoint: does the policy read the instruction?

    python -m benchmarks.closed_loop.demo_decision outputs/demo [--starts 300] [--seed 10000]

Closed-loop success needs many rollouts and mixes two skills (choosing the target, then reaching it). This measures
the first one alone, in seconds: for `--starts` fresh env starts (env seeds from `--seed`; the demo data uses seeds
0..999, so the default is held out), the policy predicts one chunk, and its first 4 actions, summed, give a heading.
The chosen target is the one whose direction from the agent is closest to that heading. Reported:

- `first_move_accuracy`: chosen == the named target (chance is 1 / num_targets);
- `follows_swapped_instruction`: the same starts with the instruction naming another target present in the image;
  chosen == that one. A policy that ignores language stays near chance here even when the image alone lets it guess
  well on the true instruction.

Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch
from transformers import AutoModel

import hf_vla  # noqa: F401  (registers pi05)
from hf_vla.envs.reach import ColorReachEnv
from hf_vla.models.pi05 import PI05Processor
from hf_vla.serving.policy import PolicyRunner

HEADING_ACTIONS = 4


def headings(runner: PolicyRunner, images, states, tasks, batch_size: int = 100) -> np.ndarray:
    """Sum of the first HEADING_ACTIONS predicted actions (xy) per start."""
    out = []
    for i in range(0, len(tasks), batch_size):
        sl = slice(i, i + batch_size)
        chunks = runner.predict(images[sl], states[sl], tasks[sl], torch.ones(len(tasks[sl]), 1, dtype=torch.bool))
        out.append(chunks[:, :HEADING_ACTIONS, :2].sum(axis=1))
    return np.concatenate(out)


def chosen_targets(heading: np.ndarray, starts: list[dict]) -> list[str]:
    """Per start, the target whose unit direction from the agent has the largest dot product with the heading."""
    chosen = []
    for h, start in zip(heading, starts):
        names = list(start["targets"])
        directions = np.stack([start["targets"][name] - start["agent"] for name in names])
        alignment = directions @ h / np.linalg.norm(directions, axis=1)
        chosen.append(names[int(np.argmax(alignment))])
    return chosen


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint")
    parser.add_argument("--starts", type=int, default=300)
    parser.add_argument("--seed", type=int, default=10_000, help="first env seed (demo data uses 0..999)")
    args = parser.parse_args(argv)

    begin = time.perf_counter()
    model = AutoModel.from_pretrained(args.checkpoint).eval()
    processor = PI05Processor.from_pretrained(args.checkpoint)
    env = ColorReachEnv()
    rng = np.random.default_rng(args.seed)
    starts, images, states = [], [], []
    for seed in range(args.seed, args.seed + args.starts):
        observation, info = env.reset(seed=seed)
        others = [name for name in env.targets if name != env.goal]
        starts.append({"targets": dict(env.targets), "agent": env.agent.copy(), "goal": env.goal,
                       "swapped": str(rng.choice(others))})
        images.append(torch.from_numpy(observation["observation.image"]).permute(2, 0, 1)[None])
        states.append(observation["observation.state"])
    images, states = torch.stack(images), np.stack(states)

    result = {"checkpoint": str(args.checkpoint), "starts": args.starts, "chance": 1 / env.num_targets}
    for key, goal_key in (("first_move_accuracy", "goal"), ("follows_swapped_instruction", "swapped")):
        tasks = [f"move to the {start[goal_key]} target" for start in starts]
        runner = PolicyRunner(model, processor, seed=0)  # the same noise for both instructions
        chosen = chosen_targets(headings(runner, images, states, tasks), starts)
        result[key] = float(np.mean([c == start[goal_key] for c, start in zip(chosen, starts)]))
    result["seconds"] = round(time.perf_counter() - begin, 1)
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
