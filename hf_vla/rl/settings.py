"""What RL rollouts run with: env, tasks, image size, episode limit, actions per chunk, cameras and head, taken from
the start checkpoint's deployment contract (`hf_vla.deployment.contract`) as `hf_vla.evaluate` takes them, so the policy is
improved under the settings it is deployed with; a field of `RLConfig` that contradicts the contract is refused by
the same check as evaluate's flags."""

from __future__ import annotations

from hf_vla.errors import ConfigError


def rollout_settings(args, processor, config) -> dict:
    from hf_vla.deployment.contract import DeploymentConfig
    from hf_vla.envs.settings import EnvRequest, plan_env
    from hf_vla.serving.policy import stat_dims

    contract = None
    if getattr(processor, "deployment", None):
        try:
            contract = DeploymentConfig.from_dict(processor.deployment)
        except ValueError as error:
            raise ConfigError(str(error)) from error
    env_kwargs = dict(args.env_kwargs or {})
    plan = plan_env(contract, EnvRequest(
        args.env, args.task, args.eval_episodes, n_action_steps=args.n_action_steps,
        image_size=env_kwargs.pop("image_size", None),
        max_episode_steps=args.max_episode_steps or env_kwargs.pop("max_episode_steps", None)), config.chunk_size,
        env_kwargs)  # as evaluation resolves them
    env_kwargs = plan.env_kwargs
    if plan.value("max_episode_steps") is not None:
        env_kwargs["max_episode_steps"] = plan.value("max_episode_steps")
    try:
        head = processor._head(plan.value("head"))
    except (KeyError, ValueError, IndexError) as error:
        raise ConfigError(f"head: {error}") from error
    return {
        "env": plan.env, "tasks": plan.tasks, "env_kwargs": env_kwargs,
        "n_action_steps": int(plan.value("n_action_steps")), "cameras": plan.value("cameras") or None,
        "camera_slots": len(plan.spec["cameras"]) if plan.spec else None, "head": head,
        "action_dims": stat_dims(processor.norm_stats[head]["actions"]),
        "max_episode_steps": plan.value("max_episode_steps"), "memory_stride": plan.value("memory_stride"),
    }
