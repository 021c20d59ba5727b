"""Learning from experience with RECAP (pi*0.6): docs/recap.md has the method and a round's commands.

    python -m hf_vla.recap annotate [CONFIG.json] --value VALUE_CKPT [VALUE_CKPT ...] --datasets '[{...}, ...]'
        --output DIR [--lookahead 50] [--positive_fraction 0.3] [--allow_unlabelled] [--overwrite]

writes each frame's return, value, advantage and `advantage_positive` into a new LeRobot dataset (the source is
never written); train the policy on it with the dataset field `"advantage": {"key": "advantage_positive"}`. The value
model is trained with `python -m hf_vla.train` and `"policy": "pi05_value"`; several `--value` models, each trained
with the dataset field `hold_out_fold` [k, K], annotate cross-fitted (each episode by the model that did not see it).
"""

from __future__ import annotations

import sys

from hf_vla.cli import run
from hf_vla.errors import ConfigError

COMMANDS = ("annotate",)


def main(argv=None):
    """The command; raises `hf_vla.errors.VLAError` for bad arguments (`cli` prints them as one line)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return None
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        raise ConfigError(f"{command!r}: a subcommand of python -m hf_vla.recap, one of {list(COMMANDS)} (e.g. "
                          "python -m hf_vla.recap annotate --help)")
    from hf_vla.parser import CommandParser
    from hf_vla.recap.annotate import AnnotateArguments, annotate

    args = CommandParser("python -m hf_vla.recap annotate", (AnnotateArguments,), __doc__).parse(rest)
    if args is None:
        return None
    from hf_vla.cli import setup_logging

    setup_logging()
    return annotate(args)


def cli(argv=None):
    return run("hf_vla.recap", main, argv)


if __name__ == "__main__":
    cli()
