"""Which noise picks a ColorReach policy's target: the initial noise x_1, or the Flow-SDE steps' noise.

    python -m benchmarks.closed_loop.rl_mode_choice CHECKPOINT [--starts 60] [--samples 16] [--noise_level 0.5]

Flow-SDE's likelihood (what `hf_vla.rl` differentiates) covers the K Gaussian denoising steps, not the initial noise
x_1. If x_1 alone chose between the targets, a policy gradient on that likelihood could not credit the choice. On
`--starts` held-out starts (seeds from 10,000) the checkpoint's first chunk is sampled `--samples` times three ways:
the deterministic sampler with x_1 varying; the SDE with x_1 fixed and the steps' noise varying; both varying. The
target a chunk goes for is the one its executed actions (the contract's `n_action_steps`), summed, point at. Printed
as JSON: per way, the mean share of samples off each start's most frequent target, the starts where the choice varies
at all, and how often the deterministic sampler's first chunk goes for the named target.
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint")
    parser.add_argument("--starts", type=int, default=60)
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--noise_level", type=float, default=0.5)
    parser.add_argument("--schedule", default="flow_sde", help="the SDE steps' noise schedule (hf_vla.rl.flow.FlowSDE: "
                        "flow_sde keeps the policy's marginals, constant does not)")
    args = parser.parse_args()

    from hf_vla.deployment import contract as deployment
    from hf_vla.deployment.contract import head_spec
    from hf_vla.evaluation.envs import make_env
    from hf_vla.hub.resolve import load_pretrained
    from hf_vla.rl.flow import FlowSDE, sample_chain
    from hf_vla.serving.policy import ObservationMap, PolicyRunner, batch_requests

    torch.manual_seed(0)
    model, processor = load_pretrained(args.checkpoint)
    contract = deployment.read(args.checkpoint)
    n_action_steps = contract.n_action_steps if contract else model.config.chunk_size
    runner = PolicyRunner(model=model, processor=processor, obs_map=ObservationMap(cameras=["observation.image"]))
    config, B = model.config, args.samples
    K = config.num_inference_steps
    shape = (B, config.chunk_size, config.max_action_dim)
    # the env as the checkpoint's recording made it (layout, image size), as evaluation and RL make it
    recorded = (head_spec(contract, None) or {}).get("benchmark") or {}
    kwargs = dict(recorded.get("env_kwargs") or {}) | ({"image_size": contract.image_size} if contract else {})
    env = make_env("hf_vla/ColorReach-v0", None, kwargs, worker=False).unwrapped

    def targets(inputs, request, x1, step_noise, noise_level):
        chain, _ = sample_chain(model, inputs, x1, step_noise, FlowSDE(K, noise_level, args.schedule))
        names, out = list(env.targets), []
        for i in range(B):
            move = np.asarray(runner.finish(request, chain[i, -1]))[:n_action_steps].sum(0)
            aims = [env.targets[name] - env.agent for name in names]
            cosines = [move @ a / (np.linalg.norm(move) * np.linalg.norm(a) + 1e-9) for a in aims]
            out.append(names[int(np.argmax(cosines))])
        return out

    off = {"deterministic_x1_varies": [], "sde_x1_fixed": [], "sde_both_vary": []}
    named = []
    for seed in range(10_000, 10_000 + args.starts):
        observation, _ = env.reset(seed=seed)
        request = runner.prepare(observation, env.task)
        inputs, _ = batch_requests([request], "cpu")
        inputs = {k: v.repeat(B, *[1] * (v.dim() - 1)) for k, v in inputs.items()}
        x1, none = torch.randn(shape), torch.zeros(B, K, *shape[1:])
        ways = {"deterministic_x1_varies": targets(inputs, request, x1, none, 0.0),
                "sde_x1_fixed": targets(inputs, request, x1[:1].repeat(B, 1, 1), torch.randn(B, K, *shape[1:]),
                                        args.noise_level),
                "sde_both_vary": targets(inputs, request, torch.randn(shape), torch.randn(B, K, *shape[1:]),
                                         args.noise_level)}
        for way, chosen in ways.items():
            off[way].append(1 - np.unique(chosen, return_counts=True)[1].max() / B)
        named.append(np.mean([c == env.goal for c in ways["deterministic_x1_varies"]]))
    print(json.dumps({
        "checkpoint": args.checkpoint, "starts": args.starts, "samples": B, "noise_level": args.noise_level,
        "schedule": args.schedule,
        "n_action_steps": n_action_steps,
        "share_off_the_most_frequent_target": {k: round(float(np.mean(v)), 3) for k, v in off.items()},
        "starts_where_the_choice_varies": {k: int(np.sum(np.array(v) > 0)) for k, v in off.items()},
        "deterministic_first_chunk_goes_for_the_named_target": round(float(np.mean(named)), 3)}, indent=2))


if __name__ == "__main__":
    main()
