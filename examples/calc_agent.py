"""An agent program written against the OpenAI client, trained by agentrl through its capture endpoint:

    PYTHONPATH=. agentrl train grpo --env agent:examples.calc_agent:run_agent \
        env_kwargs.tasks=examples/calc_tasks.jsonl rollout.max_new_tokens=96

Each task is {"expression": ..., "answer": ...}. The agent offers the model a calculator tool, runs the
calls the model makes, sends the results back as tool messages, and scores the final answer. Its requests ask
for up to 96 new tokens (a call takes up to 73 of the tiny model's tokens, 43 of SmolLM2's); the endpoint serves
at most the run's rollout.max_new_tokens (48 by default), hence the override. SmolLM2 on calc-tools' problems:
examples/calc_agent_smollm2.yaml.
"""
import json

from agentrl.envs.calc_tools import read_number
from agentrl.envs.calculator import CalcError, evaluate, format_number
from agentrl.rollout.parsing import tag_span

# The calc-tools env's own words (agentrl/envs/calc_tools.py): its tool, system message and question, so that
# calc-tools' SFT warm start serves this program's prompts token for token (examples/calc_agent_smollm2.yaml)
CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression and return its value.",
    "parameters": {"type": "object",
                   "properties": {"expression": {"type": "string",
                                                 "description": "numbers with + - * / ** // % and parentheses"}},
                   "required": ["expression"]}}}
SYSTEM = "You are a careful assistant. You solve arithmetic problems with a calculator tool."


def question(task: dict) -> str:
    return ("Compute the value of the expression. Call the calculator tool to do the arithmetic, then give the final "
            f"answer as <answer>NUMBER</answer>.\n\nExpression: {task['expression']}")


def calculator(expression: str) -> str:
    try:
        return format_number(evaluate(expression))
    except CalcError as e:
        return f"Error: {e}"


def solved(text: str, answer: int) -> bool:
    """calc-tools' rule for a final reply (its parse_tool_turn and score_answer): the number in the last complete
    <answer>...</answer> (the whole text where there is none), so the program trains toward what calc-tools
    trained its warm start toward. The rule this replaced (the text between the last <answer> and the first
    </answer> after it, as a string) took <answer>27</answer></answer> as right and 27.0 as wrong."""
    body = tag_span(text, "answer")
    got = read_number(body if body is not None else text)
    return got is not None and got == answer


def run_agent(task: dict, endpoint) -> dict:
    client = endpoint.openai_client()  # openai.OpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question(task)}]
    for _ in range(4):
        reply = client.chat.completions.create(model=endpoint.model, messages=messages, tools=[CALCULATOR],
                                               max_tokens=96)
        msg = reply.choices[0].message
        if not msg.tool_calls:  # a final answer
            won = solved(msg.content or "", task["answer"])
            return {"reward": float(won), "success": won}
        messages.append(msg.model_dump(exclude_none=True))
        for call in msg.tool_calls:
            args = json.loads(call.function.arguments)
            result = calculator(args.get("expression", "")) if call.function.name == "calculator" \
                else f"Error: unknown tool {call.function.name}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return {"reward": 0.0, "success": False}
