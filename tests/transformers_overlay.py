"""Run under transformers 5.25 (`../shared/oracles/transformers-5.25/install.sh DIR`, DIR first on PYTHONPATH), which
ships its own pi0.5 as model type "pi05": what plain transformers and transformers with hf_vla imported do with hf_vla's
checkpoints and with transformers' own.

    python tests/transformers_overlay.py plain HF_VLA_CHECKPOINT INPUTS OUT
    python tests/transformers_overlay.py with_hf_vla HF_VLA_CHECKPOINT LEGACY_CHECKPOINT WORK
    python tests/transformers_overlay.py parity EXPORTED OBSERVATIONS OUT
    python tests/transformers_overlay.py save_theirs TOKENIZER OUT

`plain` never imports hf_vla: each Auto class with and without `trust_remote_code`, and the remote-code model's logits
on INPUTS (a `torch.save`d dict of model inputs) into OUT.pt. `with_hf_vla` imports hf_vla first: the Auto mappings'
`pi05`, a tiny checkpoint saved by transformers' own `PI05ForConditionalGeneration` (in WORK) loaded by the Auto
classes and by hf_vla's loader, and both hf_vla checkpoints loaded by both. `parity` runs an hf_vla checkpoint exported
`--to transformers` in transformers' own `PI05Processor` and `PI05ForConditionalGeneration` (loaded strictly) on
OBSERVATIONS (a `torch.save`d dict: uint8 HWC images per sample and camera, tasks, states, noise, a timestep): the
velocity at the timestep, `sample_actions` and its actions in robot units (un-normalised with the processor's own
statistics, which transformers' processor leaves to the user) into OUT.pt. `save_theirs` saves a tiny
`PI05ForConditionalGeneration` (random weights) and its `PI05Processor` (SigLIP's image processor, TOKENIZER, quantile
statistics) to OUT, as a transformers user would. Prints one JSON object.
"""

from __future__ import annotations

import json
import sys


def _outcome(load) -> dict:
    try:
        loaded = load()
    except Exception as error:  # noqa: BLE001  (the kind of refusal is the finding)
        text = str(error).strip()
        return {"error": type(error).__name__, "line": text.splitlines()[0] if text else "",
                "lines": len(text.splitlines())}
    return {"class": f"{type(loaded).__module__}.{type(loaded).__name__}"}


def plain(checkpoint: str, inputs_file: str, out: str) -> dict:
    import torch
    import transformers

    found = {"transformers": transformers.__version__}
    for name in ("AutoConfig", "AutoModel", "AutoModelForImageTextToText", "AutoProcessor"):
        auto = getattr(transformers, name)
        found[name] = _outcome(lambda auto=auto: auto.from_pretrained(checkpoint))
        found[f"{name}+remote_code"] = _outcome(lambda auto=auto: auto.from_pretrained(checkpoint,
                                                                                       trust_remote_code=True))
    model = transformers.AutoModel.from_pretrained(checkpoint, trust_remote_code=True).eval()
    with torch.no_grad():
        torch.save({"logits": model(**torch.load(inputs_file)).logits}, out + ".pt")
    found["hf_vla_imported"] = any(name == "hf_vla" or name.startswith("hf_vla.") for name in sys.modules)
    return found


def with_hf_vla(checkpoint: str, legacy: str, work: str) -> dict:
    from transformers import (
        AutoConfig,
        AutoModel,
        AutoModelForImageTextToText,
        PI05Config,
        PI05ForConditionalGeneration,
    )
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING

    import hf_vla  # noqa: F401  (registers hf_vla's model types)
    from hf_vla.hub.resolve import load_pretrained
    from hf_vla.tiny import tiny_dit_config, tiny_vlm_config

    found = {"config_mapping_pi05": f"{CONFIG_MAPPING['pi05'].__module__}.{CONFIG_MAPPING['pi05'].__name__}",
             "model_mapping_pi05": MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING[CONFIG_MAPPING["pi05"]].__module__,
             "config_mapping_hf_vla_pi05": CONFIG_MAPPING["hf_vla_pi05"].__module__}
    theirs = f"{work}/transformers_pi05"
    PI05ForConditionalGeneration(PI05Config(vlm_config=tiny_vlm_config(), dit_config=tiny_dit_config(), chunk_size=4,
                                            max_action_dim=2)).save_pretrained(theirs)
    for label, path in (("transformers", theirs), ("hf_vla", checkpoint), ("legacy", legacy)):
        for name, load in (("AutoConfig", AutoConfig.from_pretrained),
                           ("AutoModelForImageTextToText", AutoModelForImageTextToText.from_pretrained),
                           ("AutoModel", AutoModel.from_pretrained),
                           ("load_pretrained", lambda p: load_pretrained(p)[0])):
            found[f"{label}:{name}"] = _outcome(lambda load=load, path=path: load(path))
    return found


