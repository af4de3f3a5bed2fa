"""WebShop: the reward on hand-made pairs, the pages and actions, expert vs random, real-file loading."""
import json
import random

import pytest

from agentrl.envs import EnvError, make
from agentrl.envs.check import check_env
from agentrl.envs.webshop.catalogue import Goal, Product, load_webshop_files
from agentrl.envs.webshop.reward import type_reward, webshop_reward

SHAMPOO = Product("B000000001", "Lumina sulfate free argan oil shampoo", "shampoo",
                  "Beauty & Personal Care › Hair Care › Shampoo", ["Gentle: sulfate free."],
                  "A shampoo with argan oil.", ["sulfate free", "argan oil"],
                  {"size": ["8 fl oz", "16 fl oz"], "scent": ["lavender", "mint"]}, 12.5)
GOAL = Goal("B000000001", "i need sulfate free shampoo ...", "Lumina sulfate free argan oil shampoo", "shampoo",
            "Beauty & Personal Care › Hair Care › Shampoo", ["sulfate free", "paraben free"], ["16 fl oz", "mint"],
            20.0)
VOCAB = frozenset("sulfate free argan oil paraben fl oz lavender mint 8 16".split())


def test_reward_hand_computed():
    # attributes: sulfate free (1 of 2); options: 16 fl oz and mint (2 of 2); price 12.5 <= 20 (1)
    # r_type = 1 (same query) -> (1 + 2 + 1) / (2 + 2 + 1) = 0.8
    r, parts = webshop_reward(SHAMPOO, GOAL, 12.5, {"size": "16 fl oz", "scent": "mint"}, VOCAB)
    assert r == pytest.approx(0.8) and parts["n_attribute_matches"] == 1 and parts["n_option_matches"] == 2
    # wrong scent and over budget: (1 + 1 + 0) / 5 = 0.4
    r, _ = webshop_reward(SHAMPOO, GOAL, 25.0, {"size": "16 fl oz", "scent": "lavender"}, VOCAB)
    assert r == pytest.approx(0.4)
    # no options chosen at all: (1 + 0 + 1) / 5
    assert webshop_reward(SHAMPOO, GOAL, 12.5, {}, VOCAB)[0] == pytest.approx(0.4)


def test_attribute_found_in_description_counts():
    goal = Goal("x", "", SHAMPOO.title, "shampoo", SHAMPOO.product_category, ["argan oil"], [], 20.0)
    p = Product("B2", "Other brand shampoo", "shampoo", SHAMPOO.product_category, [], "rich in argan oil", [], {}, 5.0)
    assert webshop_reward(p, goal, 5.0, {}, VOCAB)[0] == pytest.approx(1.0)  # (1 + 0 + 1) / (1 + 0 + 1)


def test_type_reward_levels():
    other = lambda title, query, cat: Product("B3", title, query, cat, [], "", [], {}, 1.0)  # noqa: E731
    # different query and department, no shared title words -> 0
    assert type_reward(other("Kestrel dog leash", "dog leash", "Pet Supplies › Dogs"), GOAL, VOCAB)["r_type"] == 0.0
    # shares the type noun with the goal title (1 of 2 content words: lumina, shampoo) -> title_score .5 -> 1
    t = type_reward(other("Verdana shampoo", "hair wash", "Pet Supplies › Dogs"), GOAL, VOCAB)
    assert t["title_score"] == pytest.approx(0.5) and t["r_type"] == 1.0
    # weak title overlap (1 of 12 desired words) and nothing else in common -> 0.1
    long_goal = Goal("x", "", "b c d e f g h j k l m shampoo", "q", "A › B", ["z"], [], 1.0)
    t = type_reward(other("shampoo", "other", "C › D"), long_goal)
    assert t["title_score"] == pytest.approx(1 / 12) and t["r_type"] == 0.1
    # 1 of 4 words: 0.25 > 0.2 so the type matches -> 1.0; 1 of 5 words: 0.2, nothing else matches -> 0.5
    t4 = type_reward(other("shampoo", "other", "C › D"), Goal("x", "", "b c d shampoo", "q", "A › B", [], [], 1.0))
    t5 = type_reward(other("shampoo", "other", "C › D"), Goal("x", "", "b c d e shampoo", "q", "A › B", [], [], 1.0))
    assert t4["r_type"] == 1.0 and t5["title_score"] == pytest.approx(0.2) and t5["r_type"] == 0.5


