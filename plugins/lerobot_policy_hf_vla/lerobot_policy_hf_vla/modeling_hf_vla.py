"""`HFVLAPolicy`: an hf_vla checkpoint behind lerobot's `PreTrainedPolicy` interface.

The checkpoint runs as `hf_vla.evaluate` and `hf_vla.serve` run it (hf_vla's `PolicyRunner`: its processor's
normalisation and relative actions, its deployment contract's cameras, head and `n_action_steps`), so lerobot's
processors around it only batch and move tensors (`processor_hf_vla`). lerobot hands images as float `[B, 3, H, W]`
in [0, 1] (its `preprocess_observation` divides the uint8 frames by 255); they go back to uint8 exactly and, where
they are larger than the data the checkpoint was trained on, are cut by the recording's crop and resized as hf_vla's
envs resize (PIL bilinear), so a 480 px lerobot Meta-World frame becomes the recorded 96 or 128 px frame.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from pathlib import Path

import numpy as np
import torch
from lerobot.policies.pretrained import PreTrainedPolicy

from .configuration_hf_vla import HFVLAConfig


def checkpoint_of(config: HFVLAConfig, directory: str | Path | None, name: str | None = None) -> str:
    """The hf_vla checkpoint `config.checkpoint` (or `name`, the critic's) names: a directory relative to the
    lerobot-side `directory`, an absolute one, or a Hub id."""
    name = config.checkpoint if name is None else name
    path = Path(name).expanduser()
    if not path.is_absolute() and directory is not None and Path(directory).is_dir():
        path = Path(directory) / path
    return str(path.resolve()) if path.exists() else name


class HFVLAPolicy(PreTrainedPolicy):
    """lerobot's policy interface (`select_action`, `predict_action_chunk`, `reset`) over hf_vla's `PolicyRunner`."""

    config_class = HFVLAConfig
    name = "hf_vla"

    def __init__(self, config: HFVLAConfig, runner=None, contract=None, **kwargs):
        super().__init__(config)
        if runner is None:
            raise ValueError("HFVLAPolicy runs a trained hf_vla checkpoint: load it with HFVLAPolicy.from_pretrained("
                             "DIR) (a directory python -m hf_vla.convert --to lerobot_plugin wrote)")
        self.runner, self.contract = runner, contract
        self.model = runner.model  # a submodule: lerobot's device and parameter queries see the policy's weights
        spec = contract.head(config.head) if contract is not None else None
        self.spec = spec
        self.cameras = [c for c in spec["cameras"] if c["key"] is not None] if spec else None
        chunk = runner.model.config.chunk_size
        self.n_action_steps = config.n_action_steps or (contract.n_action_steps if contract else chunk // 2)
        if not 1 <= self.n_action_steps <= chunk:
            raise ValueError(f"n_action_steps={self.n_action_steps}: must be 1..{chunk} (the chunk size)")
        self._queue: deque = deque()

    @classmethod
    def from_pretrained(cls, pretrained_name_or_path, *, config: HFVLAConfig | None = None, **kwargs):
        from hf_vla.deployment.contract import served_cameras
        from hf_vla.hub.resolve import resolve_contract
        from hf_vla.serving.policy import ObservationMap, load_policy

        if config is None:
            config = HFVLAConfig.from_pretrained(pretrained_name_or_path)
        checkpoint = checkpoint_of(config, pretrained_name_or_path)
        contract = resolve_contract(checkpoint)
        cameras, slots = served_cameras(contract, config.head, None, None)
        # best-of-N: the plugin's fields over what the checkpoint's contract bundles (a critic loaded beside it)
        from hf_vla.serving.critic import plan_best_of

        critic = None if config.critic is None else checkpoint_of(config, pretrained_name_or_path, config.critic)
        best_of = plan_best_of(config.best_of, config.selector, critic, contract, checkpoint).runner_kwargs(
            config.device or "cpu")
        runner = load_policy(checkpoint, device=config.device or "cpu", head=config.head, seed=config.seed,
                             obs_map=ObservationMap(cameras=cameras or None), num_camera_slots=slots, **best_of)
        policy = cls(config, runner=runner, contract=contract)
        policy.check_features()
        return policy.eval()

    # ---- lerobot's env / robot features against the checkpoint's contract -----------------------------------------
    def check_features(self) -> None:
        """A camera the checkpoint reads that lerobot's features lack, or another state / action dimension: refused
        in one line naming both (features lerobot has not filled, e.g. before `make_policy` sets them, pass)."""
        if self.spec is None:
            return
        features = {**(self.config.input_features or {}), **(self.config.output_features or {})}
        if not features:
            return
        images = sorted(key for key, feature in features.items() if _kind(feature) == "VISUAL")
        wanted = [c["key"] for c in self.cameras]
        missing = [key for key in wanted if key not in images]
        if images and missing:
            raise ValueError(f"the checkpoint reads camera(s) {missing} (its cameras: {wanted}); lerobot's features "
                             f"have {images}: record or evaluate with those cameras, or rename them (--rename_map)")
        for role, kind, key in (("state", "STATE", "observation.state"), ("action", "ACTION", "action")):
            feature = features.get(key) or next((f for f in features.values() if _kind(f) == kind), None)
            dim = self.spec.get(role, {}).get("dim")
            if feature is not None and dim is not None and int(feature.shape[-1]) != int(dim):
                raise ValueError(f"lerobot's {role} feature has {int(feature.shape[-1])} dims; the checkpoint's "
                                 f"{role} ({self.spec[role].get('key')}) has {dim}")

    # ---- lerobot's PreTrainedPolicy -------------------------------------------------------------------------------
    def get_optim_params(self) -> dict:
        return self.model.parameters()

    def reset(self):
        self._queue.clear()
        self.runner.reset()
        self._row_runners = []  # a MEM policy's per-row runners (each env's own past), made at the episode's first call

    def _runners(self, rows: int) -> list:
        """The runner of each batch row: the policy's own, or for a MEM policy one per row (lerobot's vector envs:
        each its episode's past observations; reset with the policy at a rollout's start)."""
        if self.runner.memory is None:
            return [self.runner] * rows
        runners = getattr(self, "_row_runners", None) or []
        if len(runners) != rows:
            runners = self._row_runners = [dataclasses.replace(self.runner, seed=self.runner.seed + row)
                                           for row in range(rows)]
        return runners

    def forward(self, batch, **kwargs):
        raise NotImplementedError("an hf_vla policy trains with python -m hf_vla.train, not lerobot-train")

    @torch.no_grad()
    def predict_action_chunk(self, batch: dict, **kwargs) -> torch.Tensor:
        """`[B, chunk_size, action_dim]` actions in robot units, for lerobot's batch (images `[B, 3, H, W]` in [0, 1],
        `observation.state` `[B, D]`, `task`)."""
        observations, tasks = self._observations(batch)
        runners = self._runners(len(observations))
        prepared = [runner.prepare(obs, task) for runner, obs, task in zip(runners, observations, tasks)]
        chunks = self.runner.sample_batch(prepared)
        actions = [runner.finish(request, chunk) for runner, request, chunk in zip(runners, prepared, chunks)]
        return torch.as_tensor(np.stack(actions), dtype=torch.float32)

    @torch.no_grad()
    def select_action(self, batch: dict, **kwargs) -> torch.Tensor:
        """The next action `[B, action_dim]`: a new chunk is predicted when the last one's `n_action_steps` ran out."""
        if not self._queue:
            chunk = self.predict_action_chunk(batch)[:, : self.n_action_steps]
            self._queue.extend(chunk.transpose(0, 1))
        elif self.runner.memory is not None:  # a step between chunks: a MEM policy keeps its observation
            observations, _ = self._observations(batch)
            for runner, observation in zip(self._runners(len(observations)), observations):
                runner.observe(observation)
        return self._queue.popleft()

    # ---- lerobot's batch -> hf_vla observations -------------------------------------------------------------------
    def _observations(self, batch: dict) -> tuple[list[dict], list[str]]:
        state_key = (self.spec or {}).get("state", {}).get("key") or "observation.state"
        state = batch.get(state_key, batch.get("observation.state"))
        if state is None:
            raise ValueError(f"lerobot's batch has no state {state_key!r} (keys {sorted(batch)})")
        state = torch.as_tensor(state).detach().cpu().float().reshape(len(state), -1).numpy()
        size = len(state)
        cameras = self.cameras or [{"key": k, "height": None, "width": None} for k in sorted(batch)
                                   if k.startswith("observation.image")]
        images = {}
        for camera in cameras:
            key = camera["key"]
            if key not in batch:
                raise ValueError(f"lerobot's batch lacks the camera {key!r} the checkpoint reads (keys {sorted(batch)})")
            images[key] = [self._frame(frame, camera) for frame in torch.as_tensor(batch[key]).detach().cpu()]
        task = batch.get("task")
        tasks = list(task) if isinstance(task, list | tuple) else [task or ""] * size
        observations = [{**{key: frames[i] for key, frames in images.items()}, "observation.state": state[i]}
                        for i in range(size)]
        return observations, [str(t) for t in tasks]

    def _frame(self, frame: torch.Tensor, camera: dict) -> np.ndarray:
        """lerobot's float `[3, H, W]` in [0, 1] -> uint8 `[H, W, 3]` (exact for frames that were uint8), cut and
        resized to the recorded size as hf_vla's envs do when larger."""
        from hf_vla.envs.wrappers import render_to_observation

        if frame.dtype == torch.uint8:
            image = frame.permute(1, 2, 0).numpy()
        else:
            image = (frame.float() * 255.0).round().clamp(0, 255).to(torch.uint8).permute(1, 2, 0).numpy()
        height, width = camera.get("height"), camera.get("width")
        if height and width and height == width and image.shape[:2] != (height, width) and image.shape[0] > height:
            crop = (((self.spec or {}).get("benchmark") or {}).get("env_kwargs") or {}).get("crop")
            image = render_to_observation(image, crop, height)
        return np.ascontiguousarray(image)


def _kind(feature) -> str:
    kind = getattr(feature, "type", None)
    return getattr(kind, "name", str(kind))


__all__ = ["HFVLAPolicy", "checkpoint_of"]
