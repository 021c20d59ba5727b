"""The stage a Meta-World scripted expert is in, from its own decision: which branch of its policy's `_desired_pos`
returned the target it moves to. Each `return` of that method is a stage (reach above the object, lower onto it,
grasp, carry it to the goal); `hf_vla.record` writes the stage's words as each frame's `subtask` (pi0.5's high-level
inference, docs/subtasks.md). Read by tracing the method's own execution on the frame's observation (the same pure
function the expert calls for its action), never from a timer or a re-implementation of its conditions.
"""

from __future__ import annotations

import ast
import functools
import inspect
import sys
import textwrap

# The words of each stage, in the source order of `_desired_pos`' returns, with the order the expert passes through
# them (assembly's second return is its last stage); tasks not named here get "stage k" in source order.
STAGES: dict[str, tuple[tuple[str, int], ...]] = {
    "pick-place-v3": (("move above the puck", 0), ("lower to the puck", 1), ("grasp the puck", 2),
                      ("carry the puck to the goal", 3)),
    "assembly-v3": (("move above the wrench", 0), ("lower the wrench onto the peg", 4), ("lower to the wrench", 1),
                    ("lift the wrench", 2), ("carry the wrench above the peg", 3)),
    "basketball-v3": (("move above the ball", 0), ("lower to the ball", 1), ("lift the ball to the hoop", 2),
                      ("carry the ball over the hoop", 3)),
    "peg-insert-side-v3": (("move above the peg", 0), ("lower to the peg", 1), ("carry the peg to the hole", 2),
                           ("insert the peg", 3)),
    "hammer-v3": (("move above the hammer", 0), ("lower to the hammer", 1), ("lift the hammer to the nail", 2),
                  ("hit the nail", 3)),
}


@functools.cache
def _returns(function) -> tuple[tuple[int, int], ...]:
    """(first, last) source lines of each `return` of `function`, in source order (absolute line numbers)."""
    source = textwrap.dedent(inspect.getsource(function))
    offset = function.__code__.co_firstlineno - 1
    tree = ast.parse(source)
    body = next(node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef))
    found = [node for node in ast.walk(body) if isinstance(node, ast.Return)]
    return tuple(sorted((node.lineno + offset, node.end_lineno + offset) for node in found))


def stage_count(policy) -> int:
    """How many stages the policy's `_desired_pos` has (0: it has none)."""
    function = getattr(type(policy), "_desired_pos", None)
    return len(_returns(function)) if function is not None else 0


def expert_stage(policy, raw_obs) -> int | None:
    """The index (source order) of the `return` of `policy._desired_pos` that runs for `raw_obs`; None for a policy
    without that method."""
    function = getattr(type(policy), "_desired_pos", None)
    if function is None:
        return None
    code, lines = function.__code__, []

    def trace(frame, event, arg):
        if frame.f_code is not code:
            return None
        if event == "return":
            lines.append(frame.f_lineno)
        return trace

    previous = sys.gettrace()
    sys.settrace(trace)
    try:
        function(policy._parse_obs(raw_obs))
    finally:
        sys.settrace(previous)
    if not lines:
        return None
    return next((i for i, (first, last) in enumerate(_returns(function)) if first <= lines[-1] <= last), None)


def stage_text(task: str, index: int | None) -> str | None:
    """The words of stage `index` of `task`'s expert (see `STAGES`)."""
    if index is None:
        return None
    named = STAGES.get(task)
    return named[index][0] if named is not None and index < len(named) else f"stage {index + 1}"


def stage_order(task: str, text: str) -> int | None:
    """Where stage `text` comes in the expert's pass through `task` (0 first), or None when unknown."""
    for words, order in STAGES.get(task, ()):
        if words == text:
            return order
    if text.startswith("stage ") and text[6:].isdigit():
        return int(text[6:]) - 1
    return None


__all__ = ["STAGES", "expert_stage", "stage_count", "stage_order", "stage_text"]
