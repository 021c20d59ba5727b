"""Meta-World end to end, small: the scripted expert recorded through lerobot's env wrapper into a LeRobot dataset that
lerobot loads, a few training steps with configs/pi05_metaworld.json, two evaluation episodes headless; and the
errors a user meets first (unknown task, no renderer, a checkpoint for another robot)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import REPO, refused

pytest.importorskip("metaworld")

from hf_vla.train import main as train_main  # noqa: E402

IMAGE = 64
CROP = "144,96,400,352"  # the five-task workspace (hf_vla.envs.metaworld.WORKSPACE)


def run_cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, cwd=REPO, timeout=600,
                          env=dict(os.environ, **(env or {})))


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    out = tmp_path_factory.mktemp("metaworld") / "reach"
    result = run_cli("hf_vla.record", "--env", "metaworld", "--task", "reach", "--episodes", "2", "--output", str(out),
                     "--image_size", str(IMAGE), "--crop", CROP)
    assert result.returncode == 0, result.stderr[-3000:]
    return out


def test_recorded_expert_data_is_a_lerobot_dataset(recorded):
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    dataset = LeRobotDataset("local/reach", root=recorded)
    assert dataset.num_episodes == 2 and dataset.fps == 80
    frame = dataset[0]
    assert frame["observation.image"].shape == (3, IMAGE, IMAGE) and frame["observation.state"].shape == (4,)
    assert frame["action"].shape == (4,) and float(frame["action"].abs().max()) <= 1.0
    assert frame["task"] == "Reach a goal position"  # lerobot's task description
    marker = json.loads((recorded / "meta" / "hf_vla_record.json").read_text())
    assert marker["tasks"]["reach-v3"]["kept"] == 2 and marker["tasks"]["reach-v3"]["rejected"] == 0
    assert marker["env_kwargs"] == {"crop": [144, 96, 400, 352]}
    assert frame["locations"].startswith("<loc") and " gripper" in frame["locations"]  # a token-objective target
    assert not [p for p in recorded.parent.iterdir() if p.name.startswith(".")]  # no staging left


def test_train_a_few_steps_then_evaluate_headless(recorded, tmp_path):
    from hf_vla.evaluation.arguments import EvaluateArguments
    from hf_vla.evaluation.runner import BenchmarkResult, evaluate_checkpoint

    out = tmp_path / "run"
    dataset = {"root": str(recorded), "name": "metaworld", "cameras": ["observation.image"],
               "control_mode": "delta_xyz_gripper"}
    train_main([str(REPO / "configs" / "pi05_metaworld.json"), "--datasets", json.dumps([dataset]), "--output_dir",
                str(out), "--max_steps", "3", "--save_strategy", "no", "--validation_ratio", "0",
                "--stream_open_blocks", "2", "--per_device_train_batch_size", "4", "--logging_steps", "1",
                "--warmup_steps", "0", "--rollout_env", "metaworld", "--rollout_tasks", "reach", "--rollout_steps", "3",
                "--rollout_episodes", "1", "--rollout_wait", "true", "--max_episode_steps", "12"])
    rollout = json.loads((out / "rollout_results.jsonl").read_text())  # rollouts during training, same harness
    assert rollout["step"] == 3 and set(rollout["metrics"]) == {"rollout/reach-v3/success", "rollout/success",
                                                                 "rollout/step"}
    assert rollout["result"]["tasks"]["reach-v3"]["episodes"] == 1 and "reach-v3" in (out / "README.md").read_text()
    contract = json.loads((out / "deployment_config.json").read_text())  # how the checkpoint must be run
    bench = contract["heads"]["metaworld::delta_xyz_gripper"]["benchmark"]
    assert bench["env"] == "metaworld" and bench["tasks"] == ["reach-v3"] and bench["image_size"] == IMAGE
    assert bench["max_episode_steps"] == 12 and bench["data_seeds"] == [0, 1] and contract["n_action_steps"] == 8
    assert bench["env_kwargs"] == {"crop": [144, 96, 400, 352]}  # the recording's crop travels with the checkpoint
    # every setting from the checkpoint: env, task, image size, episode limit, actions per chunk, camera
    import hf_vla.evaluation.runner as evaluate_module  # where the runner looks the env builder up

    made, make_envs = [], evaluate_module._make_envs

    def recorded_make_envs(env_id, task, num_envs, env_kwargs, *args, **kwargs):
        made.append(dict(env_kwargs))
        return make_envs(env_id, task, num_envs, env_kwargs, *args, **kwargs)

    evaluate_module._make_envs = recorded_make_envs
    try:
        result = evaluate_checkpoint(EvaluateArguments(out, episodes=2, save_videos=1, output_dir=tmp_path / "eval",
                                                       device="cpu"), progress=False)
    finally:
        evaluate_module._make_envs = make_envs
    assert made == [{"crop": [144, 96, 400, 352], "image_size": IMAGE}]  # the envs render as the data was recorded
    assert isinstance(result, BenchmarkResult) and list(result.tasks) == ["reach-v3"]
    assert {k: v["value"] for k, v in result.settings.items() if v["source"] == "checkpoint"} == {
        "env": "metaworld", "task": "reach-v3", "image_size": IMAGE, "max_episode_steps": 12, "n_action_steps": 8,
        "cameras": ["observation.image"], "head": "metaworld::delta_xyz_gripper", "control_mode": "delta_xyz_gripper",
        "env_kwargs": {"crop": [144, 96, 400, 352]}}
    task = result.tasks["reach-v3"]
    assert task.episodes == 2 and 1 <= task.mean_steps <= 12 and 0.0 <= result.success_rate <= 1.0
    assert (tmp_path / "eval" / "reach-v3" / "rollout_000_failure.gif").exists() or task.successes
    saved = json.loads((tmp_path / "eval" / "eval_result.json").read_text())
    assert saved["env"] == "metaworld" and "success_rate" in saved and "reach-v3" in saved["tasks"]

    # several tasks side by side (MT50's way): each task's seeds in its own envs, one policy call per control step for
    # the live envs of every task of a wave; per seed the episodes of the tasks evaluated one after another
    import hf_vla.envs.episodes as episodes

    calls = []
    call = episodes._call_policies

    def counted(requests):
        calls.append(len(requests))
        return call(requests)

    three = "reach-v3,push-v3,button-press-topdown-v3"
    common = dict(episodes=2, num_envs=1, task=three, save_videos=1, device="cpu")
    alone = evaluate_checkpoint(EvaluateArguments(out, tasks_at_once=1, output_dir=tmp_path / "alone", **common),
                                progress=False)
    episodes._call_policies = counted
    try:
        waves = evaluate_checkpoint(EvaluateArguments(out, tasks_at_once=2, output_dir=tmp_path / "waves", **common),
                                    progress=False)
    finally:
        episodes._call_policies = call
    assert list(waves.tasks) == three.split(",") and waves.settings["tasks_at_once"] == {"value": 2, "source": "flag"}
    assert alone.settings["tasks_at_once"] == {"value": 1, "source": "flag"}
    for name, task in waves.tasks.items():
        one = alone.tasks[name]
        assert [(e["seed"], e["success"], e["steps"]) for e in task.episode_records] == \
            [(e["seed"], e["success"], e["steps"]) for e in one.episode_records]
        assert [e["reward"] for e in task.episode_records] == pytest.approx([e["reward"] for e in one.episode_records],
                                                                             rel=1e-4)
        assert len(list((tmp_path / "waves" / name).glob("rollout_000_*.gif"))) == 1  # in the task's own folder
    # wave 1 (reach, push): calls of 2 while both run (12 steps, 8 actions per chunk); wave 2: button-press alone
    assert max(calls) == 2 and calls.count(2) >= 2 and calls[-1] == 1
    # no flag: as many tasks as keep MAX_ENVS_AT_ONCE workers (all three here)
    from hf_vla.evaluation.runner import MAX_ENVS_AT_ONCE, default_tasks_at_once

    assert default_tasks_at_once(50, 2) == MAX_ENVS_AT_ONCE // 2 and default_tasks_at_once(3, 1) == 3
    assert default_tasks_at_once(5, 64) == 1


@pytest.mark.slow  # text targets train in tests/test_cotraining.py; this is the recorded column
def test_locations_train_as_text_targets(recorded, tmp_path):
    """configs/pi05_metaworld_cotrain_locations.json on a recording: the recorded locations become text targets after
    the FAST tokens (one `<loc>` token per coordinate, tiny_loc tokenizer), `text_ce` is logged, and the deployment
    contract lists no such input (the policy runs from images and state)."""
    out = tmp_path / "locations"
    dataset = {"root": str(recorded), "name": "metaworld", "cameras": ["observation.image"],
               "control_mode": "delta_xyz_gripper", "target_text_key": "locations"}
    trainer = train_main([str(REPO / "configs" / "pi05_metaworld_cotrain_locations.json"), "--datasets",
                          json.dumps([dataset]), "--output_dir", str(out), "--max_steps", "2", "--save_strategy", "no",
                          "--validation_ratio", "0", "--stream_open_blocks", "2", "--per_device_train_batch_size", "4",
                          "--logging_steps", "1", "--warmup_steps", "0", "--fast_vocab_size", "256"])
    tokenizer = trainer.processing_class.tokenizer
    locations = set(tokenizer.convert_tokens_to_ids([f"<loc{i:04d}>" for i in range(1024)]))
    labels = next(iter(trainer.get_train_dataloader()))["labels"]
    per_row = [sum(int(t) in locations for t in row) for row in labels]
    assert all(count >= 4 and count % 2 == 0 for count in per_row), per_row  # points: two tokens each
    assert any("text_ce" in entry for entry in trainer.state.log_history)
    assert "locations" not in (out / "deployment_config.json").read_text()


def test_a_recording_gains_its_locations_by_replay(recorded, tmp_path):
    """`hf_vla.record --add_locations`: a recording without the locations column gets the very strings the recorder
    wrote (each episode's seed found from its first frame, its actions replayed, every frame's state and every 10th
    image checked), and lerobot loads the result; a recording whose actions were altered is refused, naming the episode
    and frame, and nothing is written."""
    import shutil

    import pyarrow.parquet as pq
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    stripped = tmp_path / "stripped"
    shutil.copytree(recorded, stripped)
    info = json.loads((stripped / "meta" / "info.json").read_text())
    del info["features"]["locations"]
    (stripped / "meta" / "info.json").write_text(json.dumps(info, indent=4))
    written = {}
    for path in sorted((stripped / "data").glob("*/*.parquet")):
        table = pq.read_table(path)
        written[path.relative_to(stripped)] = table["locations"].to_pylist()
        pq.write_table(table.drop(["locations"]), path)
    out = tmp_path / "added"
    result = run_cli("hf_vla.record", "--env", "metaworld", "--add_locations", str(stripped), "--output", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    for relative, texts in written.items():
        assert pq.read_table(out / relative)["locations"].to_pylist() == texts
    assert json.loads((out / "meta" / "info.json").read_text())["features"]["locations"]["dtype"] == "string"
    assert LeRobotDataset("local/reach", root=out)[5]["locations"] == written[next(iter(written))][5]
    assert not any((stripped / "data").glob("*/*.locations*")) and "locations" not in (stripped / "meta" /
                                                                                        "info.json").read_text()
    # an altered action: the replay leaves the recording after that frame, and says where
    path = next(iter(written))
    table = pq.read_table(stripped / path)
    actions = np.asarray(table["action"].to_pylist(), np.float32)
    row = int(np.flatnonzero(np.asarray(table["episode_index"].to_pylist()) == 1)[10])
    actions[row] = -actions[row]
    import pyarrow as pa

    table = table.set_column(table.column_names.index("action"), "action",
                             pa.array(actions.tolist(), type=table.schema.field("action").type))
    pq.write_table(table, stripped / path)
    refused_out = tmp_path / "refused"
    result = run_cli("hf_vla.record", "--env", "metaworld", "--add_locations", str(stripped), "--output",
                     str(refused_out))
    assert result.returncode == 1 and "episode 1 (reach-v3, seed 1) departs from the recording at frame 11" in \
        result.stderr, result.stderr[-2000:]
    assert not refused_out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_the_expert_ceiling_and_upright_images():
    """The benchmark's expert succeeds in the wrapper (seeded resets differ), and the image is the right way up: the
    table (brown, below) fills more of the bottom half than of the top."""
    from hf_vla.envs.metaworld import in_worker

    env = in_worker("reach-v3", image_size=IMAGE, max_episode_steps=200)
    try:
        starts, successes = [], 0
        for seed in (3, 4):
            observation, info = env.reset(seed=seed)
            starts.append(observation["observation.state"].copy())
            image = observation["observation.image"].astype(float)
            brown = (image[..., 0] > image[..., 2] + 30)  # the wooden table top
            assert brown[IMAGE // 2 :].mean() > brown[: IMAGE // 2].mean()
            done = False
            while not done:
                observation, _, terminated, truncated, info = env.step(env.expert_action())
                done = terminated or truncated
            successes += info["is_success"]
        assert successes == 2 and info["task"] == "Reach a goal position"
    finally:
        env.close()


SEQUENTIAL = r"""
import gc, json, numpy as np
from hf_vla.envs.metaworld import MetaWorldEnv
frames, previous = [], None
for task in ("reach-v3", "push-v3", "reach-v3"):
    env = MetaWorldEnv(task, image_size=32, cameras="corner2,gripperPOV")
    observation, _ = env.reset(seed=5)
    del previous  # the closed env collected while this one's GL context is current (as gc may do at any time)
    gc.collect()
    for _ in range(3):
        observation, *_ = env.step(env.expert_action())
    frames.append([observation[k].astype(float).tolist() for k in sorted(observation) if "image" in k])
    env.close()
    previous = env