def test_pages_and_actions():
    env = make("webshop")
    obs, info = env.reset(env.tasks("train")[0].task_id)
    assert obs.startswith("WebShop [SEP] Instruction:") and info["admissible_actions"] == ["search[<your query>]"]
    obs, r, term, _, info = env.step("click[buy now]")
    assert not info["action_is_valid"] and not term
    obs, *_, info = env.step("search[shampoo]")
    assert (info["page"] == "results" and "Page 1 (Total results:" in obs
            and "click[next >]" in info["admissible_actions"])
    env.step("click[next >]")
    assert "Page 2" in env.last_obs and "click[< prev]" in env.last_info["admissible_actions"]
    asin = [a for a in env.last_info["admissible_actions"] if a.startswith("click[b0")][0]
    obs, *_, info = env.step(asin)
    assert info["page"] == "item" and "Buy Now" in obs and "click[description]" in info["admissible_actions"]
    env.step("click[features]")
    assert env.last_info["page"] == "features"
    env.step("click[< prev]")
    assert env.last_info["page"] == "item"
    obs, r, term, _, info = env.step("click[Buy Now]")  # labels are case-insensitive
    assert term and 0.0 <= r <= 1.0 and info["score"] == r and "Your score" in obs


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_expert_scores_high_and_random_clicks_low():
    env = make("webshop")
    rep = check_env("webshop", n_expert=60, n_replay=10, seed=1)
    assert rep.ok and rep.expert_score >= 0.9, rep.summary()
    rng, scores = random.Random(0), []
    for task in env.tasks("train")[:60]:
        obs, info = env.reset(task.task_id)
        while not env.done:
            action = rng.choice(info["admissible_actions"])
            if action.startswith("search"):
                action = "search[" + " ".join(rng.sample(env.instruction().split(), 3)) + "]"
            obs, r, term, _, info = env.step(action)
        scores.append(info.get("score", 0.0) if term else 0.0)
    assert sum(scores) / len(scores) < 0.3


def test_real_webshop_files(tmp_path):
    products = [{"asin": "B000000001", "name": SHAMPOO.title, "query": "shampoo", "category": "beauty",
                 "product_category": SHAMPOO.product_category, "small_description": ["sulfate free"],
                 "full_description": "argan oil shampoo", "pricing": "$12.50", "images": ["x"],
                 "customization_options": {"Size": [{"value": "8 fl oz"}, {"value": "16 fl oz"}]}},
                {"asin": "nan", "name": "broken"}]
    (tmp_path / "items_shuffle_1000.json").write_text(json.dumps(products))
    (tmp_path / "items_ins_v2_1000.json").write_text(json.dumps({"B000000001": {"attributes": ["sulfate free"]}}))
    human = {"B000000001": [{"instruction": "i want sulfate free shampoo in 16 fl oz.",
                             "instruction_attributes": ["sulfate free"], "instruction_options": ["16 fl oz"]}] * 3}
    (tmp_path / "items_human_ins.json").write_text(json.dumps(human))
    cat = load_webshop_files(tmp_path, n_test=1, n_valid=1)
    assert (list(cat.products) == ["B000000001"]
            and cat.products["B000000001"].options == {"size": ["8 fl oz", "16 fl oz"]})
    assert [len(cat.goals[s]) for s in ("test", "valid", "train")] == [1, 1, 1]
    goal = cat.goals["train"][0]
    assert goal.instruction.startswith("i want sulfate free shampoo in 16 fl oz, and price lower than")
    env = make("webshop", data_dir=str(tmp_path))
    from agentrl.envs.replay import run_expert
    _, _, info = run_expert(env, "test/00000")  # WebShop's default split puts the first 500 goals in test
    assert info["won"]
    with pytest.raises(EnvError, match="items_shuffle"):
        make("webshop", data_dir=str(tmp_path / "missing"))
