"""The WebShop catalogue: products and shopping goals, generated here or loaded from WebShop's files.

The real WebShop data (1.18M scraped products, 12k instructions) cannot be fetched on our machines, so
by default a reproducible catalogue is generated: product types in six departments, each with an
attribute vocabulary, option schemas (size, colour, flavour, count, ...) and a price band; products get
a brand, 2-4 attributes that appear in the title, bullets and description, a subset of option values
and a price. Goals are written the way WebShop's synthetic instructions are: a target product's
attributes, one value per option and a price ceiling just above its price. Goals are shuffled with a
fixed seed and split like WebShop's: the first 500 are test, the next 500 valid, the rest train.

``load_webshop_files(folder)`` reads the real files instead (``items_shuffle*.json``,
``items_ins_v2*.json`` and ``items_human_ins.json``, as WebShop's ``setup.sh`` lays them out).
"""
from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass, field
from pathlib import Path

PRICE_RANGE = [10.0 * i for i in range(1, 100)]  # WebShop's price ceilings


@dataclass
class Product:
    asin: str
    title: str
    query: str
    product_category: str
    bullets: list[str]
    description: str
    attributes: list[str]
    options: dict[str, list[str]]
    price: float

    def category_path(self) -> list[str]:
        return [x.strip() for x in self.product_category.split("›")]


@dataclass
class Goal:
    asin: str
    instruction: str
    name: str  # the target product's title (WebShop's goal['name'])
    query: str
    product_category: str
    attributes: list[str]
    options: list[str]
    price_upper: float

    def category_path(self) -> list[str]:
        return [x.strip() for x in self.product_category.split("›")]


@dataclass
class Catalogue:
    products: dict[str, Product]
    goals: dict[str, list[Goal]]  # split -> goals
    vocabulary: frozenset[str] = field(default_factory=frozenset)  # attribute/option words, for r_type
    source: str = "generated"


