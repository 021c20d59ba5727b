"""Best-of-N with a learned chunk critic on ColorReach's plateau and the five Meta-World tasks (docs/best_of_n.md):

    python -m benchmarks.closed_loop.best_of_n                   # ColorReach: every stage, resumable
    python -m benchmarks.closed_loop.best_of_n --episodes 200    # fewer held-out episodes per arm
    python -m benchmarks.closed_loop.best_of_n --stage critic,decoys --critic_steps 4000 --negatives 0.5
                                                                 # another critic and its decoy test
    python -m benchmarks.closed_loop.best_of_n --stage critic,decoys,arms --data paired   # the oracle's data
    python -m benchmarks.closed_loop.best_of_n --bench metaworld --stage critic,arms --critic_steps 3000

ColorReach: the start and its experience are the RECAP mechanism's (`benchmarks.closed_loop.recap_mechanism`, shared
under `data_cache/recap_mechanism`): the demo recipe (1,000 expert episodes, 5,000 steps), which reads its prompt, on
targets anywhere (`layout: "random"`), where its chunks often go to another target than the named one; 200 of its own
episodes there (`next.success` each).

Stages (each skipped where its output exists; figures into `benchmarks/results/best_of_n_cpu.json`, merged key by
key so that several runs may write it):
- `critic`: a chunk critic (`policy pi05_chunk_critic`) from the start's backbone, on those 200 episodes and 200 expert
  episodes: each frame's executed chunk against the return that followed it (`--negatives`: that share of each batch
  reads another frame's chunk as a failure; `--data contrast` / `paired`: also 200 expert and 200 decoy-expert
  episodes on the plateau's layout, good and bad chunks in the same kind of scene or (paired) in the same scenes: the
  oracle's data); its CPU minutes and data, under `critics` by its steps, negatives and data;
- `decoys`: the mechanism, open loop: on 200 held-out scenes of each layout (the mechanism's corners, the plateau's
  random), the scripted expert's first chunk towards the named target against a decoy expert's towards another
  target; the share of scenes whose expert chunk the critic scores higher (chance 50%);
- `arms`: on `--episodes` held-out seeds of the plateau: `single` (one chunk), `random_of_8` (the first of 8
  candidates: one sample's behaviour at 8 chunks' cost), `medoid_best_of_8` under `arms`; `critic_best_of_8` and the
  critic's curve over N = 2, 4, 16 under `critic_arms[critic]`: success (the named target reached first), the
  other-target rate.

Meta-World (`--bench metaworld`): RECAP's start and its two rounds of collected episodes
(`benchmarks.closed_loop.recap`, `data_cache/recap_metaworld`); a critic on them and the demonstrations, and the same
four arms by `python -m hf_vla.evaluate` on `--mw_episodes` held-out seeds per task.
"""

from __future__ import annotations

import argparse
import json
import resource

from benchmarks.closed_loop import recap_mechanism as mechanism

REPO = mechanism.REPO
WORK = mechanism.WORK
RESULTS = REPO / "benchmarks" / "results" / "best_of_n_cpu.json"
CRITIC_STEPS = 1500


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def critic_name(steps: int, negatives: float, data: str = "own") -> str:
    return f"s{steps}_n{round(negatives * 100)}" + ("" if data == "own" else f"_{data}")


def contrast_data(paired: bool = False) -> list[dict]:
    """The oracle's data: 200 scripted-expert episodes on the plateau's layout and 200 of a decoy expert driving to
    another target than the named one (marked failures): good and bad chunks in the same kind of scene. `paired`: the
    decoy's episodes on the expert's own seeds (the same scenes: the same first observation, two chunks, two
    outcomes), so that only the chunk tells them apart."""
    from hf_vla.envs.recording import RecordArguments, record

    expert = WORK / "plateau_expert_200"
    decoy = WORK / ("plateau_decoy_paired_200" if paired else "plateau_decoy_200")
    for out, seed, extra in ((expert, 50_000, {}), (decoy, 50_000 if paired else 60_000, {"decoy": True})):
        if not (out / "meta" / "info.json").exists():
            record(RecordArguments(env="color_reach", output=out, episodes=200, seed=seed),
                   env_kwargs={**mechanism.PLATEAU, **extra}, progress=True)
    return [mechanism._dataset(expert, "plateau_expert"), mechanism._dataset(decoy, "plateau_decoy", success=False)]


