"""Recording where the policy is served (`python -m hf_vla.serve --record DIR`, `hf_vla.serving.recorder`), through the
real openpi-client: what the clients sent and got comes back from the LeRobot dataset, episode by episode."""

from __future__ import annotations

import errno
import json
import logging
import shutil
import signal

import numpy as np
import pytest
from conftest import refused
from test_serve import HEAD, Server, checkpoint, demo_policy, observations  # noqa: F401  (module fixtures)


def _client(uri):
    from openpi_client.websocket_client_policy import WebsocketClientPolicy

    return WebsocketClientPolicy(uri)


def _dataset(root):
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    data = LeRobotDataset("local/served", root=root)
    return data, data.hf_dataset.with_format("numpy")[:]


def test_served_episodes_are_recorded_and_joined(checkpoint, tmp_path):  # noqa: F811
    root = tmp_path / "served"
    server = Server("--checkpoint", str(checkpoint), "--record", str(root), "--seed", "5")
    sent = []  # (episode, observation, reply, intervention) in the order the frames must come back
    try:
        first = _client(server.uri)
        assert first.get_server_metadata()["record"] is True
        steps = list(observations(3, seed=40))
        correction = np.array([0.05, -0.05], np.float32)
        for i, (observation, task) in enumerate(steps):
            request = {**observation, "prompt": task} | ({"episode_seed": 1} if i == 0 else {})
            if i == 1:
                request["intervention"] = correction
            reply = first.infer(request)
            assert reply["recorded_episode"] == 0
            sent.append((0, request, reply, correction if i == 1 else None))
        with pytest.raises(RuntimeError, match=r"intervention: shape \(3,\); head 'color_reach::delta_xy' acts with 2"):
            first.infer({**steps[0][0], "prompt": steps[0][1], "intervention": np.zeros(3, np.float32)})
        with pytest.raises(RuntimeError, match="success: sent with episode_end true"):
            first.infer({"success": True})
        assert first.infer({"episode_end": True, "success": True}) == {"episode_end": True, "recorded_episode": 0}
        second = _client(server.uri)
        for i, (observation, task) in enumerate(observations(3, seed=50)):
            # an episode_seed starts an episode: 7, then none (the episode goes on), then 7 again (a new episode with
            # the same seed: the policy is reset, and so is the recording's episode)
            request = {**observation, "prompt": task} | ({"episode_seed": 7} if i != 1 else {})
            reply = second.infer(request)
            sent.append((1 if i < 2 else 2, request, reply, None))
        second._ws.close()  # the open episode (seed 8) ends with the connection
    finally:
        log = server.stop()  # SIGTERM: the recording is joined
    assert "recorded episodes joined into" in log, log[-3000:]
    summary = json.loads((root / "meta" / "hf_vla_serve_record.json").read_text())
    assert [(e["episode"], e["frames"], e["success"], e["interventions"]) for e in summary["episodes"]] == \
        [(0, 3, True, 1), (1, 2, None, 0), (2, 1, None, 0)]
    assert [e["ended"] for e in summary["episodes"]] == ["episode_end", "a new episode_seed", "client disconnected"]
    assert summary["run"]["checkpoint"] == str(checkpoint.resolve()) and summary["run"]["head"] == HEAD
    data, table = _dataset(root / "dataset")
    assert data.meta.total_episodes == 3 and len(table["action"]) == 6
    assert {"observation.image", "observation.state", "action", "policy_action", "intervention"} <= set(data.features)
    acted = np.asarray(table["intervention"]).reshape(-1)
    for row, (episode, request, reply, intervention) in enumerate(sent):
        assert table["episode_index"][row] == episode
        np.testing.assert_array_equal(table["observation.state"][row], request["observation.state"])
        np.testing.assert_allclose(table["policy_action"][row], reply["actions"][0], rtol=0, atol=1e-7)
        expected = intervention if intervention is not None else reply["actions"][0]
        np.testing.assert_allclose(table["action"][row], expected, rtol=0, atol=1e-7)
        assert acted[row] == (intervention is not None)
        assert data.meta.tasks.index[table["task_index"][row]] == request["prompt"]
        image = np.asarray(data[row]["observation.image"]).transpose(1, 2, 0) * 255  # decoded video, CHW float
        assert np.abs(image - request["observation.image"]).mean() < 12  # lossy video of the 32 px frame