# department -> [(type phrase, category path, attribute pool, option schema, price band)]
DEPARTMENTS: dict[str, list[tuple[str, str, list[str], dict[str, list[str]], tuple[int, int]]]] = {
    "beauty": [
        ("shampoo", "Beauty & Personal Care › Hair Care › Shampoo",
         ["sulfate free", "paraben free", "argan oil", "tea tree", "for dry hair", "color safe", "natural ingredients"],
         {"size": ["8 fl oz", "12 fl oz", "16 fl oz", "32 fl oz"],
          "scent": ["lavender", "coconut", "mint", "unscented"]},
         (6, 45)),
        ("face moisturizer", "Beauty & Personal Care › Skin Care › Face Moisturizers",
         ["hyaluronic acid", "oil free", "fragrance free", "for sensitive skin", "spf 30", "cruelty free"],
         {"size": ["1.7 oz", "2.5 oz", "4 oz"]}, (9, 70)),
        ("lipstick", "Beauty & Personal Care › Makeup › Lipstick",
         ["long lasting", "matte finish", "cruelty free", "vegan", "moisturizing"],
         {"color": ["red", "pink", "nude", "coral", "burgundy", "rose"]}, (5, 30)),
        ("nail polish", "Beauty & Personal Care › Nail Care › Nail Polish",
         ["quick dry", "long lasting", "non toxic", "high gloss", "vegan"],
         {"color": ["red", "black", "pink", "navy", "white", "gold"], "size": ["0.5 fl oz", "0.25 fl oz"]}, (4, 20)),
    ],
    "fashion": [
        ("running shoes", "Clothing, Shoes & Jewelry › Men › Shoes › Athletic",
         ["lightweight", "non slip", "breathable mesh", "rubber sole", "arch support", "memory foam"],
         {"size": ["7", "8", "9", "10", "11", "12"], "color": ["black", "white", "gray", "blue", "red"]}, (30, 140)),
        ("t-shirt", "Clothing, Shoes & Jewelry › Women › Clothing › Tops & Tees",
         ["machine wash", "cotton", "short sleeve", "relaxed fit", "crew neck", "moisture wicking"],
         {"size": ["small", "medium", "large", "x-large"], "color": ["black", "white", "navy", "pink", "green"]},
         (8, 40)),
        ("yoga pants", "Clothing, Shoes & Jewelry › Women › Clothing › Active › Leggings",
         ["high waist", "tummy control", "four way stretch", "moisture wicking", "machine wash", "pockets"],
         {"size": ["x-small", "small", "medium", "large"], "color": ["black", "gray", "navy", "purple"]}, (15, 60)),
        ("winter jacket", "Clothing, Shoes & Jewelry › Men › Clothing › Jackets & Coats",
         ["water resistant", "hooded", "fleece lined", "windproof", "zipper pockets"],
         {"size": ["medium", "large", "x-large", "xx-large"], "color": ["black", "khaki", "navy", "green"]},
         (40, 180)),
    ],
    "electronics": [
        ("wireless earbuds", "Electronics › Headphones › Earbud Headphones",
         ["noise cancelling", "bluetooth 5.0", "waterproof", "long battery life", "charging case", "built-in mic"],
         {"color": ["black", "white", "blue"]}, (20, 150)),
        ("phone case", "Cell Phones & Accessories › Cases, Holsters & Sleeves",
         ["shockproof", "slim fit", "wireless charging compatible", "clear", "kickstand"],
         {"color": ["black", "clear", "blue", "pink", "green"], "model": ["iphone 13", "iphone 14", "galaxy s22"]},
         (6, 30)),
        ("usb c cable", "Electronics › Computers & Accessories › Cables",
         ["fast charging", "braided nylon", "data transfer", "durable"],
         {"size": ["3 ft", "6 ft", "10 ft"], "count": ["1 pack", "2 pack", "3 pack"]}, (5, 25)),
        ("portable charger", "Cell Phones & Accessories › Chargers & Power Adapters › Portable Power Banks",
         ["high capacity", "fast charging", "compact", "led display", "dual usb"],
         {"capacity": ["10000mah", "20000mah", "26800mah"], "color": ["black", "white"]}, (15, 70)),
    ],
    "grocery": [
        ("protein bars", "Grocery & Gourmet Food › Snack Foods › Bars › Protein Bars",
         ["gluten free", "low sugar", "high protein", "keto friendly", "non gmo", "plant based"],
         {"flavor": ["chocolate", "peanut butter", "vanilla", "cookie dough"], "count": ["12 count", "24 count"]},
         (12, 45)),
        ("green tea", "Grocery & Gourmet Food › Beverages › Tea › Green",
         ["organic", "caffeine free", "non gmo", "antioxidant rich", "individually wrapped"],
         {"flavor": ["jasmine", "mint", "lemon", "original"], "count": ["20 count", "50 count", "100 count"]},
         (4, 25)),
        ("coffee beans", "Grocery & Gourmet Food › Beverages › Coffee › Whole Coffee Beans",
         ["organic", "fair trade", "dark roast", "single origin", "low acid"],
         {"size": ["12 ounce", "2 pound", "5 pound"]}, (9, 60)),
        ("olive oil", "Grocery & Gourmet Food › Pantry Staples › Oils › Olive",
         ["extra virgin", "cold pressed", "organic", "non gmo"],
         {"size": ["16.9 fl oz", "25.3 fl oz", "1 liter"]}, (8, 40)),
    ],
    "home": [
        ("throw pillow covers", "Home & Kitchen › Bedding › Decorative Pillows",
         ["machine wash", "hidden zipper", "velvet", "double sided", "fade resistant"],
         {"size": ["16x16 inch", "18x18 inch", "20x20 inch"], "color": ["beige", "gray", "navy", "teal", "pink"]},
         (8, 35)),
        ("office chair", "Home & Kitchen › Furniture › Home Office Furniture › Chairs",
         ["ergonomic", "lumbar support", "adjustable height", "breathable mesh", "easy assembly"],
         {"color": ["black", "gray", "white"]}, (60, 300)),
        ("bath towels", "Home & Kitchen › Bath › Towels › Bath Towels",
         ["100% cotton", "quick dry", "highly absorbent", "machine wash", "soft"],
         {"color": ["white", "gray", "navy", "beige"], "count": ["2 pack", "4 pack", "6 pack"]}, (15, 60)),
        ("led desk lamp", "Tools & Home Improvement › Lighting & Ceiling Fans › Lamps",
         ["dimmable", "usb charging port", "eye caring", "touch control", "adjustable arm"],
         {"color": ["black", "white", "silver"]}, (15, 70)),
    ],
    "pets": [
        ("dog food", "Pet Supplies › Dogs › Food › Dry",
         ["grain free", "high protein", "real chicken", "for small breeds", "no artificial preservatives"],
         {"size": ["4 pound", "15 pound", "30 pound"], "flavor": ["chicken", "lamb", "salmon"]}, (15, 90)),
        ("cat litter", "Pet Supplies › Cats › Litter & Housebreaking › Litter",
         ["clumping", "unscented", "low dust", "odor control", "natural"],
         {"size": ["10 pound", "20 pound", "40 pound"]}, (8, 40)),
        ("dog leash", "Pet Supplies › Dogs › Collars, Harnesses & Leashes › Leashes",
         ["reflective", "heavy duty", "padded handle", "retractable", "waterproof"],
         {"size": ["4 ft", "6 ft", "16 ft"], "color": ["black", "red", "blue", "orange"]}, (8, 35)),
        ("fish tank filter", "Pet Supplies › Fish & Aquatic Pets › Aquarium Pumps & Filters",
         ["quiet", "energy efficient", "easy to clean", "adjustable flow"],
         {"size": ["10 gallon", "20 gallon", "55 gallon"]}, (10, 60)),
    ],
}
BRANDS = ["Lumina", "Northpeak", "Verdana", "Kestrel", "Aurelio", "Brightfield", "Solace", "Tidewell", "Oakhaven",
          "Maple & Moss", "Zephyra", "Ironwood", "Cobaltix", "Sunnyvale", "Pinecrest", "Halcyon", "Everline", "Quillon"]
