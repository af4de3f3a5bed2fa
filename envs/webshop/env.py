"""WebShop's interaction, page by page, in its text mode.

Pages: search -> results (10 per page, up to 50 hits, ``next >`` / ``< prev``) -> item (option values,
``description`` / ``features`` / ``reviews`` sub-pages, ``buy now``). Actions are ``search[query]`` on the
search page and ``click[label]`` for a listed clickable; the episode ends on ``click[buy now]`` with
WebShop's matching reward in [0, 1] (``envs.webshop.reward``); success is reward 1.
"""
from __future__ import annotations

import copy
import os
import re
from typing import Any

from agentrl.envs.base import EnvError, PromptSpec, Task, TextEnv, parse_task_id
from agentrl.envs.webshop.catalogue import Catalogue, Goal, Product, generate_catalogue, load_webshop_files
from agentrl.envs.webshop.reward import achievable_reward, best_options, webshop_reward
from agentrl.envs.webshop.search import BM25

SEP = " [SEP] "
PER_PAGE, MAX_RESULTS = 10, 50
SUB_PAGES = ("description", "features", "reviews")
ACTION = re.compile(r"^(search|click)\[(.*)\]$", re.S | re.I)

_CATALOGUES: dict[str, tuple[Catalogue, BM25]] = {}


def catalogue(data_dir: str | None, seed: int) -> tuple[Catalogue, BM25]:
    """One catalogue and index per process, shared by every env instance that asks for the same one."""
    key = data_dir or f"generated-{seed}"
    if key not in _CATALOGUES:
        cat = load_webshop_files(data_dir) if data_dir else generate_catalogue(seed)
        _CATALOGUES[key] = (cat, BM25(cat.products))
    return _CATALOGUES[key]


def department(goal: Goal) -> str:
    return goal.category_path()[0] if goal.product_category else "all"


def open_catalogue(env_name: str, data_dir: str | None, seed: int) -> tuple[Catalogue, BM25, dict[str, list[Task]]]:
    """The catalogue an env of WebShop's goals reads (``data_dir``, else ``$WEBSHOP_DATA``, else the generated
    one), its index, and its goals as tasks per split; a missing file is the env's error."""
    try:
        cat, index = catalogue(data_dir or os.environ.get("WEBSHOP_DATA") or None, seed)
    except FileNotFoundError as e:
        raise EnvError(f"{env_name}: {e}") from None
    tasks = {s: [Task(f"{s}/{i:05d}", s, department(g)) for i, g in enumerate(goals)]
             for s, goals in cat.goals.items()}
    return cat, index, tasks


