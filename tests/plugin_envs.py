"""A user's plugin module (test-only): it registers an env name, as ``docs/guides/own-env.md`` shows."""
from agentrl.envs import register

register("plugged-bandit", "agentrl.envs.bandit:BanditEnv", "the bandit under a plugin's name")
