"""The function tool of the multi-turn GRPO tests (``multi_turn.function_tool_path``; test code, not shipped).

verl executes this file in each agent-loop worker and registers every ``@function_tool`` in it. The answer is
fixed, so the tool turn's tokens are the same in every conversation.
"""

from verl.tools.function_tool import function_tool


@function_tool
def lookup() -> str:
    """Look up the answer to the question."""
    return "seven"