def test_a_killed_server_keeps_finished_episodes_and_the_same_run_continues(checkpoint, tmp_path, capsys):  # noqa: F811
    from hf_vla.serve import cli
    from hf_vla.serving.recorder import join_recording

    root = tmp_path / "served"
    server = Server("--checkpoint", str(checkpoint), "--record", str(root))
    try:
        client = _client(server.uri)
        observation, task = next(observations(1, seed=60))
        client.infer({**observation, "prompt": task, "episode_seed": 1})
        client.infer({**observation, "prompt": task, "episode_end": True})  # episode 0: finished
        client.infer({**observation, "prompt": task, "episode_seed": 2})  # episode 1: open when killed
        import time

        deadline = time.monotonic() + 60  # written by the recorder's thread: episode 0 finished, episode 1 begun
        while not ((root / "episodes" / "000000").is_dir() and (root / "episodes" / "000001.partial").is_dir()):
            assert time.monotonic() < deadline
            time.sleep(0.2)
    finally:
        server.process.send_signal(signal.SIGKILL)
        server.process.communicate()
    assert (root / "episodes" / "000000").is_dir() and not (root / "dataset").exists()
    assert join_recording(root) == root / "dataset"  # after a crash
    assert _dataset(root / "dataset")[0].meta.total_episodes == 1
    # the same checkpoint continues the recording; the killed server's open episode is dropped
    again = Server("--checkpoint", str(checkpoint), "--record", str(root))
    try:
        client = _client(again.uri)
        assert client.infer({**observation, "prompt": task, "episode_seed": 3})["recorded_episode"] == 1
    finally:
        log = again.stop()
    assert "removing the unfinished episode 000001.partial" in log
    summary = json.loads((root / "meta" / "hf_vla_serve_record.json").read_text())
    assert [e["episode"] for e in summary["episodes"]] == [0, 1]
    assert _dataset(root / "dataset")[0].meta.total_episodes == 2
    # another checkpoint, or a directory that is not a recording: refused in one line before serving
    other = tmp_path / "other_checkpoint"
    shutil.copytree(checkpoint, other)
    line = refused(cli, ["--checkpoint", str(other), "--record", str(root), "--port", "0"], capsys)
    assert f"--record {root}: recorded by another run (checkpoint: {str(checkpoint.resolve())!r} there" in line
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    line = refused(cli, ["--checkpoint", str(checkpoint), "--record", str(busy), "--port", "0"], capsys)
    assert "not empty and not a recording of hf_vla.serve" in line


def test_a_full_disk_stops_recording_and_serving_goes_on(demo_policy, tmp_path, caplog):  # noqa: F811
    from hf_vla.serving.codec import packb
    from hf_vla.serving.policy import PolicyRunner
    from hf_vla.serving.recorder import ServeRecorder
    from hf_vla.serving.server import PolicyServer

    model, processor = demo_policy
    recorder = ServeRecorder(tmp_path / "served", {"checkpoint": "x", "head": HEAD}, fps=10)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    recorder._create = full  # the first frame of an episode opens its dataset: the disk is full
    server = PolicyServer(PolicyRunner(model, processor), recorder=recorder, max_connections=1)
    runner = server.connection_runner()
    observation, task = next(observations(1, seed=70))
    request = packb({**observation, "prompt": task})
    with caplog.at_level(logging.ERROR, logger="hf_vla.serve"):
        assert server.infer(runner, request)["actions"].shape == (8, 2)
        recorder.close(join=False)
        assert server.infer(runner, request)["actions"].shape == (8, 2)  # serving goes on
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "recording stopped (OSError: [Errno 28] No space left on device)" in errors[0]
    assert recorder.stopped and not any((tmp_path / "served" / "episodes").iterdir())


def test_a_writer_too_far_behind_stops_recording_instead_of_growing(tmp_path, monkeypatch, caplog):
    import threading

    import hf_vla.serving.recorder as recorder_module
    from hf_vla.serving.recorder import Frame, ServeRecorder

    monkeypatch.setattr(recorder_module, "MAX_QUEUED", 1)
    recorder = ServeRecorder(tmp_path / "served", {"checkpoint": "x"}, fps=10)
    release = threading.Event()
    recorder._write_frame = lambda state, frame: release.wait(30)  # a disk that stalls
    frame = Frame({"cam": np.zeros((4, 4, 3), np.uint8)}, np.zeros(2, np.float32), "t", np.zeros(2, np.float32),
                  np.zeros(2, np.float32), False)
    with caplog.at_level(logging.ERROR, logger="hf_vla.serve"):
        for _ in range(5):  # the writer holds one, the queue one: the third stops the recording
            recorder.add(0, frame)
    assert recorder.stopped == "the writer fell 1 frames behind the requests"
    assert [r.getMessage() for r in caplog.records][0].startswith("recording stopped (the writer fell 1 frames")
    release.set()
    recorder.close(join=False)
