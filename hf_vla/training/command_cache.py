"""`python -m hf_vla.training.command_cache`: re-write the cached `--help` and key names of train and rl
(hf_vla/templates/commands/, read by `hf_vla.parser.answer_early`) from their live parsers, after a field of theirs, or
transformers, changes; tests/test_cli_startup.py fails until they are equal."""

from __future__ import annotations


def main() -> None:
    import hf_vla.train
    from hf_vla.parser import write_command_cache
    from hf_vla.rl.__main__ import rl_parser

    for command, parser in (("train", hf_vla.train.parser()), ("rl", rl_parser())):
        print(f"wrote {write_command_cache(command, parser)}")


if __name__ == "__main__":
    main()
