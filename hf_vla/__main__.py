"""`python -m hf_vla`: the commands, one line each (`python -m hf_vla.<command> --help` for their arguments)."""

COMMANDS = {
    "demo": "the built-in demo end to end: data, training, closed-loop evaluation (what `make demo` runs)",
    "train": "train or fine-tune from a JSON config (CONFIG.json [--key value ...]; also under accelerate launch)",
    "evaluate": "closed-loop success of a checkpoint or a policy server in a simulator (ColorReach, Meta-World, LIBERO)",
    "rl": "improve a policy from its own rollouts in a simulator (GRPO on Flow-SDE likelihoods; CONFIG.json [--key value])",
    "serve": "serve a checkpoint to robots over websocket (openpi's protocol)",
    "record": "record a simulator's scripted expert as a LeRobot dataset (Meta-World, ColorReach)",
    "convert": "lerobot pi0 / pi0.5 checkpoints to hf_vla and back (--to lerobot, lerobot_plugin), or merge a LoRA run",
    "recap": "learn from collected episodes (RECAP): annotate advantages with a value model (annotate --value ...)",
}


def write_command_caches() -> None:
    """`python -m hf_vla --write-command-cache` (for developers): re-write the cached `--help`, field types and key
    names of train and rl (hf_vla/templates/commands/, read by `hf_vla.parser.answer_early`) from their live parsers,
    after a field of theirs, or transformers, changes; tests/test_cli_startup.py fails until they are equal."""
    import hf_vla.train
    from hf_vla.parser import write_command_cache
    from hf_vla.rl.__main__ import rl_parser

    for command, parser in (("train", hf_vla.train.parser()), ("rl", rl_parser())):
        print(f"wrote {write_command_cache(command, parser)}")


def main() -> None:
    import sys

    if sys.argv[1:] == ["--write-command-cache"]:
        return write_command_caches()
    print(__doc__.split("\n")[0].replace("`python -m hf_vla`: the commands", "hf_vla commands"))
    for name, text in COMMANDS.items():
        print(f"  python -m hf_vla.{name:<9} {text}")
    print("Every command takes --help (arguments and defaults) and --verbose (library logs).")


if __name__ == "__main__":
    main()
