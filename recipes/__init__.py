"""Recipes: one module (hooks on the trainer loop) + one YAML (hyper-parameters) per method.
Importing this package registers every recipe class in ``agentrl.recipe.RECIPES``."""
from agentrl.recipes import baselines, crps, ipr, leafe, rro, spear, supervised  # noqa: F401