print(json.dumps(frames))
"""


def test_envs_made_one_after_another_in_a_process_render_alike():
    """Closing an env frees its render context in its own GL context: the next env in the process renders its scene
    however late the closed one is collected (before, collected while the next env's context was current, it took
    that context's buffers with it and every later frame came out black), and the same task and seed render alike."""
    result = subprocess.run([sys.executable, "-c", SEQUENTIAL], capture_output=True, text=True, cwd=REPO,
                            timeout=300, env=dict(os.environ, MUJOCO_GL=os.environ.get("MUJOCO_GL", "egl")))
    assert result.returncode == 0, result.stderr[-3000:]
    first, other, again = (np.asarray(f) for f in json.loads(result.stdout.strip().splitlines()[-1]))
    assert first.shape == (2, 32, 32, 3)
    assert other.std() > 10 and again.std() > 10  # a scene, not a black frame
    assert np.abs(first - other).mean() > 1  # push's scene is not reach's
    np.testing.assert_array_equal(first, again)


def test_the_absolute_end_effector_space_commands_what_the_delta_does():
    """`action_mode="absolute_ee"`: the expert's actions are hand targets (`hand + 0.01 x delta`, gripper unchanged) and
    stepping them moves the arm as the deltas do: an episode in each space from one seed visits the same states (to
    float32 rounding of the target) and succeeds alike."""
    from hf_vla.envs.metaworld import in_worker

    runs = {}
    for mode in ("delta", "absolute_ee"):
        env = in_worker("push-v3", image_size=IMAGE, max_episode_steps=200, action_mode=mode)
        try:
            observation, _ = env.reset(seed=5)
            states, actions, success = [observation["observation.state"]], [], False
            for _ in range(60):
                actions.append(np.asarray(env.expert_action()))
                observation, _, terminated, truncated, info = env.step(actions[-1])
                states.append(observation["observation.state"])
                success = success or info["is_success"]
            runs[mode] = np.stack(states), np.stack(actions)
        finally:
            env.close()
    (delta_states, deltas), (absolute_states, targets) = runs["delta"], runs["absolute_ee"]
    np.testing.assert_allclose(absolute_states, delta_states, atol=1e-4)
    np.testing.assert_allclose(targets[:, :3], delta_states[:-1, :3] + 0.01 * deltas[:, :3], atol=1e-5)
    np.testing.assert_array_equal(targets[:, 3], deltas[:, 3])
    assert np.abs(targets[:, :3] - absolute_states[:-1, :3]).max() <= 0.01 + 1e-6  # targets: within a step of the hand
    assert np.ptp(absolute_states[:, :3], axis=0).max() > 0.05  # the arm moved: states that could differ


def test_the_expert_plan_is_what_the_expert_then_does_and_leaves_the_env_as_it_was():
    """`expert_plan(H)` from a state equals the next H actions the expert executes from there (the oracle: the same
    simulator stepped for real), and calling it changes nothing: the episode with plans renders frame for frame what
    the episode without them renders. Through the env worker, as DAgger uses it; a task whose object moves."""
    from hf_vla.envs.metaworld import in_worker

    runs = []
    for with_plans in (True, False):
        env = in_worker("push-v3", image_size=IMAGE, max_episode_steps=200)
        try:
            observation, _ = env.reset(seed=7)
            actions, plans, images = [], [], []
            for _ in range(40):
                if with_plans:
                    plans.append(np.asarray(env.expert_plan(8)))
                actions.append(np.asarray(env.expert_action()))
                observation = env.step(actions[-1])[0]
                images.append(observation["observation.image"])
            runs.append((np.stack(actions), plans, images))
        finally:
            env.close()
    (actions, plans, images), (plain_actions, _, plain_images) = runs
    assert all(plan.shape == (8, 4) for plan in plans)
    for t, plan in enumerate(plans[:-8]):
        np.testing.assert_array_equal(plan, actions[t : t + 8])
    assert np.abs(np.diff(actions, axis=0)).max() > 0.1  # the plan is not a constant that matches by chance
    np.testing.assert_array_equal(actions, plain_actions)
    assert all(np.array_equal(a, b) for a, b in zip(images, plain_images))


def test_dagger_records_the_experts_own_chunk_and_training_reads_it(recorded, tmp_path):
    """A Meta-World DAgger round records `action_plan`, the expert's own next-chunk from each visited state. Oracle:
    with the expert acting at every step (beta 1) the plan of frame t is the labels of frames t..t+H-1, the whole of
    it inside the episode. Trained with `action_chunk_key`, a frame's chunk is its plan, unpadded at the episode's
    end; a plan shorter than the model's chunk is refused in one line."""
    from hf_vla.data import WeightedDatasetMixture
    from hf_vla.data.stream import FrameReader
    from hf_vla.envs.dagger import ACTION_PLAN
    from hf_vla.envs.recording import RecordArguments, record
    from hf_vla.errors import ConfigError

    policy = tmp_path / "policy"
    dataset = {"root": str(recorded), "name": "metaworld", "cameras": ["observation.image"],
               "control_mode": "delta_xyz_gripper"}
    train_main([str(REPO / "configs" / "pi05_metaworld.json"), "--datasets", json.dumps([dataset]), "--output_dir",
                str(policy), "--max_steps", "1", "--save_strategy", "no", "--validation_ratio", "0",
                "--stream_open_blocks", "2", "--per_device_train_batch_size", "2", "--warmup_steps", "0",
                "--report_to", "none", "--max_episode_steps", "30", "--disable_tqdm", "true"])
    out = tmp_path / "dagger_1"
    record(RecordArguments(env="metaworld", output=out, episodes=1, strategy="dagger", policy=str(policy), beta=1.0),
           progress=False)
    marker = json.loads((out / "meta" / "hf_vla_record.json").read_text())
    chunk = json.loads((policy / "config.json").read_text())["chunk_size"]
    assert marker["plan_steps"] == chunk == 16
    info = json.loads((out / "meta" / "info.json").read_text())
    assert info["features"][ACTION_PLAN]["shape"] == [chunk * 4]
    import pyarrow.parquet as pq

    table = pq.read_table(sorted((out / "data").glob("*/*.parquet"))[0])
    labels = np.asarray(table["action"].to_pylist(), dtype=np.float32)
    plans = np.asarray(table[ACTION_PLAN].to_pylist(), dtype=np.float32).reshape(len(labels), chunk, 4)
    assert len(labels) == 30 or marker["tasks"]["reach-v3"]["successes"] == 1
    for t in range(len(labels)):
        inside = min(chunk, len(labels) - t)
        np.testing.assert_array_equal(plans[t, :inside], labels[t : t + inside])
    assert np.ptp(labels, axis=0).max() > 0.2  # labels that change along the episode: not equal by chance

    spec = {"root": str(out), "name": "dagger_1", "cameras": ["observation.image"],
            "control_mode": "delta_xyz_gripper", "action_chunk_key": ACTION_PLAN}
    mixture = WeightedDatasetMixture([spec])
    assert mixture.sources[0].chunk_steps == chunk
    reader = FrameReader(mixture.sources, mixture.head_of_source, 1, IMAGE, chunk)
    block = mixture.train_blocks[0][0]
    last = block.end - 1
    sample = reader.sample(0, block, last)
    np.testing.assert_array_equal(sample["actions"].numpy(), plans[last])  # past the episode end: the plan, not padding
    assert not sample["action_is_pad"].any()
    mixture.check_chunks(chunk)
    with pytest.raises(ConfigError, match=f"action_chunk_key 'action_plan' holds {chunk} steps per frame, fewer than "
                                          f"chunk_size {2 * chunk}"):
        mixture.check_chunks(2 * chunk)
    from hf_vla.errors import DataError

    with pytest.raises(DataError, match=r"action_chunk_key 'intervention' is int64 of shape \(1,\): it must be a "
                                        "numeric vector of whole chunks of 4-dim actions"):
        WeightedDatasetMixture([dict(spec, action_chunk_key="intervention")])
    # a NaN in a frame's plan is refused at start-up, by the scan, naming the column, episode and frame
    import shutil

    import pyarrow as pa

    broken = tmp_path / "dagger_nan"
    shutil.copytree(out, broken)
    path = sorted((broken / "data").glob("*/*.parquet"))[0]
    nan_plans = plans.reshape(len(labels), -1).copy()
    nan_plans[3, 5] = np.nan
    table = table.set_column(table.schema.get_field_index(ACTION_PLAN), ACTION_PLAN,
                             pa.array(list(nan_plans), type=table.schema.field(ACTION_PLAN).type))
    pq.write_table(table, path)
    with pytest.raises(DataError, match=r"1 non-finite value\(s\) in column 'action_plan' of .*; first at episode 0, "
                                        "frame 3, dim 5"):
        WeightedDatasetMixture([dict(spec, root=str(broken))])


def test_recorded_locations_are_where_the_renderer_draws_them():
    """The gripper point `project` puts in the observation image (the tool centre, between the fingers) lies inside the
    gripper's pixels in a segmentation render of the same camera (oriented, cropped and resized like the image; their
    bounding box, one pixel of resize slack), on every frame of an expert episode, in three tasks, image sizes and
    crops; the other orientation (upright, not turned) misses on some. The `<loc>` text is PaliGemma's point form."""
    import re

    from hf_vla.envs.metaworld import in_worker, location_text

    assert location_text({"goal": (10.0, 63.9)}, 64) == "<loc1022><loc0160> goal"
    frames = inside = flipped_inside = 0
    for task, size, crop in (("reach-v3", 64, None), ("push-v3", 96, CROP), ("drawer-open-v3", 128, None)):
        env = in_worker(task, image_size=size, max_episode_steps=60, crop=crop)
        try:
            env.reset(seed=5)
            for _ in range(60):
                points, mask = env.call("locations"), env.call("body_mask", "hand")
                ys, xs = np.nonzero(mask)
                if "gripper" in points and len(xs):
                    x, y = points["gripper"]
                    frames += 1
                    inside += bool(xs.min() - 1 <= x <= xs.max() + 1 and ys.min() - 1 <= y <= ys.max() + 1)
                    flipped_inside += bool(ys.min() - 1 <= size - y <= ys.max() + 1 and xs.min() - 1 <= x <= xs.max() + 1)
                text = env.call("target_text")
                assert re.fullmatch(r"(<loc\d{4}><loc\d{4}> (gripper|object|goal)( ; )?)+", text), text
                _, _, terminated, truncated, _ = env.step(env.expert_action())
                if terminated or truncated:
                    break
        finally:
            env.close()
    assert frames >= 100 and inside == frames, (inside, frames)
    assert flipped_inside < 0.8 * frames  # the check tells the orientations apart


def test_a_crop_is_the_render_cut_then_resized():
    """`crop` keeps a box of the 480 px render and resizes it: the same pixels as cutting the full render by hand."""
    from PIL import Image

    from hf_vla.envs.metaworld import WORKSPACE, in_worker

    images = {}
    for crop, size in ((None, 480), (WORKSPACE, IMAGE)):
        env = in_worker("push-v3", image_size=size, max_episode_steps=10, crop=crop)
        try:
            images[crop] = env.reset(seed=7)[0]["observation.image"]
        finally:
            env.close()
    left, top, right, bottom = WORKSPACE
    by_hand = np.asarray(Image.fromarray(np.ascontiguousarray(images[None][top:bottom, left:right])).resize(
        (IMAGE, IMAGE), Image.BILINEAR))
    assert images[WORKSPACE].shape == (IMAGE, IMAGE, 3) and np.array_equal(images[WORKSPACE], by_hand)
    whole = np.asarray(Image.fromarray(images[None]).resize((IMAGE, IMAGE), Image.BILINEAR))
    assert np.abs(whole.astype(int) - by_hand).mean() > 10  # and it is not the uncropped image


def test_metaworld_errors(recorded, tmp_path, tiny_tokenizer, capsys):
    from hf_vla.evaluate import cli as evaluate
    from hf_vla.record import cli as record

    for crop in ("1,2,3", "0,0,500,100", "10,10,5,20"):
        last = refused(record, ["--env", "metaworld", "--task", "reach", "--episodes", "1", "--output",
                                str(tmp_path / "c"), "--crop", crop], capsys)
        assert f"crop={crop!r}: give left,top,right,bottom" in last, last
    assert not (tmp_path / "c").exists()
    last = refused(record, ["--env", "metaworld", "--task", "reach,nope", "--episodes", "1", "--output",
                            str(tmp_path / "x")], capsys)
    assert "Meta-World task 'nope' is not known" in last, last
    # the renderer is chosen when mujoco is imported: a process of its own
    result = run_cli("hf_vla.record", "--env", "metaworld", "--task", "reach", "--episodes", "1", "--output",
                     str(tmp_path / "y"), env={"MUJOCO_GL": "osmesa", "PYOPENGL_PLATFORM": "osmesa"})
    if "libosmesa6" in result.stderr:  # this machine has no OSMesa: the one line names what to install
        assert result.returncode == 2 and "apt-get install libosmesa6" in result.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "y").exists() or result.returncode == 0
    # a checkpoint of another robot (the ColorReach demo's 2-dim state and actions)
    from test_serve import NORM_STATS, demo_config

    from hf_vla.models.pi05 import PI05ForConditionalGeneration, PI05Processor

    checkpoint = tmp_path / "color_reach"
    model = PI05ForConditionalGeneration(demo_config())
    model.save_pretrained(checkpoint)
    PI05Processor.from_config(model.config, tiny_tokenizer, norm_stats=NORM_STATS).save_pretrained(checkpoint)
    last = refused(evaluate, ["--checkpoint", str(checkpoint), "--env", "metaworld", "--task", "reach", "--episodes",
                              "1"], capsys)
    assert "Meta-World reach-v3 has 4 action dims but the checkpoint's head" in last, last


