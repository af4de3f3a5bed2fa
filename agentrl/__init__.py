"""agentrl: multi-turn reinforcement learning for LLM agents."""
__version__ = "0.1.0"
