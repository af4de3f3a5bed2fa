"""shop-tools: the retrieval tool env (search and view over WebShop's catalogue, a product id as answer)."""
import pytest

from agentrl.envs import make
from agentrl.envs.check import check_env
from agentrl.envs.tools import answer_action, call_action
from agentrl.types import Completion


def test_expert_restore_and_snapshot():
    rep = check_env("shop-tools", n_expert=24, n_replay=12)
    assert rep.ok and rep.success_rate >= 0.9 and rep.snapshot_checked == 12, rep.summary()


def test_tools_answer_and_errors():
    env = make("shop-tools")
    obs, _ = env.reset("train/00003")
    goal = env.goal
    assert obs == f"Instruction: {goal.instruction}"
    hits, _, done, _, info = env.step(call_action("search", {"query": goal.query}))
    rows = hits.splitlines()
    assert not done and 1 <= len(rows) <= 5 and all(r.count(" | ") == 2 for r in rows)
    shown, _, _, _, info = env.step(call_action("view", {"product_id": rows[0].split(" | ")[0].lower()}))
    assert shown.startswith(rows[0].split(" | ")[0]) and "Attributes:" in shown and not info.get("tool_error")
    err, _, done, _, info = env.step(call_action("view", {"product_id": "B0NOTHERE"}))
    assert err.startswith("Error: view failed") and info["tool_error"] and not done
    err, _, _, _, info = env.step(call_action("view", {"id": "x"}))  # wrong argument name
    assert "missing required argument 'product_id'" in err and info["tool_error"]
    _, reward, done, _, info = env.step(answer_action(goal.asin))
    assert done and reward == 1.0 and info["won"]
    env.reset("train/00003")
    _, reward, done, _, info = env.step(answer_action("the red one"))
    assert done and reward == 0.0 and not info["won"] and info["answer_is_product"] is False


@pytest.fixture
def tok(tiny_model_dir):
    from agentrl.learner.models import load_tokenizer

    return load_tokenizer(tiny_model_dir)


class ExpertReplies:
    """Writes, for each prompt, the expert's next action of that prompt's episode in the model's format (a
    unit-test double: the rollout's tool turns and token bookkeeping are what is tested, not the model)."""

    def __init__(self, tok, scripts):
        self.tok, self.scripts = tok, scripts  # instruction -> the expert's actions

    def generate(self, prompts, sampling, seeds=None, **kw):
        from agentrl.rollout.tool_prompts import action_text

        spec = make("shop-tools").prompt_spec()
        out = []
        for p in prompts:
            text = self.tok.decode(p)
            actions = next(a for ins, a in self.scripts.items() if ins in text)
            action = actions[text.count("<|im_start|>assistant") - 1]
            reply = action_text(spec, action)
            ids = self.tok(reply, add_special_tokens=False)["input_ids"]
            if not reply.startswith("<answer>"):  # a call turn ends with end-of-text
                ids = ids + [self.tok.eos_token_id]
            out.append(Completion(ids, [-0.5] * len(ids), reply, "stop"))
        return out


def test_the_experts_calls_through_the_rollout_win_with_token_exact_turns(tok):
    from agentrl.envs.pool import InProcessEnvs
    from agentrl.learner.batch import episode_sample
    from agentrl.rollout.engine import RolloutConfig, RolloutEngine, Start
    from agentrl.types import SamplingParams

    tasks = ["train/00001", "valid/00002"]  # the expert's search misses train/00001's product; valid/00002 wins
    scripts, outcome = {}, {}
    for t in tasks:
        env = make("shop-tools")
        env.reset(t)
        actions = []
        while not env.done:
            actions.append(env.expert_action())
            _, reward, _, _, info = env.step(actions[-1])
        scripts[env.goal.instruction], outcome[t] = actions, (info["won"], reward)
    envs = InProcessEnvs("shop-tools", 2)
    cfg = RolloutConfig(max_turns=5, sampling=SamplingParams(max_new_tokens=200))
    try:
        eps = RolloutEngine(ExpertReplies(tok, scripts), tok, envs, "shop-tools", cfg).run(
            [Start(t, 0, "g") for t in tasks])
    finally:
        envs.close()
    for ep in eps:
        assert (ep.won, ep.turns[-1].reward) == outcome[ep.task_id]
        assert len(ep.turns) == 3 and all(t.format_ok for t in ep.turns)
        for a, b in zip(ep.turns, ep.turns[1:]):  # each prompt extends the last: no re-tokenization
            assert b.prompt_ids[:len(a.prompt_ids) + len(a.gen_ids)] == a.prompt_ids + a.gen_ids
        s = episode_sample(ep, [1.0] * len(ep.turns))
        assert [i for i, m in zip(s.ids, s.loss_mask) if m] == [i for t in ep.turns for i in t.gen_ids]
    assert [ep.won for ep in eps] == [False, True]
