"""Text environments behind one Gym-style API (see envs/base.py) and their registry."""
from agentrl.envs.base import EnvError, PromptSpec, Task, TextEnv
from agentrl.envs.registry import make, names, register
from agentrl.envs.replay import DivergenceError, Trace, replay
from agentrl.envs.gymnasium_api import register_all as _register_gymnasium

_register_gymnasium()  # gymnasium.make("agentrl/Sokoban-v0") and friends

__all__ = ["EnvError", "PromptSpec", "Task", "TextEnv", "make", "names", "register", "DivergenceError", "Trace",
           "replay"]
