"""An agent program written with the OpenAI Agents SDK (an ``Agent`` with a function tool, run by ``Runner``
on the Responses API model class, the SDK's default), trained by agentrl through its capture endpoint as it is:

    PYTHONPATH=. agentrl train grpo --env agent:examples.agents_sdk_agent:run_agent \
        env_kwargs.tasks=examples/calc_tasks.jsonl

Needs ``pip install openai-agents``. The tasks and the calculator are ``examples/calc_agent.py``'s; the
runner loops model -> tool -> model until the model answers without a call (at most 4 model turns).
"""
import openai
from agents import Agent, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
from agents.exceptions import MaxTurnsExceeded, ModelBehaviorError

from examples.calc_agent import SYSTEM, question, solved
from examples.calc_agent import calculator as evaluate

set_tracing_disabled(True)  # the SDK would send its traces to OpenAI's servers


@function_tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression and return its value."""
    return evaluate(expression)


async def run_agent(task: dict, endpoint) -> dict:
    # closed within the episode's event loop (asyncio.run closes the loop when the program returns)
    async with openai.AsyncOpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key, max_retries=0,
                                  timeout=endpoint.timeout_s) as client:
        agent = Agent(name="calculator", instructions=SYSTEM,
                      tools=[calculator], model=OpenAIResponsesModel(model=endpoint.model, openai_client=client))
        try:
            result = await Runner.run(agent, question(task), max_turns=4)
        # the policy's doing, so a wrong answer, not the program's failure: still calling tools after 4 model
        # turns, or a reply the SDK will not take (cut at its max tokens: status "incomplete"; a call it cannot read)
        except (MaxTurnsExceeded, ModelBehaviorError):
            return {"reward": 0.0, "success": False}
    won = solved(str(result.final_output or ""), task["answer"])
    return {"reward": float(won), "success": won}