BULLET_TEMPLATES = ["{Attr}: designed to be {attr} for everyday use.", "Made with care: {attr} and built to last.",
                    "Why you'll love it: {attr}, great value."]


def _asin(rng: random.Random) -> str:
    return "B0" + "".join(rng.choice("ABCDEFGHJKLMNPQRSTUVWXYZ0123456789") for _ in range(8))


def generate_catalogue(seed: int = 0, products_per_type: int = 50, goals_per_product: int = 3,
                       n_test: int = 500, n_valid: int = 500) -> Catalogue:
    rng = random.Random(f"webshop-catalogue-{seed}")
    products: dict[str, Product] = {}
    vocabulary: set[str] = set()
    for department in DEPARTMENTS.values():
        for type_phrase, path, attr_pool, option_schema, (lo, hi) in department:
            vocabulary.update(w for a in attr_pool for w in a.split())
            vocabulary.update(w for vals in option_schema.values() for v in vals for w in v.split())
            for _ in range(products_per_type):
                asin = _asin(rng)
                while asin in products:
                    asin = _asin(rng)
                brand = rng.choice(BRANDS)
                attrs = rng.sample(attr_pool, rng.randint(2, min(4, len(attr_pool))))
                title = f"{brand} {' '.join(attrs[:2])} {type_phrase}".replace("  ", " ")
                if len(attrs) > 2:
                    title += f", {', '.join(attrs[2:])}"
                bullets = [rng.choice(BULLET_TEMPLATES).format(attr=a, Attr=a.capitalize()) for a in attrs]
                options = {name: sorted(rng.sample(vals, rng.randint(max(1, len(vals) - 2), len(vals))),
                                        key=vals.index) for name, vals in option_schema.items()}
                description = (f"The {brand} {type_phrase} is {', '.join(attrs)}. Available in "
                               + "; ".join(f"{k}: {', '.join(v)}" for k, v in options.items()) + ".")
                price = round(rng.uniform(lo, hi), 2)
                products[asin] = Product(asin, title, type_phrase, path, bullets, description, attrs, options, price)
    goals: list[Goal] = []
    for p in products.values():
        for _ in range(goals_per_product):
            goals.append(_goal_for(p, rng))
    random.Random(233).shuffle(goals)  # WebShop shuffles its goals with seed 233 before splitting
    split = {"test": goals[:n_test], "valid": goals[n_test:n_test + n_valid], "train": goals[n_test + n_valid:]}
    return Catalogue(products, split, frozenset(vocabulary))


