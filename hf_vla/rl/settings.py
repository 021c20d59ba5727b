"""What RL rollouts run with: env, tasks, image size, episode limit, actions per chunk, cameras and head, taken from
the start checkpoint's deployment contract (`hf_vla.deployment.contract`) as `hf_vla.evaluate` takes them, so the policy is
improved under the settings it is deployed with; a field of `RLConfig` that contradicts the contract is refused by
the same check as evaluate's flags."""

from __future__ import annotations

from hf_vla.errors import ConfigError


def rollout_settings(args, processor, config) -> dict:
    from hf_vla.deployment.contract import DeploymentConfig, head_spec
    from hf_vla.envs.settings import EnvRequest, env_arguments, evaluation_settings
    from hf_vla.evaluation.envs import check_env, env_tasks
    from hf_vla.serving.policy import stat_dims

    contract = None
    if getattr(processor, "deployment", None):
        try:
            contract = DeploymentConfig.from_dict(processor.deployment)
        except ValueError as error:
            raise ConfigError(str(error)) from error
    env_kwargs = dict(args.env_kwargs or {})
    settings = evaluation_settings(contract, EnvRequest(
        args.env, args.task, args.eval_episodes, n_action_steps=args.n_action_steps,
        image_size=env_kwargs.pop("image_size", None),
        max_episode_steps=args.max_episode_steps or env_kwargs.pop("max_episode_steps", None)), config.chunk_size)
    env, task = settings["env"].value, settings["task"].value
    check_env(env, task, "env=", "task=")
    spec = head_spec(contract, settings["head"].value)
    env_kwargs = env_arguments(spec, settings, env_kwargs)  # as evaluation resolves them
    if settings["max_episode_steps"].value is not None:
        env_kwargs["max_episode_steps"] = settings["max_episode_steps"].value
    try:
        head = processor._head(settings["head"].value)
    except (KeyError, ValueError, IndexError) as error:
        raise ConfigError(f"head: {error}") from error
    return {
        "env": env, "tasks": env_tasks(env, task), "env_kwargs": env_kwargs,
        "n_action_steps": int(settings["n_action_steps"].value), "cameras": settings["cameras"].value or None,
        "camera_slots": len(spec["cameras"]) if spec else None, "head": head,
        "action_dims": stat_dims(processor.norm_stats[head]["actions"]),
        "max_episode_steps": settings["max_episode_steps"].value,
    }
