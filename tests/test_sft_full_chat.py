"""A full-chat (RAGEN) run's SFT warm start trains on the prompts its rollouts grow: each demonstration turn's
prompt is the last turn's prompt, the expert's answer and the next user message, token for token."""
from agentrl.envs import make
from agentrl.types import Completion


class ExpertReplies:
    """Answers each prompt with the demonstration's target for that turn (a unit-test double: the prompts'
    token bookkeeping is what is tested, not a model)."""

    def __init__(self, tok, targets):
        self.tok, self.targets, self.turn = tok, targets, 0

    def generate(self, prompts, sampling, seeds=None, **kw):
        out = []
        for _ in prompts:  # one episode: one prompt a call
            ids = self.targets[self.turn]
            out.append(Completion(ids, [-0.5] * len(ids), self.tok.decode(ids[:-1]), "stop"))
            self.turn += 1
        return out


def test_full_chat_demonstrations_are_the_rollouts_prompts(tiny_model_dir):
    from agentrl.envs.pool import InProcessEnvs
    from agentrl.learner.models import load_tokenizer
    from agentrl.rollout.engine import RolloutConfig, RolloutEngine, Start
    from agentrl.sft import demo_steps, noisy_expert_episode
    from agentrl.types import SamplingParams

    tok = load_tokenizer(tiny_model_dir)
    env = make("sokoban")
    task = env.tasks("train")[0].task_id
    trace, observations, infos, labels = noisy_expert_episode(env, task, 0)
    for mode in ("full", "window"):
        cfg = RolloutConfig(max_turns=20, chat_mode=mode, require_think=True,
                            sampling=SamplingParams(max_new_tokens=32))
        steps = demo_steps(tok, cfg, (trace, observations, infos, labels, env.prompt_spec(), env.instruction()))
        assert len(steps) >= 2
        gen = ExpertReplies(tok, [target for _, target, _ in steps])
        with InProcessEnvs("sokoban", 1) as envs:
            (ep,) = RolloutEngine(gen, tok, envs, "sokoban", cfg).run([Start(task, 0, "g")])
        assert ep.won and len(ep.turns) == len(steps)
        assert [t.prompt_ids for t in ep.turns] == [prompt for prompt, _, _ in steps], mode
        if mode == "full":  # each turn extends the last: the policy meets no prompt SFT did not show it
            assert steps[1][0][:len(steps[0][0]) + len(steps[0][1])] == steps[0][0] + steps[0][1]


def _demo(env, task, seed=0):
    from agentrl.sft import noisy_expert_episode

    trace, observations, infos, labels = noisy_expert_episode(env, task, seed)
    return trace, observations, infos, labels, env.prompt_spec(), env.instruction()


def test_a_full_chat_demonstration_is_one_row_with_its_turn_rows_log_probs_and_loss(tiny_model_dir):
    """One row a demonstration (the last prompt and response, every turn's response masked in) gives each
    target token the context its turn's row gave it: the same per-token log-probs, and the same token-mean
    loss over the same targets, at a fraction of the tokens. With sft.constrain_actions too."""
    import torch

    from agentrl.algos.losses import sft_loss
    from agentrl.learner.batch import collate
    from agentrl.learner.engine import TorchEngine
    from agentrl.learner.models import load_tokenizer
    from agentrl.rollout.engine import RolloutConfig
    from agentrl.sft import demo_rows
    from agentrl.types import SamplingParams

    tok = load_tokenizer(tiny_model_dir)
    eng = TorchEngine(tiny_model_dir)
    env = make("sokoban")
    demo = _demo(env, env.tasks("train")[1].task_id)
    for choices in (False, True):  # a constrained answer is the action in its tags alone: no think block
        cfg = RolloutConfig(max_turns=20, chat_mode="full", require_think=not choices,
                            sampling=SamplingParams(max_new_tokens=32))
        turns = demo_rows(tok, cfg, demo, choices, {"task": "t"})
        (row,) = demo_rows(tok, cfg, demo, choices, {"task": "t"}, whole=True)
        assert len(turns) >= 2 and row.meta == {"task": "t", "sft_turns": len(turns)}
        assert row.num_targets == sum(t.num_targets for t in turns)
        assert len(row.ids) < sum(len(t.ids) for t in turns)
        assert bool(row.allowed) == choices == all(t.allowed for t in turns)
        whole, apart = collate([row], eng.pad_id), collate(turns, eng.pad_id)
        lp_whole, lp_apart = eng.logprobs(whole), eng.logprobs(apart)
        got = lp_whole[0][whole.loss_mask[0].bool()]
        want = torch.cat([lp_apart[i][apart.loss_mask[i].bool()] for i in range(len(turns))])
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(sft_loss(lp_whole * whole.advantages, whole.loss_mask),
                                   sft_loss(lp_apart * apart.advantages, apart.loss_mask), atol=1e-6, rtol=1e-6)
    window = RolloutConfig(max_turns=20, chat_mode="window", require_think=True)
    assert len(demo_rows(tok, window, demo, whole=True)) == len(turns)  # window prompts do not nest


def test_sft_batches_count_a_whole_chat_row_as_its_turns():
    """A pass makes a batch per batch_size turns: whole-chat rows fill a batch with about the turns (and
    target tokens) that turn rows did, each row once; one-turn rows are cut as before."""
    import random

    from agentrl.learner.batch import Sample
    from agentrl.sft import sft_batch_count, sft_batches

    def rows(turns):
        return [Sample([1] * (5 + k), [0] * 5 + [1] * k, [0.0] * (5 + k), [0.0] * (5 + k),
                       meta={"sft_turns": k} if k > 1 else {}) for k in turns]

    plain = rows([1] * 37)
    for by_length in (False, True):
        rng, old = random.Random(3), random.Random(3)
        order = list(range(37))
        old.shuffle(order)
        want = [order[i:i + 8] for i in range(0, 37, 8)]
        if by_length:  # the cut before whole-chat rows: each run of 16 batches sorted by length, then cut
            want = [c[k:k + 8] for i in range(0, 37, 128)
                    for c in [sorted(order[i:i + 128], key=lambda j: len(plain[j].ids))] for k in range(0, len(c), 8)]
            old.shuffle(want)
        assert sft_batches(plain, 8, rng, by_length) == want
    chats = rows([3, 5, 4, 2, 5, 1, 3, 4, 5, 2] * 4)  # 136 turns in 40 rows
    for by_length in (False, True):
        batches = sft_batches(chats, 16, random.Random(0), by_length)
        assert len(batches) == sft_batch_count(chats, 16) == 9
        assert sorted(j for b in batches for j in b) == list(range(40)) and all(batches)
        assert max(sum(chats[j].meta.get("sft_turns", 1) for j in b) for b in batches) <= 16 + 5
    assert sft_batch_count(rows([5, 5]), 1) == 2  # never more batches than rows