def stage_critic(results: dict, steps: int, negatives: float, data: str = "own") -> None:
    """The chunk critic from the start's backbone, with the start's statistics (its candidates are read as sampled):
    warmup 50 steps to 3e-4, cosine. `data`: "own" (the start's 200 episodes and 200 expert ones) or "contrast" (those
    and `contrast_data`)."""
    datasets = [mechanism._dataset(WORK / "collected", "collected"), mechanism._dataset(WORK / "expert_200", "expert")]
    if data in ("contrast", "paired"):
        datasets += contrast_data(paired=data == "paired")
    name = critic_name(steps, negatives, data)
    out = WORK / f"chunk_critic_{name}"
    if (out / "model.safetensors").exists():
        return
    cpu = _children_cpu()
    seconds = mechanism._run([
        mechanism.sys.executable, "-m", "hf_vla.train", str(REPO / "configs" / "demo.json"), "--policy",
        "pi05_chunk_critic", "--model_name_or_path", str(WORK / "start"),
        "--model_config", json.dumps({"negative_chunks": negatives}),
        "--norm_stats_from", str(WORK / "start"), "--datasets", json.dumps(datasets), "--generate_demo_data", "false",
        "--validation_ratio", "0", "--max_steps", str(steps), "--learning_rate", "3e-4", "--lr_scheduler_type",
        "cosine", "--lr_scheduler_kwargs", "{}", "--warmup_steps", "50", "--output_dir", str(out),
        "--disable_tqdm", "true"], out.with_suffix(".log"))
    results.setdefault("critics", {})[name] = {
        "steps": steps, "negative_chunks": negatives, "wall_minutes": round(seconds / 60, 2),
        "cpu_minutes": round((_children_cpu() - cpu) / 60, 2),
        "data": {"collected": {"episodes": 200, "success": results.get("collected_success")},
                 "expert": {"episodes": 200, "success": 1.0},
                 **({"plateau_expert": {"episodes": 200, "success": 1.0},
                     "plateau_decoy": {"episodes": 200, "success": 0.0, "same_scenes_as_expert": data == "paired"}}
                    if data in ("contrast", "paired") else {})},
        "targets": "each frame's normalised return (steps to success; a failure costs the episode limit) with the "
                   "chunk executed from it"}


def stage_decoys(results: dict, scenes: int, name: str) -> None:
    """The critic's preference for the expert's chunk over a decoy's on the same held-out scene (open loop)."""
    import numpy as np
    import torch

    from hf_vla.serving.critic import load_critic
    from hf_vla.serving.policy import ObservationMap, load_policy, stat_dims

    scorer = load_critic(WORK / f"chunk_critic_{name}")
    runner = load_policy(WORK / "start", obs_map=ObservationMap(cameras=["observation.image"]), best_of=2,
                         critic=scorer, selector="critic")
    config, head = runner.model.config, runner.head_name()
    dims = stat_dims(runner.processor.norm_stats[head]["actions"])
    entry = results.setdefault("critics", {}).setdefault(name, {})
    if "scenes" in entry.get("decoys", {}):  # measured before the plateau's layout was: the corners'
        entry["decoys"] = {"corners": entry["decoys"]}
    decoys = entry.setdefault("decoys", {})
    for layout in ("corners", "random"):  # the RECAP mechanism's scenes, and the plateau's
        margins = []
        for seed in range(mechanism.SEED, mechanism.SEED + scenes):
            (observation, task, expert), (_, _, decoy) = mechanism._scene_chunks(seed, config.chunk_size,
                                                                                layout=layout)
            rows = runner.prepare(observation, task=task).rows
            chunks = torch.zeros(2, config.chunk_size, config.max_action_dim)
            for i, chunk in enumerate((expert, decoy)):
                chunks[i, :, :dims] = runner.processor.normalize(torch.as_tensor(chunk, dtype=torch.float32),
                                                                 "actions", head)
            values = scorer.scores(rows, head, chunks, dims)
            margins.append(float(values[0] - values[1]))
        margins = np.asarray(margins)
        decoys[layout] = {"scenes": scenes, "expert_preferred": round(float((margins > 0).mean()), 4),
                          "mean_margin": round(float(margins.mean()), 4)}


