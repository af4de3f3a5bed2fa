"""Agent programs for tests/test_agent_program.py, named by import path as `agent:tests.agent_programs:NAME`."""
import os
import signal
import subprocess
import time
from pathlib import Path


def chatty(task, endpoint):
    """Two requests through the openai client, the second with the first reply in its history; the reward
    depends on what was sampled, so GRPO groups differ."""
    client = endpoint.openai_client()
    messages = [{"role": "system", "content": "You are a player."}, {"role": "user", "content": task["question"]}]
    first = client.chat.completions.create(model=endpoint.model, messages=messages, max_tokens=12)
    messages += [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Again."}]
    second = client.chat.completions.create(model=endpoint.model, messages=messages)
    text = (first.choices[0].message.content or "") + (second.choices[0].message.content or "")
    return float(text.count("o") % 2)


def by_mode(task, endpoint):
    """One request, then what the task's "mode" says: return, raise, outlive the timeout (ignoring SIGTERM,
    its pid and a subprocess's of its own in the task's "pid_file"), end its interpreter (os._exit, a segfault),
    or return junk."""
    client = endpoint.openai_client()
    client.chat.completions.create(model=endpoint.model, messages=[{"role": "user", "content": task["question"]}])
    mode = task["mode"]
    if mode == "raise":
        raise RuntimeError("the agent's own bug")
    if mode == "sleep":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # only a kill ends it
        if task.get("pid_file"):
            child = subprocess.Popen(["sleep", "600"])
            Path(task["pid_file"]).write_text(f"{os.getpid()} {child.pid}")
        time.sleep(task.get("sleep_s", 3))
        return 1.0
    if mode == "exit":
        os._exit(3)
    if mode == "segfault":
        os.kill(os.getpid(), signal.SIGSEGV)
    if mode == "junk":
        return "not a reward"
    return 0.5


async def async_agent(task, endpoint):
    """An ``async def`` program with the async client."""
    import openai

    client = openai.AsyncOpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key, max_retries=0)
    r = await client.chat.completions.create(model=endpoint.model, messages=[{"role": "user", "content": "hi"}])
    return 1.0 if r.choices[0].message.content is not None else 0.0


def tasks():
    """A task source by import path."""
    return [{"question": f"Push box {i}.", "split": "train" if i < 6 else "valid"} for i in range(8)]


def always_raises(task, endpoint):
    """A program with a bug in every episode (it makes no request)."""
    return task["no such key"]


def extreme(task, endpoint):
    """A finite reward past any bound (1e308 overflowed the batch's statistics)."""
    return -1e308 if task.get("split") == "valid" else 1e308


class NotAParser:
    """A class that is not a tool parser (its constructor takes an argument)."""

    def __init__(self, x):
        self.x = x


CALC = {"type": "function", "function": {"name": "calculator", "description": "Evaluate arithmetic.",
                                         "parameters": {"type": "object",
                                                        "properties": {"expression": {"type": "string"}}}}}


def forced_call(task, endpoint):
    """A request that must call the calculator (tool_choice required), then one streamed answer."""
    client = endpoint.openai_client()
    messages = [{"role": "user", "content": task["question"]}]
    first = client.chat.completions.create(model=endpoint.model, messages=messages, tools=[CALC],
                                           tool_choice="required")
    messages.append(first.choices[0].message.model_dump(exclude_none=True))
    text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=endpoint.model, messages=messages, stream=True) if c.choices)
    return float(text.count("o") % 2)


def appending(task, endpoint):
    """Three requests, each reply appended to the history as returned, then a new user message: the requests
    extend each other token for token where the template renders a reply back as it was sampled."""
    client = endpoint.openai_client()
    messages = [{"role": "system", "content": "You are a player."}, {"role": "user", "content": task["question"]}]
    for k in range(3):
        r = client.chat.completions.create(model=endpoint.model, messages=messages)
        messages += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": f"Go on {k}."}]
    return 1.0


def rewriting(task, endpoint):
    """``appending``, but before each later request it rewrites the first user message (a program that edits
    its history): the requests do not extend each other."""
    client = endpoint.openai_client()
    messages = [{"role": "system", "content": "You are a player."}, {"role": "user", "content": task["question"]}]
    for k in range(3):
        messages[1] = {"role": "user", "content": f"{task['question']} (try {k})"}
        r = client.chat.completions.create(model=endpoint.model, messages=messages)
        messages += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": f"Go on {k}."}]
    return 1.0


def competent_calculator(prompt):
    """A policy for examples/calc_*: calls the calculator on the task's expression, then answers what it
    returned (the tiny model's template has a tool role)."""
    tail = prompt.rsplit("<|im_start|>tool\n", 1)
    if len(tail) == 2:
        return f"<answer>{tail[1].split('<|im_end|>')[0].strip()}</answer>"
    expr = prompt.rsplit("Expression: ", 1)[1].split("<|im_end|>")[0]
    return '<tool_call>\n{"name": "calculator", "arguments": {"expression": "%s"}}\n</tool_call>' % expr