def _goal_for(p: Product, rng: random.Random) -> Goal:
    attrs = rng.sample(p.attributes, rng.randint(1, min(3, len(p.attributes))))
    chosen = {name: rng.choice(vals) for name, vals in p.options.items()}
    ceilings = [c for c in PRICE_RANGE if c > p.price][:4]
    price_upper = rng.choice(ceilings[1:] or ceilings)
    opt_text = ", and ".join(f"{k}: {v}" for k, v in chosen.items())
    text = f"i need {' and '.join(attrs)} {p.query}"
    if opt_text:
        text += f" with {opt_text}"
    text += f", and price lower than {price_upper:.2f} dollars"
    return Goal(p.asin, text, p.title, p.query, p.product_category, attrs, list(chosen.values()), price_upper)


# ------------------------------------------------------------------------------------------------------
# the real WebShop files


def _first(folder: Path, pattern: str) -> Path:
    found = sorted(folder.glob(pattern))
    if not found:
        raise FileNotFoundError(f"WebShop data: no {pattern} in {folder}")
    return found[0]


def load_webshop_files(folder: str | Path, n_test: int = 500, n_valid: int = 1000) -> Catalogue:
    """Read WebShop's product and human-instruction files (the preprocessing of its engine.load_products
    and goal.get_human_goals, keeping what the env needs)."""
    folder = Path(folder)
    raw = json.loads(_first(folder, "items_shuffle*.json").read_text())
    attrs = json.loads(_first(folder, "items_ins_v2*.json").read_text())
    human = json.loads(_first(folder, "items_human_ins*.json").read_text())
    products: dict[str, Product] = {}
    for p in raw:
        asin = p.get("asin", "nan")
        if asin == "nan" or len(asin) > 10 or asin in products:
            continue
        prices = [float(re.sub(r"[^\d.]", "", x)) for x in (p.get("pricing") or "").split("$")[1:] if
                  re.sub(r"[^\d.]", "", x)] or [100.0]
        options = {}
        for name, contents in (p.get("customization_options") or {}).items():
            if contents:
                options[name.lower()] = [c["value"].strip().replace("/", " | ").lower() for c in contents]
        bullets = p.get("small_description") or []
        products[asin] = Product(
            asin, p["name"], p.get("query", "").lower().strip(), p.get("product_category", ""),
            bullets if isinstance(bullets, list) else [bullets], p.get("full_description", ""),
            attrs.get(asin, {}).get("attributes", []), options, prices[0])
    goals: list[Goal] = []
    rng = random.Random(0)
    for asin, instructions in human.items():
        if asin not in products:
            continue
        p = products[asin]
        for ins in instructions:
            if not ins.get("instruction_attributes"):
                continue
            ceilings = [c for c in PRICE_RANGE if c > p.price][:4]
            price_upper = sorted(rng.sample(ceilings, 2))[1] if len(ceilings) >= 2 else 1_000_000.0
            opts = ins.get("instruction_options") or []
            opts = list(opts.values()) if isinstance(opts, dict) else list(opts)
            text = ins["instruction"].strip(".") + (f", and price lower than {price_upper:.2f} dollars"
                                                    if price_upper < 1_000_000 else "")
            goals.append(Goal(asin, text, p.title, p.query, p.product_category, list(ins["instruction_attributes"]),
                              opts, price_upper))
    random.Random(233).shuffle(goals)
    split = {"test": goals[:n_test], "valid": goals[n_test:n_test + n_valid], "train": goals[n_test + n_valid:]}
    return Catalogue(products, split, frozenset(), source=str(folder))
