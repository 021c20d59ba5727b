"""Record a simulator's scripted expert as a LeRobot v3.0 dataset, written with lerobot's own writer.

    python -m hf_vla.record --env metaworld --task reach-v3,push-v3 --episodes 50 --output data/metaworld
    python -m hf_vla.record --env metaworld --task easy --episodes 20 --output data/mw_easy --image_size 96
    python -m hf_vla.record --env color_reach --episodes 200 --output data/color_reach      # the demo's data

Meta-World runs in lerobot's env wrapper (`hf_vla.envs.metaworld`: the observations, camera orientation and task
descriptions `lerobot-eval` sees), each task in its own worker process; its expert is the benchmark's own
(`metaworld.policies`). Features are named as lerobot's Meta-World data: `observation.image`, `observation.state`,
`action`; each episode's task is the task description. Only successful episodes are kept (the rejected ones are
counted and reported); episode seeds are `--seed`, `--seed`+1, ... per task (evaluate on other seeds: `hf_vla.evaluate`
starts at 10,000).

Atomic and resumable: each task is recorded into its own part in `.<output name>.recording/` beside `--output`, the
parts are joined (lerobot's `aggregate_datasets`) and renamed into place when all are done, with
`meta/hf_vla_record.json` (what was recorded; episodes kept and rejected, seeds tried and seconds per task; the
`shortfall` of tasks whose expert missed `--episodes` successes within `--max_tries`). A killed recording leaves no
directory that looks like a dataset; the same command run again continues from the first task not done (other
settings are refused while an interrupted recording waits; `--overwrite` starts over). An existing `--output` is
refused (or replaced with `--overwrite`).

    python -m hf_vla.record --env metaworld --task mt50 --episodes 50 --output data/mt50 --image_size 224  # ~2.5 h

DAgger (`--strategy dagger --policy CHECKPOINT`, `hf_vla.envs.dagger`): the checkpoint's policy acts, run as its
deployment contract says (tasks, image size, crop, episode limit, actions per chunk; a flag that contradicts it is
refused), the expert labels every visited state; every episode is kept, with per-frame `intervention` and
`policy_action` and the episodes' success in `meta/hf_vla_record.json`, which also names the checkpoint and `--round`.
Seeds default to 1000 x round (new initial states each round, below evaluation's 10,000).

    python -m hf_vla.record --env metaworld --strategy dagger --policy outputs/mw --round 1 --episodes 10 \
        --output data/mw_dagger_1
"""

from __future__ import annotations

import json
from dataclasses import asdict

from hf_vla.cli import run
from hf_vla.envs.recording import RecordArguments, record
from hf_vla.parser import CommandParser


def main(argv=None):
    args = CommandParser("python -m hf_vla.record", (RecordArguments,), __doc__).parse(argv)
    from hf_vla.cli import setup_logging

    setup_logging()
    if args.add_locations is not None:
        from hf_vla.envs.replay import add_locations

        output = add_locations(args.add_locations, args.output, overwrite=args.overwrite)
        print(json.dumps({"output": str(output), "added": "locations"}))
        return output
    result = record(args)
    print(json.dumps(asdict(result), indent=2))
    return result


def cli(argv=None):
    return run("hf_vla.record", main, argv)


if __name__ == "__main__":
    cli()