def test_a_killed_multi_task_recording_continues_where_it_stopped(tmp_path, caplog):
    """`--task mt50` is hours here: each task is a part marked done; a rerun skips the done parts, the joined dataset
    has every task, a task whose expert misses the count within --max_tries is reported as a shortfall, and an
    interrupted recording with other settings is refused rather than mixed."""
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    from hf_vla.envs.recording import RecordArguments, record
    from hf_vla.errors import ConfigError

    out, calls = tmp_path / "two", []

    def dies_on_second_task(first):
        calls.append(first)
        if len(calls) == 2:
            raise KeyboardInterrupt  # killed while the second task records
        return iter(range(first, first + 100))

    with pytest.raises(KeyboardInterrupt):
        record(RecordArguments(env="metaworld", output=out, episodes=1, task="reach,button-press-topdown",
                               image_size=32), progress=False, seeds=dies_on_second_task)
    assert not out.exists() and (tmp_path / ".two.recording" / "parts" / "reach-v3").is_dir()
    with pytest.raises(ConfigError, match=r"interrupted recording with other settings \(episodes_per_task: 1 there"):
        record(RecordArguments(env="metaworld", output=out, episodes=2, task="reach,button-press-topdown",
                               image_size=32), progress=False)

    def counted(first):
        calls.append(first)
        return iter(range(first, first + 100))

    calls.clear()
    with caplog.at_level("INFO", logger="hf_vla.record"):
        result = record(RecordArguments(env="metaworld", output=out, episodes=1, task="reach,button-press-topdown",
                                        image_size=32), progress=False, seeds=counted)
    assert len(calls) == 1  # only the second task was recorded again
    assert "1 of 2 tasks already done" in caplog.text
    assert set(result.tasks) == {"reach-v3", "button-press-topdown-v3"} and result.shortfall == {}
    dataset = LeRobotDataset("local/two", root=out)
    assert dataset.num_episodes == 2 and set(dataset.meta.tasks.index) == {
        "Reach a goal position", "Press a button from the top"}
    assert not (tmp_path / ".two.recording").exists()
    marker = json.loads((out / "meta" / "hf_vla_record.json").read_text())
    assert marker["tasks"]["reach-v3"]["kept"] == 1 and marker["data_seeds"][0] == 0

    # fewer tries than episodes (here: the seeds run out after one): the shortfall is in the result and the marker
    short = record(RecordArguments(env="metaworld", output=tmp_path / "short", episodes=3, task="reach", image_size=32),
                   progress=False, seeds=lambda first: iter([first]))
    assert short.shortfall == {"reach-v3": 2}
    assert json.loads((tmp_path / "short" / "meta" / "hf_vla_record.json").read_text())["shortfall"] == {"reach-v3": 2}


