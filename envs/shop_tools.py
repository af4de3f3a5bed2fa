"""``shop-tools``: find the product a shopping instruction asks for with a search tool over a local
catalogue, the example retrieval tool env.

The corpus and the goals are WebShop's (``envs/webshop``: the generated catalogue, or the real WebShop files
under ``data_dir`` / ``$WEBSHOP_DATA``), searched by the same local BM25 index. Two tools:
``search(query)`` lists the top hits (id, title, price) and ``view(product_id)`` shows one product's
attributes and options. The final answer ``<answer>PRODUCT_ID</answer>`` ends the episode with WebShop's
reward for buying that product at its price with the options the instruction wants wherever it offers them
(the answer names a product only, so the options are taken as chosen well); success is reward 1.
The expert searches the goal's words, views the best hit and answers it.
"""
from __future__ import annotations

from typing import Any

from agentrl.envs.base import EnvError, Task, parse_task_id
from agentrl.envs.tools import Tool, ToolEnv, answer_action, call_action, decode_action
from agentrl.envs.webshop.catalogue import Goal, Product
from agentrl.envs.webshop.env import open_catalogue
from agentrl.envs.webshop.reward import achievable_reward, best_options, webshop_reward

HITS = 5  # results a search lists
SEARCH = {"type": "object", "properties": {"query": {"type": "string", "description": "words to search for"}},
          "required": ["query"]}
VIEW = {"type": "object", "properties": {"product_id": {"type": "string", "description": "an id from search"}},
        "required": ["product_id"]}


class ShopToolsEnv(ToolEnv):
    name = "shop-tools"
    default_max_steps = 8
    system = "You are a careful shopping assistant. You find products with a search tool."
    instruction_text = ("Find the product the instruction asks for. Use the search tool (and view to read a "
                        "product's details), then give its id as <answer>PRODUCT_ID</answer>.")

    def __init__(self, data_dir: str | None = None, catalogue_seed: int = 0, **kwargs: Any):
        super().__init__(**kwargs)
        self.cat, self.index, self._tasks = open_catalogue(self.name, data_dir, catalogue_seed)
        self.goal: Goal | None = None
        self._tools = [Tool("search", "Search the catalogue; returns the best matching products.", SEARCH,
                            self.search),
                       Tool("view", "Show a product's title, price, attributes and options.", VIEW, self.view)]

    def tasks(self, split: str) -> list[Task]:
        if split not in self._tasks:
            raise EnvError(f"shop-tools: unknown split '{split}'")
        return self._tasks[split]

    def get_task(self, task_id: str) -> Task:
        split, i = parse_task_id(self.name, task_id, {s: len(t) for s, t in self._tasks.items()})
        return self._tasks[split][i]

    def tools(self) -> list[Tool]:
        return self._tools

    # ----- the tools --------------------------------------------------------------------------------
    def search(self, query: str) -> str:
        hits = self.index.search(query, HITS)
        if not hits:
            return "No products match."
        return "\n".join(f"{a} | {self.cat.products[a].title} | ${self.cat.products[a].price:.2f}" for a in hits)

    def _product(self, product_id: str) -> Product:
        p = self.cat.products.get(product_id.strip().upper())
        if p is None:
            raise ValueError(f"no product {product_id!r}; use an id that search listed")
        return p

    def view(self, product_id: str) -> str:
        p = self._product(product_id)
        options = "; ".join(f"{k}: {', '.join(v)}" for k, v in p.options.items()) or "none"
        return (f"{p.asin} | {p.title} | ${p.price:.2f}\nAttributes: {', '.join(p.attributes) or 'none'}\n"
                f"Options: {options}")

    # ----- the episode ------------------------------------------------------------------------------
    def question(self, task: Task, seed: int) -> str:
        split, i = task.task_id.split("/")
        self.goal = self.cat.goals[split][int(i)]
        return f"Instruction: {self.goal.instruction}"

    def score_answer(self, answer: str) -> tuple[float, bool, dict[str, Any]]:
        assert self.goal is not None
        p = self.cat.products.get(answer.strip().upper())
        if p is None:
            return 0.0, False, {"expected": self.goal.asin, "answer_is_product": False}
        reward, parts = webshop_reward(p, self.goal, p.price, best_options(p, self.goal), self.cat.vocabulary)
        return reward, reward >= 1.0, dict(parts, expected=self.goal.asin, answer_is_product=True)

    def _snapshot_extra(self) -> Any:
        return self.goal

    def _restore_extra(self, extra: Any) -> None:
        self.goal = extra

    def expert_action(self) -> str | None:
        """Search the goal's words; view the hit that would score best (the goal in hand); answer it."""
        goal = self.goal
        if self.done or goal is None:
            return None
        calls = [(decode_action(a), obs) for a, obs in self.log]
        searched = [obs for a, obs in calls if a.kind == "call" and a.name == "search" and not obs.startswith("Error")]
        if not searched:
            return call_action("search", {"query": f"{' '.join(goal.attributes)} {goal.query}".strip()})
        hits = [line.split(" | ")[0] for line in searched[-1].splitlines() if " | " in line]
        if not hits:
            return answer_action("none")
        best = max(hits, key=lambda a: (achievable_reward(self.cat.products[a], goal, self.cat.vocabulary),
                                        -hits.index(a)))
        viewed = any(a.kind == "call" and a.name == "view" and a.arguments.get("product_id") == best
                     for a, _ in calls)
        return answer_action(best) if viewed else call_action("view", {"product_id": best})
