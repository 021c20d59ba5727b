"""Does the backbone find the objects? A checkpoint trained with location targets, read back on held-out frames.

    python -m benchmarks.closed_loop.location_probe data_cache/metaworld_loc/locations --work data_cache/metaworld_loc
    python -m benchmarks.closed_loop.location_probe data_cache/mt50_bench/hf_vla_fast_ki_locations --data data_cache/mt50_loc

(`--data`: one recording of many tasks, e.g. MT50's, the split and the task per frame taken from it; frames are
grouped by their task's description, so tasks that share one, push and push-back, are one row.)

A checkpoint trained with `target_text_key: locations` (configs/pi05_metaworld_cotrain_locations.json) predicts, after
each chunk's FAST tokens, the gripper, the task's object and its goal as `<locY><locX> name` points. On the run's own
validation episodes (the same split: `--validation_ratio`, `--split_seed`) each coordinate token is predicted with the
true tokens before it (teacher forcing: the object's name and the previous points are given, its coordinates are
not), the arg-max taken over the 1024 `<loc>` ids; its error is in pixels of the training image. The baseline is the
best constant: each (task, name, axis)'s median over the same validation frames, which no model that ignores the
image beats. JSON to stdout (and `--output`): per task and name, the model's and the baseline's mean pixel error
(Euclidean over the two coordinates; and per axis, y then x), the range the truth spans and the share of frames
within 2 px.
"""

from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

from hf_vla.data.stream import StreamSettings

REPO = Path(__file__).resolve().parents[2]
# run as a script, its folder is on the path: the five-task benchmark's dataset spec
from benchmarks.common import dataset_spec  # noqa: E402

LOC = re.compile(r"<loc(\d{4})><loc(\d{4})> ([^;<]+?)\s*(?:;|$)")


def probe(checkpoint: Path, work: Path, validation_ratio: float = 0.05, split_seed: int = 0, batch_size: int = 64,
          max_batches: int | None = None, data: Path | None = None) -> dict:
    from hf_vla import PI05ForConditionalGeneration, PI05Processor
    from hf_vla.data import PI05Collator, WeightedDatasetMixture

    model = PI05ForConditionalGeneration.from_pretrained(checkpoint).eval()
    processor = PI05Processor.from_pretrained(checkpoint)
    tokenizer = processor.tokenizer
    loc_ids = torch.tensor(tokenizer.convert_tokens_to_ids([f"<loc{i:04d}>" for i in range(1024)]))
    if int(loc_ids.min()) < 0 or (loc_ids == tokenizer.unk_token_id).any():
        raise SystemExit(f"{checkpoint}: its tokenizer has no <loc0000>..<loc1023> tokens")
    bin_of_id = {int(i): b for b, i in enumerate(loc_ids)}
    spec = dataset_spec(work, target_text_key="locations") if data is None else [
        {"root": str(data), "name": data.name, "cameras": ["observation.image"], "control_mode": "delta_xyz_gripper",
         "target_text_key": "locations"}]
    mixture = WeightedDatasetMixture(spec, validation_ratio=validation_ratio, split_seed=split_seed)
    names = [source.name for source in mixture.sources]
    stream = mixture.validation_stream(StreamSettings(processor.image_size, model.config.chunk_size, batch_size))
    collator = PI05Collator(processor)
    # (task, name) -> list of (true y, true x, predicted y, predicted x) in bins
    points: dict[tuple[str, str], list] = defaultdict(list)
    with torch.no_grad():
        for index, samples in enumerate(stream):
            if max_batches is not None and index >= max_batches:
                break
            batch = collator(samples)
            labels = batch["labels"]
            inputs = {k: v for k, v in batch.items() if k in ("input_ids", "attention_mask", "pixel_values",
                                                              "pixel_attention_mask", "state", "actions",
                                                              "action_is_pad", "labels")}
            logits = model(**inputs, output_token_logits=True).token_logits  # [B, L_t, vocab], teacher-forced
            predicted = loc_ids[logits[..., loc_ids].argmax(-1)]  # the arg-max among the <loc> ids
            for row, sample in enumerate(samples):
                text = sample.get("target_text")
                if not text:
                    continue
                ids = labels[row].tolist()
                positions = [p for p, i in enumerate(ids) if i in bin_of_id]
                found = LOC.findall(text)
                if len(positions) != 2 * len(found):
                    raise SystemExit(f"{text!r}: {len(found)} points but {len(positions)} <loc> labels")
                task = names[int(sample["source_index"])] if data is None else sample["task"]
                for k, (y, x, name) in enumerate(found):
                    py, px = (bin_of_id[int(predicted[row, positions[2 * k + a]])] for a in (0, 1))
                    points[(task, name.strip())].append((int(y), int(x), py, px))
    size = processor.image_size
    report: dict = {"checkpoint": str(checkpoint), "image_size": size, "tasks": {}}
    all_model, all_base = [], []
    for (task, name), rows in sorted(points.items()):
        values = np.asarray(rows, dtype=np.float64) * size / 1024  # bins -> pixels of the training image
        truth, guess = values[:, :2], values[:, 2:]
        model_error = np.linalg.norm(guess - truth, axis=1)
        base_error = np.linalg.norm(np.median(truth, axis=0) - truth, axis=1)
        all_model.append(model_error)
        all_base.append(base_error)
        report["tasks"].setdefault(task, {})[name] = {
            "frames": len(rows), "model_px": round(float(model_error.mean()), 2),
            "constant_px": round(float(base_error.mean()), 2),
            "model_px_yx": [round(float(v), 2) for v in np.abs(guess - truth).mean(0)],
            "truth_range_px_yx": [round(float(v), 1) for v in np.ptp(truth, axis=0)],
            "model_within_2px": round(float((model_error <= 2).mean()), 3),
            "constant_within_2px": round(float((base_error <= 2).mean()), 3)}
    if all_model:
        report["mean_model_px"] = round(float(np.concatenate(all_model).mean()), 2)
        report["mean_constant_px"] = round(float(np.concatenate(all_base).mean()), 2)
    return report


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--work", type=Path, default=REPO / "data_cache" / "metaworld_loc",
                        help="the five-task recording with locations (its data/<task> datasets)")
    parser.add_argument("--data", type=Path, default=None,
                        help="instead of --work: one recording with locations holding many tasks (MT50's)")
    parser.add_argument("--validation_ratio", type=float, default=0.05)
    parser.add_argument("--split_seed", type=int, default=0)
    parser.add_argument("--max_batches", type=int, default=None)
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    report = probe(args.checkpoint, args.work, args.validation_ratio, args.split_seed, max_batches=args.max_batches,
                   data=args.data)
    text = json.dumps(report, indent=2)
    if args.output:
        args.output.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
