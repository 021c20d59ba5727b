"""The envs evaluation runs: the catalogue (gymnasium ids, Meta-World, LIBERO, their tasks and cameras), building
them in worker processes, and the checks of a policy against an env (action dims, image size, cameras)."""

from __future__ import annotations

import logging

import gymnasium as gym

from hf_vla.deployment.contract import FILE_NAME, ContractError, refuse_repeated_cameras
from hf_vla.envs.settings import benchmark_tasks, check_env, env_tasks
from hf_vla.errors import ConfigError
from hf_vla.registry import task_env

logger = logging.getLogger("hf_vla.evaluate")


def _make_envs(env_id: str, task: str | None, num_envs: int, env_kwargs: dict, max_episode_steps: int | None,
               worker: bool | None = None):
    """`num_envs` envs of `env_id` (a benchmark task, or a gymnasium id): one gymnasium env in this process, else
    (or with `worker`) each in a worker process (hf_vla.envs.worker)."""
    kwargs = dict(env_kwargs) | ({"max_episode_steps": max_episode_steps} if max_episode_steps else {})
    return [make_env(env_id, task, kwargs, worker=num_envs > 1 if worker is None else worker) for _ in range(num_envs)]


def make_env(env_id: str, task: str | None, kwargs: dict, worker: bool):
    """One env of `env_id`: a benchmark task (always in a worker process), else a gymnasium env in a worker process
    (`worker`) or in this one."""
    import functools

    from hf_vla.envs.worker import InWorker, make_gym

    family = task_env(env_id)
    if family is not None:
        return family.call("make", task, **kwargs)
    try:
        if not worker:
            return make_gym(env_id, **kwargs)
        return InWorker(functools.partial(make_gym, env_id, **kwargs), name=env_id)
    except (gym.error.Error, TypeError) as error:
        raise ConfigError(f"env {env_id!r}: {error}") from error


def _close(envs) -> None:
    for env in envs:
        try:
            env.close()
        except Exception:  # noqa: BLE001  (a worker that died: nothing left to close)
            logger.debug("closing an env failed", exc_info=True)


def _check_image_size(env, spec: dict | None, settings: dict, where: str) -> None:
    """The env's images are the size the checkpoint's data was recorded at (an env that takes no image size)."""
    if spec is None or settings["image_size"].value is not None:
        return
    spaces = getattr(env.observation_space, "spaces", {})
    for camera in spec["cameras"]:
        space = spaces.get(camera.get("key"))
        if space is None or camera.get("height") is None:
            continue
        height, width = space.shape[:2]
        if (height, width) != (camera["height"], camera["width"]):
            raise ContractError(f"{where} renders {camera['key']} at {height}x{width}, but the checkpoint's data was "
                                f"recorded at {camera['height']}x{camera['width']} ({FILE_NAME}); pass --override "
                                f"image_size to run it anyway")


def env_camera_keys(env: str, env_kwargs: dict | None = None) -> list[str]:
    """The image keys an env's observations carry (a benchmark's from its wrapper; a gymnasium env's from its
    observation space: every HxWxC array). Meta-World's follow its `cameras` argument; without `env_kwargs`, every
    key one of its cameras can have."""
    family = task_env(env)
    if family is not None and family.cameras:
        return list(family.call("cameras", env_kwargs))
    made = gym.make(env)
    try:
        spaces = getattr(made.observation_space, "spaces", {})
        return sorted(key for key, space in spaces.items() if len(getattr(space, "shape", None) or ()) == 3)
    finally:
        made.close()


def check_cameras(flag: str, cameras: list[str] | None, available: list[str]) -> None:
    """`cameras` (camera-slot order) name distinct image keys the env has; one line naming the culprit otherwise."""
    if not cameras:
        return
    refuse_repeated_cameras(flag, cameras)
    unknown = [key for key in cameras if key not in available]
    if unknown:
        raise ConfigError(f"{flag}: {unknown} {'is not an image' if len(unknown) == 1 else 'are not images'} of the "
                          f"env's observations; it has {available}")


__all__ = ["benchmark_tasks", "check_cameras", "check_env", "env_camera_keys", "env_tasks", "make_env"]
