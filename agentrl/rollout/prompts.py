"""Per-step prompt text in the papers' templates.

``react`` follows CRPS appendix C (task, step count, a window of recent observation/action pairs, the
current observation and the admissible actions, ``<think>`` then ``<action>``). ``ragen`` follows RAGEN
appendix E (rules, symbol legend, board, action budget with `` || ``, ``<answer>``). The result is a
list of chat messages; turning them into token ids is the tokenizer's chat template's job.
"""
from __future__ import annotations

from typing import Any

from agentrl.envs.base import PromptSpec


def format_history(history: list[tuple[str, str]]) -> str:
    return "\n".join(f"[Observation {i + 1}: '{o}', Action {i + 1}: '{a}']" for i, (o, a) in enumerate(history))


def react_user(spec: PromptSpec, instruction: str, obs: str, history: list[tuple[str, str]], step: int,
               admissible: list[str] | None, history_len: int = 2) -> str:
    window = history[-history_len:] if history_len > 0 else []
    lines = [spec.system, f"Your task is to: {instruction}"]
    if step > 0:
        lines.append(f"Prior to this step, you have already taken {step} step(s). Below are the most recent "
                     f"{len(window)} observations and the corresponding actions you took:\n{format_history(window)}")
    lines.append(f"You are now at step {step + 1} and your current observation is: {obs}")
    if admissible:
        lines.append("Your admissible actions of the current situation are: [" + ", ".join(
            f"'{a}'" for a in admissible) + "].")
    lines.append("Now it's your turn to take an action. You should first reason step-by-step about the current "
                 "situation. This reasoning process MUST be enclosed within <think> </think> tags. Once you've "
                 f"finished your reasoning, you should choose an admissible action for current step and present "
                 f"it within <{spec.answer_tag}> </{spec.answer_tag}> tags.")
    return "\n\n".join(lines)


PROMPTS = ("paper", "compact", "compact_tried", "numbered")


def listed_actions(admissible: list[str] | None, history: list[tuple[str, str]], prompt: str) -> list[str] | None:
    """The admissible actions in the order the prompt lists them. ``compact_tried``: the untried ones only;
    ``numbered``: the untried ones, then the tried ones (each then has a number the policy answers with)."""
    if admissible is None or prompt not in ("compact_tried", "numbered"):
        return admissible
    tried = {a for _, a in history}
    fresh = [a for a in admissible if a not in tried]
    return fresh if prompt == "compact_tried" else fresh + [a for a in admissible if a in tried]


def numbered_actions(cfg: Any, admissible: list[str] | None, history: list[tuple[str, str]]) -> list[str] | None:
    """What an answer that is a number stands for: the actions as ``rollout.prompt: numbered`` lists them
    (``cfg``: the rollout config), or None where the prompt numbers nothing. Rollouts, demonstrations and
    their constrained choices all read it here, so the numbers the policy learns are the ones it is shown."""
    if cfg.prompt != "numbered" or not cfg.show_admissible or admissible is None:
        return None
    return listed_actions(admissible, history, "numbered")


def compact_user(spec: PromptSpec, instruction: str, obs: str, history: list[tuple[str, str]], step: int,
                 admissible: list[str] | None, history_len: int = 2, prompt: str = "compact") -> str:
    """The ``react`` template's content in fewer tokens (``rollout.prompt: compact``): the task, the actions
    taken before the history window (a few tokens each: where the agent has been), the window's
    observations and actions, the observation and the admissible actions, without boilerplate.

    ``prompt: compact_tried``: instead of the earlier actions, every action taken
    so far once, in first-taken order ("Tried:"), and only the admissible actions not among them
    ("Actions:"): "where have I not been yet" is read off a list rather than inferred from the history.
    ``prompt: numbered``: the same, every admissible action numbered (untried ones
    first) and the answer is a number: one or two tokens to choose, and no action text to copy from the
    history."""
    window = history[-history_len:] if history_len > 0 else []
    earlier = history[:len(history) - len(window)]
    lines = [f"Task: {instruction}", f"Step {step + 1}."]
    tried = list(dict.fromkeys(a for _, a in history))
    if prompt != "compact" and tried:
        lines.append("Tried: " + " | ".join(tried))
    elif earlier:
        lines.append("Earlier actions: " + " | ".join(a for _, a in earlier))
    lines += [f"{o}\n> {a}" for o, a in window]
    lines.append(obs)
    if admissible:
        listed = listed_actions(admissible, history, prompt)  # compact_tried: a tried one is on "Tried:"
        if prompt == "numbered":
            lines.append("Actions: " + " | ".join(f"{k + 1}: {a}" for k, a in enumerate(listed)))
            lines.append(f"Answer with <{spec.answer_tag}>the number of one action</{spec.answer_tag}>.")
            return "\n".join(lines)
        lines.append("Actions: " + " | ".join(listed))
    lines.append(f"Answer with <{spec.answer_tag}>one action</{spec.answer_tag}>.")
    return "\n".join(lines)


def ragen_user(spec: PromptSpec, obs: str, admissible: list[str] | None) -> str:
    parts = [spec.instruction]
    if spec.symbols:
        parts.append(spec.symbols)
    parts.append(obs if not spec.symbols else f"State:\n{obs}")
    if admissible and spec.max_actions_per_turn > 1:
        parts.append("Your available actions are:\n" + ", ".join(admissible) + "\nYou can make up to "
                     f"{spec.max_actions_per_turn} actions, separated by the action separator "
                     f"\"{spec.action_separator.strip()}\"")
    return "\n".join(parts)


def step_messages(spec: PromptSpec, instruction: str, obs: str, history: list[tuple[str, str]], step: int,
                  admissible: list[str] | None, history_len: int = 2, note: str = "", prompt: str = "paper"
                  ) -> list[dict[str, str]]:
    """Messages for one decision in the windowed-history mode; ``note`` (LEAFE's experience) ends the
    user message. ``prompt``: "paper" | "compact" (the react template without its boilerplate) |
    "compact_tried" (compact, with the actions already tried listed apart) | "numbered" (compact_tried
    with numbered actions, answered by number)."""
    tail = f"\n\n{note}" if note else ""
    admissible = admissible if spec.list_actions else None
    if spec.style == "ragen":
        return [{"role": "system", "content": spec.system},
                {"role": "user", "content": ragen_user(spec, obs, admissible) + tail}]
    if prompt != "paper":
        return [{"role": "user", "content": compact_user(spec, instruction, obs, history, step, admissible,
                                                         history_len, prompt) + tail}]
    return [{"role": "user", "content": react_user(spec, instruction, obs, history, step, admissible, history_len)
             + tail}]


def followup_user(spec: PromptSpec, obs: str, admissible: list[str] | None) -> str:
    """The next user message in full-history chat mode (RAGEN): the new state and what can be done."""
    text = f"State:\n{obs}" if spec.style == "ragen" else f"Observation: {obs}"
    if admissible and spec.style != "ragen" and spec.list_actions:
        text += "\nYour admissible actions are: [" + ", ".join(f"'{a}'" for a in admissible) + "]."
    if spec.max_actions_per_turn > 1:
        text += (f"\nYou can make up to {spec.max_actions_per_turn} actions, "
                 f"separated by \"{spec.action_separator.strip()}\".")
    return text
