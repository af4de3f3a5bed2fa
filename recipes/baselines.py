"""The online RL baselines. Their differences are hyper-parameters (estimator, clipping, KL, filters,
prompt mode), so they share the base recipe and differ in their YAML files."""
from agentrl.recipe import RECIPES, GroupRecipe

for _name in ("grpo", "dr_grpo", "rloo", "reinforce_pp", "ppo", "gigpo", "starpo", "starpo_s", "starpo_ppo"):
    RECIPES.register(_name)(GroupRecipe)
