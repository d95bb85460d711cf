"""The function tool of the multi-turn GRPO tests (``multi_turn.function_tool_path``; test code, not shipped).

verl executes this file in each agent-loop worker and registers every ``@function_tool`` in it; the answer is fixed,
so the tool turn's tokens are the same in every conversation. Executing it also loads ``tiny_tool_agent.py`` (the
``tiny_calls`` parser and the ``careless_tool_agent`` loop) into that worker, before verl builds any agent loop:
the one override carries everything, on a local run and on a Ray cluster's workers alike.
"""

import importlib.util
import sys
from pathlib import Path

from verl.tools.function_tool import function_tool

if "tiny_tool_agent" not in sys.modules:  # the name hydra resolves careless_tool_agent's _target_ by
    _spec = importlib.util.spec_from_file_location(
        "tiny_tool_agent", Path(__file__).with_name("tiny_tool_agent.py")
    )
    _agent = importlib.util.module_from_spec(_spec)
    sys.modules["tiny_tool_agent"] = _agent
    _spec.loader.exec_module(_agent)


@function_tool
def lookup() -> str:
    """Look up the answer to the question."""
    return "seven"
