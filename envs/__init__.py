"""Text environments behind one Gym-style API (see envs/base.py) and their registry."""
from agentrl.envs.base import EnvError, PromptSpec, Task, TextEnv
from agentrl.envs.registry import make, names, register
from agentrl.envs.replay import DivergenceError, Trace, replay

__all__ = ["EnvError", "PromptSpec", "Task", "TextEnv", "make", "names", "register", "DivergenceError", "Trace",
           "replay"]