def stage_arms(results: dict, episodes: int, counts: list[int], name: str, curve: bool = True):
    """Every arm on the same held-out seeds: the critic-free ones under `arms`, the critic's under
    `critic_arms[name]`; an arm already measured at `episodes` is kept. `curve`: the critic's choice of N besides 8."""
    from hf_vla.serving.critic import load_critic

    plain = results.setdefault("arms", {})
    judged = results.setdefault("critic_arms", {}).setdefault(name, {})
    critic = load_critic(WORK / f"chunk_critic_{name}")
    # the headline arms first (one sample, the critic's and the medoid's choice of 8), then the critic's curve
    plans = {"single": {}, "critic_best_of_8": {"best_of": 8, "selector": "critic", "critic": critic},
             "medoid_best_of_8": {"best_of": 8, "selector": "medoid"},
             "random_of_8": {"best_of": 8, "selector": "first"}}
    if curve:
        plans |= {f"critic_best_of_{n}": {"best_of": n, "selector": "critic", "critic": critic} for n in counts
                  if n > 1 and n != 8}
    for arm, kwargs in plans.items():
        arms = judged if "critic" in kwargs else plain
        if arms.get(arm, {}).get("episodes") == episodes:
            continue
        cpu = _children_cpu() + sum(resource.getrusage(resource.RUSAGE_SELF)[:2])
        record = mechanism.closed_loop(WORK / "start", episodes, env_kwargs=mechanism.PLATEAU, **kwargs)
        used = _children_cpu() + sum(resource.getrusage(resource.RUSAGE_SELF)[:2]) - cpu
        arms[arm] = {"mean_success": record["success"], "episodes": record["episodes"],
                     "other_target_rate": record["decoy_rate"], "none_rate": record["none_rate"],
                     "cpu_minutes": round(used / 60, 2)}
        yield arm, arms[arm]
    judged["curve"] = {"1": plain.get("single", {}).get("mean_success")} | {
        str(n): judged.get(f"critic_best_of_{n}", {}).get("mean_success") for n in counts if n > 1}


def metaworld(everything: dict, stages: list[str], episodes: int, steps: int, negatives: float, save) -> None:
    """The five Meta-World tasks (RECAP's benchmark start, `benchmarks.closed_loop.recap --bench metaworld`): a chunk
    critic on RECAP's two rounds of collected episodes (200, the policies' own, 49% successful) and the demonstrations,
    then `single`, `random_of_8`, `medoid_best_of_8` and `critic_best_of_8` by `python -m hf_vla.evaluate` on
    `episodes` held-out seeds per task (from 10,000: the seeds of RECAP's evaluations; `single` is its `start` arm)."""
    import dataclasses

    from benchmarks.closed_loop import recap

    bench = dataclasses.replace(recap.BENCHES["metaworld"], episodes=episodes)
    results = everything.setdefault("metaworld_five_task", {})
    results["settings"] = {"episodes_per_task": episodes, "tasks": bench.tasks, "machine": "2-core CPU, no GPU",
                           "start": "RECAP's Meta-World start (benchmarks/results/recap_cpu.json)"}
    name = critic_name(steps, negatives)
    critic = bench.work / f"chunk_critic_{name}"
    if "critic" in stages and not (critic / "model.safetensors").exists():
        rounds = sorted(bench.work.glob("recap_round*/rollouts"))
        datasets = recap._demos(bench, success=True) + [recap._collected(bench, root, f"round{i + 1}")
                                                        for i, root in enumerate(rounds)]
        seconds, cpu, _ = recap._run([
            mechanism.sys.executable, "-m", "hf_vla.train", str(bench.config), "--policy", "pi05_chunk_critic",
            "--model_name_or_path", str(bench.work / "start"), "--model_config",
            json.dumps({"negative_chunks": negatives}), "--norm_stats_from", str(bench.work / "start"),
            "--datasets", json.dumps(datasets), "--generate_demo_data", "false", "--validation_ratio", "0",
            "--max_steps", str(steps), "--learning_rate", "3e-4", "--lr_scheduler_type", "cosine",
            "--lr_scheduler_kwargs", "{}", "--warmup_steps", "50", "--eval_strategy", "no", "--save_strategy", "no",
            "--disable_tqdm", "true", "--output_dir", str(critic)], critic.with_suffix(".log"), cpu=True)
        results.setdefault("critics", {})[name] = {
            "steps": steps, "negative_chunks": negatives, "wall_minutes": round(seconds / 60, 2),
            "cpu_minutes": round(cpu / 60, 2), "data": {"collected": {"episodes": len(rounds) * 100,
                                                                      "rounds": len(rounds)},
                                                        "demonstrations": "the start's, per task"}}
        save()
    if "arms" not in stages:
        return
    plain = results.setdefault("arms", {})
    judged = results.setdefault("critic_arms", {}).setdefault(name, {})
    plans = {"single": [], "critic_best_of_8": ["--best_of", "8", "--critic", str(critic)],
             "medoid_best_of_8": ["--best_of", "8", "--selector", "medoid"],
             "random_of_8": ["--best_of", "8", "--selector", "first"]}
    for arm, flags in plans.items():
        arms = judged if "--critic" in flags else plain
        if arms.get(arm, {}).get("episodes") == episodes * len(bench.tasks):
            continue
        earlier = bench.work / "eval_start" / "eval_result.json"  # RECAP's start arm: this command, these seeds
        if arm == "single" and earlier.exists() and all(
                task["episodes"] == episodes for task in json.loads(earlier.read_text())["tasks"].values()):
            found = json.loads(earlier.read_text())
            arms[arm] = {"mean_success": found["success_rate"], "episodes": episodes * len(bench.tasks),
                         "tasks": {task: r["success_rate"] for task, r in found["tasks"].items()},
                         "measured_by": "benchmarks.closed_loop.recap's start arm (the same evaluation)"}
            continue
        arms[arm] = recap.evaluate(bench, bench.work / "start", f"best_of_n_{arm}_{name}" if arms is judged
                                   else f"best_of_n_{arm}", *flags)
        save()
        print(json.dumps({arm: arms[arm]}), flush=True)