def test_mt50_figures_are_the_published_group_means():
    """The published MT50 figure: success per difficulty group (lerobot's grouping: 28 / 11 / 6 / 5 tasks) and the
    mean of the four group means, computed here from made-up per-task results against a hand computation."""
    from hf_vla.envs.metaworld import task_group, task_names
    from hf_vla.evaluation.runner import BenchmarkResult, EvalResult

    names = task_names("mt50")
    assert len(names) == 50 and [task_group(n) for n in names].count("easy") == 28
    rates = {name: (i % 5) / 4 for i, name in enumerate(names)}
    result = BenchmarkResult.from_tasks("metaworld", {n: EvalResult(r, 4, int(4 * r), 10.0) for n, r in rates.items()})
    expected = {g: sum(r for n, r in rates.items() if task_group(n) == g) / count
                for g, count in (("easy", 28), ("medium", 11), ("hard", 6), ("very_hard", 5))}
    assert result.groups == pytest.approx(expected) and result.group_tasks == {"easy": 28, "medium": 11, "hard": 6,
                                                                               "very_hard": 5}
    assert result.average == pytest.approx(sum(expected.values()) / 4)
    assert result.success_rate == pytest.approx(sum(rates.values()) / 50)  # the task mean differs from the published
    table = result.table()
    figures = " / ".join(f"{100 * v:.1f}" for v in expected.values())
    assert f"(easy / medium / hard / very_hard: {figures} -> {100 * result.average:.1f})" in table
    assert "MT50 average" in table