def parity(exported: str, observations: str, out: str) -> dict:
    import torch
    from transformers import PI05ForConditionalGeneration, PI05Processor

    model, info = PI05ForConditionalGeneration.from_pretrained(exported, output_loading_info=True)
    processor = PI05Processor.from_pretrained(exported)
    given = torch.load(observations, weights_only=False)  # numpy images, written by the test
    inputs = processor(images=given["images"], text=given["tasks"], state=given["state"], return_tensors="pt")
    keys = ("input_ids", "attention_mask", "pixel_values", "pixel_attention_mask")
    inputs = {key: inputs[key] for key in keys}
    with torch.no_grad():
        velocity = model.eval()(**inputs, noise=given["noise"], timestep=given["timestep"]).logits
        chunk = model.sample_actions(**inputs, noise=given["noise"])
    dims = given["state"].shape[-1]
    q01, q99 = torch.tensor(processor.actions_q01), torch.tensor(processor.actions_q99)
    robot = (chunk[..., :dims] + 1.0) / 2.0 * (q99 - q01) + q01
    torch.save({"velocity": velocity, "chunk": chunk, "robot": robot}, out + ".pt")
    return {"loading": {key: sorted(map(str, value)) for key, value in info.items() if value},
            "image_token_id": int(processor.image_token_id)}


def save_theirs(tokenizer_dir: str, out: str) -> dict:
    import torch
    from transformers import (
        AutoTokenizer,
        PI05Config,
        PI05ForConditionalGeneration,
        PI05Processor,
        SiglipImageProcessor,
    )

    from hf_vla.tiny import tiny_dit_config, tiny_vlm_config

    torch.manual_seed(5)
    model = PI05ForConditionalGeneration(PI05Config(vlm_config=tiny_vlm_config(), dit_config=tiny_dit_config(),
                                                    chunk_size=4, max_action_dim=2))
    with torch.no_grad():  # transformers zero-initialises some heads: random everywhere, so every weight matters
        for parameter in model.parameters():
            parameter.copy_(torch.randn_like(parameter) * 0.1)
    size = model.config.vlm_config.vision_config.image_size
    patches = (size // model.config.vlm_config.vision_config.patch_size) ** 2
    image_processor = SiglipImageProcessor(size={"height": size, "width": size}, image_mean=[0.5] * 3,
                                           image_std=[0.5] * 3)
    image_processor.image_seq_length = patches
    processor = PI05Processor(image_processor=image_processor, tokenizer=AutoTokenizer.from_pretrained(tokenizer_dir),
                              state_q01=[-1.0, -2.0], state_q99=[1.0, 2.0], actions_q01=[-0.5, -1.0],
                              actions_q99=[0.5, 3.0], max_state_dim=2, chunk_size=4)
    model.config.vlm_config.image_token_id = processor.image_token_id
    model.save_pretrained(out)
    processor.save_pretrained(out)
    return {"image_token_id": int(processor.image_token_id)}


if __name__ == "__main__":
    mode, *paths = sys.argv[1:]
    result = {"plain": plain, "with_hf_vla": with_hf_vla, "parity": parity, "save_theirs": save_theirs}[mode](*paths)
    print("\nRESULT " + json.dumps(result), flush=True)  # after transformers' own prompts on stdout
