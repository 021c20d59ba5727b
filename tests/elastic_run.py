"""Run `hf_vla.train` and record the provenance of every training batch (one JSON line per micro-batch and rank).

    python tests/elastic_run.py RECORD_PREFIX CONFIG.json [--key value ...]

Writes `RECORD_PREFIX.rank<R>.jsonl` with the optimizer step, the rank and each sample's (source, episode, frame),
so a test can check which samples a run consumed, across a resume on another number of processes.
"""

import json
import os
import sys

from hf_vla.training.trainer import VLATrainer

prefix = sys.argv[1]
rank = int(os.environ.get("RANK", "0"))
original = VLATrainer.training_step


def training_step(self, model, inputs, num_items_in_batch=None):
    with open(f"{prefix}.rank{rank}.jsonl", "a") as handle:
        handle.write(json.dumps({"step": self.state.global_step + 1, "rank": rank,
                                 "samples": list(zip(inputs["source_index"].tolist(), inputs["episode_index"].tolist(),
                                                     inputs["frame_index"].tolist()))}) + "\n")
    return original(self, model, inputs, num_items_in_batch)


VLATrainer.training_step = training_step

from hf_vla.train import cli  # noqa: E402

cli(sys.argv[2:])