def test_the_step_wrappers_end_an_episode_at_its_first_success_even_on_the_last_step():
    """Meta-World's and LIBERO's envs step through `envs.wrappers.stepper`: gymnasium's ClipAction and TimeLimit, and
    a success on the step the limit falls on is a termination (a success), not a truncation."""
    import gymnasium as gym

    from hf_vla.envs.wrappers import stepper

    class Toy(gym.Env):
        observation_space = gym.spaces.Box(-1, 1, (1,))
        action_space = gym.spaces.Box(-1, 1, (1,))

        def __init__(self, success_at):
            self.success_at, self.taken = success_at, []

        def reset(self, *, seed=None, options=None):
            self.t = 0
            return np.zeros(1, np.float32), {}

        def step(self, action):
            self.t += 1
            self.taken.append(float(action[0]))
            return np.zeros(1, np.float32), 0.5, False, False, {"is_success": self.t == self.success_at}

    def outcomes(success_at):
        env = Toy(success_at)
        wrapped = stepper(env, "toy task", max_episode_steps=3)
        wrapped.reset(seed=0)
        steps = [wrapped.step(np.array([5.0], np.float32))[2:] for _ in range(3)]
        return env.taken, [(terminated, truncated, info) for terminated, truncated, info in steps]

    taken, steps = outcomes(success_at=3)
    assert taken == [1.0, 1.0, 1.0]  # clipped to the action space
    assert [s[:2] for s in steps] == [(False, False), (False, False), (True, False)]
    assert steps[-1][2] == {"task": "toy task", "is_success": True}
    _, steps = outcomes(success_at=None)
    assert [s[:2] for s in steps] == [(False, False), (False, False), (False, True)]