class WebShopEnv(TextEnv):
    name = "webshop"
    supports_snapshot = True
    default_max_steps = 15

    def __init__(self, data_dir: str | None = None, catalogue_seed: int = 0, **kwargs: Any):
        super().__init__(**kwargs)
        self.cat, self.index, self._tasks = open_catalogue(self.name, data_dir, catalogue_seed)
        self.goal: Goal | None = None
        self.state: dict[str, Any] = {}

    def tasks(self, split: str) -> list[Task]:
        if split not in self._tasks:
            raise EnvError(f"webshop: unknown split '{split}'")
        return self._tasks[split]

    def get_task(self, task_id: str) -> Task:
        split, i = parse_task_id(self.name, task_id, {s: len(t) for s, t in self._tasks.items()})
        return self._tasks[split][i]

    def prompt_spec(self) -> PromptSpec:
        return PromptSpec(system="You are an expert autonomous agent operating in the WebShop e-commerce environment.",
                          instruction=(self.goal.instruction if self.goal
                                       else "Buy the product the instruction asks for."),
                          style="react", answer_tag="action", max_actions_per_turn=1)

    def instruction(self) -> str:
        return self.goal.instruction if self.goal else ""

    # ----- pages ------------------------------------------------------------------------------
    def _product(self) -> Product:
        return self.cat.products[self.state["asin"]]

    def clickables(self) -> list[str]:
        st = self.state
        page = st["page"]
        if page == "search":
            return []
        out = ["back to search"]
        if page == "results":
            n_pages = max(1, -(-len(st["results"]) // PER_PAGE))
            if st["page_no"] > 1:
                out.append("< prev")
            if st["page_no"] < n_pages:
                out.append("next >")
            out += [a.lower() for a in self._page_asins()]
        elif page == "item":
            out.append("< prev")
            out += [v for vals in self._product().options.values() for v in vals]
            out += list(SUB_PAGES) + ["buy now"]
        else:
            out.append("< prev")
        return out

    def _page_asins(self) -> list[str]:
        st = self.state
        start = (st["page_no"] - 1) * PER_PAGE
        return st["results"][start:start + PER_PAGE]

    def admissible(self) -> list[str]:
        if self.state["page"] == "search":
            return ["search[<your query>]"]
        return [f"click[{c}]" for c in self.clickables()]

    def render(self) -> str:
        st, goal = self.state, self.goal
        assert goal is not None
        head = ["Instruction:", goal.instruction]
        page = st["page"]
        if page == "search":
            return SEP.join(["WebShop", *head, "Search"])
        parts = head + ["Back to Search"]
        if page == "results":
            parts.append(f"Page {st['page_no']} (Total results: {len(st['results'])})")
            if st["page_no"] > 1:
                parts.append("< Prev")
            if "next >" in self.clickables():
                parts.append("Next >")
            for asin in self._page_asins():
                p = self.cat.products[asin]
                parts += [asin, p.title, f"${p.price:.2f}"]
            return SEP.join(parts)
        p = self._product()
        parts.append("< Prev")
        if page == "item":
            for name, values in p.options.items():
                parts.append(name)
                parts += [f"{v} (selected)" if st["options"].get(name) == v else v for v in values]
            parts += [p.title, f"Price: ${p.price:.2f}", "Rating: N.A.", "Description", "Features", "Reviews",
                      "Buy Now"]
        elif page == "description":
            parts.append(p.description)
        elif page == "features":
            parts += p.bullets
        else:
            parts.append("No reviews yet.")
        return SEP.join(parts)

    # ----- episode ----------------------------------------------------------------------------
    def _info(self, valid: bool = True, **extra: Any) -> dict[str, Any]:
        return dict(admissible_actions=self.admissible(), action_is_valid=valid, page=self.state["page"], **extra)

    def _reset(self, task: Task, seed: int) -> tuple[str, dict[str, Any]]:
        split, i = task.task_id.split("/")
        self.goal = self.cat.goals[split][int(i)]
        self.state = dict(page="search", query="", results=[], page_no=1, asin=None, options={})
        return self.render(), self._info()

    def _step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        m = ACTION.match(action.strip())
        st = self.state
        if not m:
            return self.render(), 0.0, False, self._info(valid=False)
        kind, arg = m.group(1).lower(), m.group(2).strip()
        if kind == "search":
            if st["page"] != "search" or not arg:
                return self.render(), 0.0, False, self._info(valid=False)
            st.update(page="results", query=arg, results=self.index.search(arg, MAX_RESULTS), page_no=1)
            return self.render(), 0.0, False, self._info()
        label = arg.lower()
        if label not in self.clickables():
            return self.render(), 0.0, False, self._info(valid=False)
        if label == "back to search":
            st.update(page="search", query="", results=[], page_no=1, asin=None, options={})
        elif label == "next >":
            st["page_no"] += 1
        elif label == "< prev":
            if st["page"] == "results":
                st["page_no"] -= 1
            elif st["page"] == "item":
                st.update(page="results", asin=None, options={})
            else:
                st["page"] = "item"
        elif st["page"] == "results":
            st.update(page="item", asin=label.upper(), options={})
        elif label in SUB_PAGES:
            st["page"] = label
        elif label == "buy now":
            reward, parts = webshop_reward(self._product(), self.goal, self._product().price, st["options"],
                                           self.cat.vocabulary)
            st["page"] = "done"
            info = dict(admissible_actions=[], action_is_valid=True, page="done", won=reward >= 1.0 - 1e-9,
                        score=reward, reward_parts=parts, bought=self._product().asin)
            return f"Thank you for shopping with us! [SEP] Your score (min 0.0, max 1.0) [SEP] {reward:.4f}", \
                reward, True, info
        else:  # an option value
            for name, values in self._product().options.items():
                if label in values:
                    st["options"][name] = label
        return self.render(), 0.0, False, self._info()

    # ----- expert -----------------------------------------------------------------------------
    def best_options(self, p: Product) -> dict[str, str]:
        """Per option, the value matching the goal best (what a careful shopper clicks)."""
        assert self.goal is not None
        return best_options(p, self.goal)

    def achievable(self, asin: str) -> float:
        assert self.goal is not None
        return achievable_reward(self.cat.products[asin], self.goal, self.cat.vocabulary)

    def expert_action(self) -> str | None:
        """A goal-aware scripted shopper: searches the goal's words, opens the best-scoring hit, picks the
        wanted options, buys. It reads the catalogue the pages show, with the goal in hand."""
        st, goal = self.state, self.goal
        if goal is None or st.get("page") == "done":
            return None
        if st["page"] == "search":
            return f"search[{' '.join(goal.attributes)} {goal.query}]"
        if st["page"] in SUB_PAGES:
            return "click[< prev]"
        if st["page"] == "results":
            if not st["results"]:
                return "click[back to search]"
            target = max(st["results"], key=lambda a: (self.achievable(a), -st["results"].index(a)))
            page_of = st["results"].index(target) // PER_PAGE + 1
            if page_of == st["page_no"]:
                return f"click[{target.lower()}]"
            return "click[next >]" if page_of > st["page_no"] else "click[< prev]"
        p = self._product()
        for name, value in self.best_options(p).items():
            if st["options"].get(name) != value:
                return f"click[{value}]"
        return "click[buy now]"

    def snapshot(self) -> Any:
        return dict(base=self._base_state(), goal=self.goal, state=copy.deepcopy(self.state))

    def restore(self, snap: Any) -> None:
        self._restore_base(snap)
        self.goal, self.state = snap["goal"], copy.deepcopy(snap["state"])
