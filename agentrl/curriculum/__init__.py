"""Curriculum controllers and schedules: CRPS's suffix-length controller, SPEAR's cosine schedules."""
from agentrl.curriculum.schedules import cosine_decay, cosine_warmup
from agentrl.curriculum.suffix_k import KController, initial_k

__all__ = ["KController", "initial_k", "cosine_warmup", "cosine_decay"]
