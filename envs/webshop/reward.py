"""WebShop's matching reward (Yao et al., 2022), on our Product/Goal records.

    reward = r_type * (n_attribute_matches + n_option_matches + [price <= price_upper])
                    / (n_goal_attributes + n_goal_options + 1)

r_type checks that the bought product is the wanted kind of thing (same search query, >= 2 shared
category levels, or title overlap). Attributes and options match fuzzily (token-set ratio > 85);
colours are normalised first. One deliberate difference: WebShop keeps the nouns of the titles with
spaCy's tagger, whose model cannot be installed offline; we keep content words (stop words and the
catalogue's attribute and option vocabulary removed), which on titles like ours picks the same words.
"""
from __future__ import annotations

import re
from typing import Any

from rapidfuzz import fuzz

from agentrl.envs.webshop.catalogue import Goal, Product

COLORS = ["beige", "black", "blue", "bronze", "brown", "burgundy", "charcoal", "coral", "cream", "gold", "gray",
          "green", "grey", "ivory", "khaki", "lavender", "navy", "orange", "pink", "purple", "red", "rose", "silver",
          "tan", "teal", "white", "yellow"]
STOPWORDS = set("""a an the and or of for with in on to by from at as is it its this that these those be are was
were my your our their his her i you we they me us them pack count set pcs piece pieces new size color""".split())
TOKEN = re.compile(r"[a-z][a-z0-9'-]*")


def normalize_color(text: str) -> str:
    for color in COLORS:
        if color in text:
            return color
    return text


def content_words(text: str, vocabulary: frozenset[str] = frozenset()) -> set[str]:
    return {t for t in TOKEN.findall(text.lower()) if t not in STOPWORDS and t not in vocabulary}


def type_reward(product: Product, goal: Goal, vocabulary: frozenset[str] = frozenset()) -> dict[str, Any]:
    query_match = product.query == goal.query
    category_match = len(set(product.category_path()) & set(goal.category_path())) >= 2
    desired = content_words(goal.name, vocabulary)
    bought = content_words(product.title, vocabulary)
    title_score = 0.2 if not desired else len(desired & bought) / len(desired)
    r_type = 1.0
    if not (query_match or category_match or title_score > 0.2):
        r_type = 0.5
    if title_score < 0.1:
        r_type = 0.1
    if title_score == 0.0:
        r_type = 0.0
    return dict(r_type=r_type, query_match=query_match, category_match=category_match, title_score=title_score)


def attribute_matches(product: Product, goal: Goal) -> int:
    text_fields = (product.title.lower(), " ".join(product.bullets).lower(), product.description.lower())
    n = 0
    for want in goal.attributes:
        if any(fuzz.token_set_ratio(have, want) > 85 for have in product.attributes) or \
                any(want in field for field in text_fields):
            n += 1
    return n


def option_matches(chosen: list[str], wanted: list[str]) -> int:
    chosen = [normalize_color(o) for o in chosen]
    return sum(any(fuzz.token_set_ratio(c, normalize_color(w)) > 85 for c in chosen) for w in wanted)


def webshop_reward(product: Product, goal: Goal, price: float, chosen_options: dict[str, str],
                   vocabulary: frozenset[str] = frozenset()) -> tuple[float, dict[str, Any]]:
    rt = type_reward(product, goal, vocabulary)
    n_att = attribute_matches(product, goal)
    n_opt = option_matches(list(chosen_options.values()), goal.options)
    r_price = float(price <= goal.price_upper)
    total = (n_att + n_opt + r_price) / (len(goal.attributes) + len(goal.options) + 1) * rt["r_type"]
    return total, dict(rt, n_attribute_matches=n_att, n_option_matches=n_opt, r_price=r_price)


def best_options(product: Product, goal: Goal) -> dict[str, str]:
    """Per option of ``product``, the value matching the goal best (what a careful shopper clicks)."""
    out = {}
    for name, values in product.options.items():
        hits = [v for v in values if option_matches([v], goal.options)]
        if hits:
            out[name] = hits[0]
    return out


def achievable_reward(product: Product, goal: Goal, vocabulary: frozenset[str] = frozenset()) -> float:
    """WebShop's reward for buying ``product`` at its price with the best options for ``goal``."""
    return webshop_reward(product, goal, product.price, best_options(product, goal), vocabulary)[0]
