"""A local BM25 index over the catalogue (WebShop uses Lucene/Pyserini BM25 over product text)."""
from __future__ import annotations

import math
import re
from collections import Counter, defaultdict

from agentrl.envs.webshop.catalogue import Product

TOKEN = re.compile(r"[a-z0-9]+")


def tokenize(text: str) -> list[str]:
    return TOKEN.findall(text.lower())


class BM25:
    def __init__(self, products: dict[str, Product], k1: float = 1.2, b: float = 0.75):
        self.k1, self.b = k1, b
        self.postings: dict[str, list[tuple[str, int]]] = defaultdict(list)
        self.lengths: dict[str, int] = {}
        for asin, p in products.items():
            text = " ".join([p.title, *p.bullets, p.description, " ".join(p.attributes), p.query])
            counts = Counter(tokenize(text))
            self.lengths[asin] = sum(counts.values())
            for term, tf in counts.items():
                self.postings[term].append((asin, tf))
        self.n = len(products)
        self.avg_len = sum(self.lengths.values()) / max(1, self.n)

    def search(self, query: str, k: int = 50) -> list[str]:
        scores: dict[str, float] = defaultdict(float)
        for term in set(tokenize(query)):
            posting = self.postings.get(term)
            if not posting:
                continue
            idf = math.log(1 + (self.n - len(posting) + 0.5) / (len(posting) + 0.5))
            for asin, tf in posting:
                norm = tf * (self.k1 + 1) / (tf + self.k1 * (1 - self.b + self.b * self.lengths[asin] / self.avg_len))
                scores[asin] += idf * norm
        # ties broken by asin so results are deterministic
        return [a for a, _ in sorted(scores.items(), key=lambda x: (-x[1], x[0]))[:k]]
