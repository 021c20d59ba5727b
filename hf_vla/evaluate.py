"""Closed-loop evaluation of a checkpoint in a gymnasium env with LeRobot-style observations.

    python -m hf_vla.evaluate --checkpoint outputs/demo --env hf_vla/ColorReach-v0 --episodes 50

Loads the policy with `AutoModel` (pi0.5) and its `PI05Processor`, runs episodes with receding-horizon action chunks
(`--n_action_steps` of each predicted chunk are executed), reports the success rate (`info["is_success"]`) with a
progress bar, and saves the first few rollouts as animated GIFs.
"""

from __future__ import annotations

import argparse
import json
import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path

import gymnasium as gym
import numpy as np
import torch
from PIL import Image
from tqdm.auto import tqdm

logger = logging.getLogger("hf_vla.evaluate")


@dataclass
class EvalResult:
    success_rate: float
    episodes: int
    successes: int
    mean_steps: float
    videos: list[str] = field(default_factory=list)


def _camera_keys(observation: dict, cameras: list[str] | None) -> list[str]:
    if cameras:
        missing = [c for c in cameras if c not in observation]
        if missing:
            raise KeyError(f"camera key(s) {missing} not in the observation; it has {sorted(observation)}")
        return cameras
    keys = sorted(k for k, v in observation.items() if isinstance(v, np.ndarray) and v.ndim == 3)
    if not keys:
        raise KeyError(f"no image in the observation (keys {sorted(observation)}); pass cameras")
    return keys


class PolicyRunner:
    """Observation + task -> un-normalized action chunk, with the processor of the checkpoint."""

    def __init__(self, model, processor, head=None, cameras: list[str] | None = None, num_camera_slots: int | None = None,
                 state_key: str = "observation.state", device: str = "cpu", seed: int = 0):
        self.model, self.processor, self.head = model.eval().to(device), processor, head
        self.cameras, self.num_camera_slots = cameras, num_camera_slots
        self.state_key, self.device = state_key, device
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, observation: dict, task: str) -> np.ndarray:
        cameras = _camera_keys(observation, self.cameras)
        images = torch.stack([torch.from_numpy(np.ascontiguousarray(observation[c])).permute(2, 0, 1) for c in cameras])
        slots = self.num_camera_slots or len(cameras)
        mask = torch.zeros(slots, dtype=torch.bool)
        mask[: len(cameras)] = True
        if slots > len(cameras):
            images = torch.cat([images, torch.zeros(slots - len(cameras), *images.shape[1:], dtype=images.dtype)])
        return self.predict(images[None], np.asarray(observation[self.state_key])[None], [task], mask[None])[0]

    @torch.no_grad()
    def predict(self, images: torch.Tensor, states: np.ndarray, tasks: list[str], camera_mask: torch.Tensor) -> np.ndarray:
        """A batch: uint8 images [B, cams, 3, H, W], raw states [B, d], tasks, camera_mask [B, cams] -> chunks
        [B, chunk, max_action_dim], un-normalized."""
        inputs = self.processor(images=images, text=tasks, state=states, head=self.head, camera_mask=camera_mask)
        config = self.model.config
        noise = torch.randn(len(tasks), config.chunk_size, config.max_action_dim, generator=self.generator)
        chunk = self.model.sample_actions(
            input_ids=inputs["input_ids"].to(self.device), attention_mask=inputs["attention_mask"].to(self.device),
            pixel_values=inputs["pixel_values"].to(self.device),
            pixel_attention_mask=inputs["pixel_attention_mask"].to(self.device), noise=noise.to(self.device),
        )
        return self.processor.unnormalize_actions(chunk.float().cpu(), self.head).numpy()


def run_episodes(env: gym.Env, policy: PolicyRunner, episodes: int, n_action_steps: int, seed: int = 0,
                 save_videos: int = 0, output_dir: str | Path | None = None, progress: bool = True) -> EvalResult:
    successes, steps_taken, videos = 0, [], []
    bar = tqdm(range(episodes), desc="closed-loop episodes", unit="ep", disable=not progress)
    for episode in bar:
        observation, info = env.reset(seed=seed + episode)
        task = info.get("task") or getattr(env.unwrapped, "task", "")
        frames = [env.render()] if episode < save_videos else None
        done, success, steps = False, False, 0
        while not done:
            chunk = policy(observation, task)
            for action in chunk[:n_action_steps]:
                observation, _, terminated, truncated, info = env.step(action)
                steps += 1
                if frames is not None:
                    frames.append(env.render())
                success = success or bool(info.get("is_success", False))
                done = terminated or truncated
                if done:
                    break
        successes += success
        steps_taken.append(steps)
        bar.set_postfix(success=f"{successes}/{episode + 1}")
        if frames is not None and output_dir is not None:
            path = Path(output_dir) / f"rollout_{episode:03d}_{'success' if success else 'failure'}.gif"
            path.parent.mkdir(parents=True, exist_ok=True)
            pictures = [Image.fromarray(f).resize((f.shape[1] * 4, f.shape[0] * 4), Image.NEAREST) for f in frames]
            pictures[0].save(path, save_all=True, append_images=pictures[1:], duration=100, loop=0)
            videos.append(str(path))
    return EvalResult(successes / episodes, episodes, successes, float(np.mean(steps_taken)), videos)


def evaluate_checkpoint(checkpoint: str | Path, env_id: str = "hf_vla/ColorReach-v0", episodes: int = 50,
                        n_action_steps: int | None = None, seed: int = 10_000, head=None, cameras=None,
                        save_videos: int = 3, output_dir: str | Path | None = None, device: str = "cpu",
                        env_kwargs: dict | None = None, progress: bool = True) -> EvalResult:
    from transformers import AutoModel

    import hf_vla  # noqa: F401  (registers pi05 and the demo env)
    import hf_vla.envs  # noqa: F401

    from .models.pi05 import PI05Processor

    model = AutoModel.from_pretrained(checkpoint)
    processor = PI05Processor.from_pretrained(checkpoint)
    env = gym.make(env_id, **(env_kwargs or {}))
    runner = PolicyRunner(model, processor, head=head, cameras=cameras, device=device, seed=seed)
    steps = n_action_steps or max(1, model.config.chunk_size // 2)
    output_dir = Path(output_dir) if output_dir else Path(checkpoint) / "rollouts"
    result = run_episodes(env, runner, episodes, steps, seed=seed, save_videos=save_videos, output_dir=output_dir,
                          progress=progress)
    (output_dir).mkdir(parents=True, exist_ok=True)
    (output_dir / "eval_result.json").write_text(json.dumps(asdict(result), indent=2))
    return result


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m hf_vla.evaluate", description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", required=True, help="model + processor directory (or Hub id)")
    parser.add_argument("--env", default="hf_vla/ColorReach-v0", help="gymnasium env id")
    parser.add_argument("--episodes", type=int, default=50)
    parser.add_argument("--n_action_steps", type=int, default=None, help="actions executed per chunk")
    parser.add_argument("--seed", type=int, default=10_000, help="first episode seed (training data used 0..)")
    parser.add_argument("--head", default=None, help="normalization head (default: the processor's only one)")
    parser.add_argument("--cameras", nargs="*", default=None, help="observation image keys, in camera-slot order")
    parser.add_argument("--save_videos", type=int, default=3)
    parser.add_argument("--output_dir", default=None)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    result = evaluate_checkpoint(args.checkpoint, args.env, args.episodes, args.n_action_steps, args.seed, args.head,
                                 args.cameras, args.save_videos, args.output_dir, args.device)
    print(json.dumps(asdict(result), indent=2))


if __name__ == "__main__":
    main()
