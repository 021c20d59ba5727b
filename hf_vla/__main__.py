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


def main() -> None:
    print(__doc__.split("\n")[0].replace("`python -m hf_vla`: the commands", "hf_vla commands"))
    for name, text in COMMANDS.items():
        print(f"  python -m hf_vla.{name:<9} {text}")
    print("Every command takes --help (arguments and defaults) and --verbose (library logs).")


if __name__ == "__main__":
    main()
