"""Small Gymnasium envs with text observations, standing in for an outside suite in the adapter tests."""
import itertools

import gymnasium as gym
from gymnasium import spaces

CHARS = "".join(map(chr, range(32, 127))) + "\n"
TICKS = itertools.count()


class CountdownEnv(gym.Env):
    """Say the numbers down from a seeded start to zero; reward 1 at zero."""

    def __init__(self, noisy: bool = False):
        self.observation_space = spaces.Text(256, min_length=0, charset=CHARS)
        self.action_space = spaces.Text(64, min_length=0, charset=CHARS)
        self.noisy, self.n = noisy, 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.n = int(self.np_random.integers(2, 6))
        return f"Count down from {self.n}. Say the next number.", {}

    def step(self, action):
        if action.strip() == str(self.n - 1):
            self.n -= 1
        done = self.n == 0
        # noisy: a process-wide counter in the text, so the same actions never give the same state twice
        tick = f" (tick {next(TICKS)})" if self.noisy else ""
        return (f"Now at {self.n}.{tick}" + ("" if done else " Say the next number.")), float(done), done, False, {}


class PixelEnv(CountdownEnv):
    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return [0, 0, 0], {}


gym.register("agentrl_test/Countdown-v0", entry_point="tests.gym_text_envs:CountdownEnv")
gym.register("agentrl_test/NoisyCountdown-v0", entry_point="tests.gym_text_envs:CountdownEnv", kwargs={"noisy": True})
gym.register("agentrl_test/Pixels-v0", entry_point="tests.gym_text_envs:PixelEnv")