def _merged(old: dict, new: dict) -> dict:
    """`old` with `new`'s values, key by key into nested dicts (what `new` lacks is kept)."""
    out = dict(old)
    for key, value in new.items():
        out[key] = _merged(old[key], value) if isinstance(value, dict) and isinstance(old.get(key), dict) else value
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stage", default="all", help="all, or some of start, collect, critic, decoys, arms (commas)")
    parser.add_argument("--episodes", type=int, default=500, help="held-out episodes per arm")
    parser.add_argument("--critic_steps", type=int, default=CRITIC_STEPS)
    parser.add_argument("--negatives", type=float, default=0.0, help="the critic's negative_chunks share")
    parser.add_argument("--data", choices=["own", "contrast", "paired"], default="own", help="the critic's data: "
                        "the start's episodes and the expert's; or those and an expert's and a decoy's on the plateau "
                        "(oracle), the decoy's on other scenes (contrast) or on the expert's (paired)")
    parser.add_argument("--counts", default="2,4,8,16", help="the critic's candidate counts")
    parser.add_argument("--no_curve", action="store_true", help="the critic's choice of 8 only (not of 2, 4, 16)")
    parser.add_argument("--bench", choices=["colorreach", "metaworld"], default="colorreach")
    parser.add_argument("--mw_episodes", type=int, default=10, help="Meta-World: held-out episodes per task")
    args = parser.parse_args()
    WORK.mkdir(parents=True, exist_ok=True)
    everything = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    results = everything.setdefault("colorreach_plateau", {})
    results["settings"] = {"episodes": args.episodes, "machine": "2-core CPU, no GPU", "start": "the RECAP "
                           "mechanism's (demo recipe, reads its prompt) on layout random", "seeds": f"{mechanism.SEED}.."}

    def save():  # merged into the file: other runs (another critic, the other benchmark) may write it meanwhile
        current = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
        RESULTS.write_text(json.dumps(_merged(current, everything), indent=1) + "\n")

    stages = ["start", "collect", "critic", "decoys", "arms"] if args.stage == "all" else args.stage.split(",")
    name = critic_name(args.critic_steps, args.negatives, args.data)
    if args.bench == "metaworld":
        metaworld(everything, stages, args.mw_episodes, args.critic_steps, args.negatives, save)
        save()
        return
    for stage in stages:
        if stage == "start":
            mechanism.stage_start({})
        elif stage == "collect":
            mechanism.stage_data()
            collected = {}
            mechanism.stage_collect(collected, 200)
            results["collected_success"] = collected["collected"]["success"]
        elif stage == "critic":
            stage_critic(results, args.critic_steps, args.negatives, args.data)
        elif stage == "decoys":
            stage_decoys(results, 200, name)
        elif stage == "arms":
            for arm, found in stage_arms(results, args.episodes, [int(n) for n in args.counts.split(",")], name,
                                         curve=not args.no_curve):
                save()
                print(json.dumps({arm: found}), flush=True)
        save()
    print(json.dumps(results, indent=1), flush=True)


if __name__ == "__main__":
    main()
