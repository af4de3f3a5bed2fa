"""Action parsing never crashes on model text, and prompts follow the papers' templates."""
from agentrl.envs import make
from agentrl.rollout.parsing import parse_turn
from agentrl.rollout.prompts import step_messages


def test_single_action_with_think():
    p = parse_turn("<think>the mug is in the sink</think><action>take mug 1 from sinkbasin 1</action>",
                   require_think=True)
    assert p.valid and p.actions == ["take mug 1 from sinkbasin 1"] and p.think == "the mug is in the sink"


def test_multi_action_budget_and_separator():
    p = parse_turn("<think>x</think><answer>Right || Right ||Up|| Left</answer>", answer_tag="answer",
                   max_actions=3)
    assert p.actions == ["Right", "Right", "Up"] and p.over_budget and p.valid


def test_single_action_mode_keeps_pipes_literal():
    assert parse_turn("<action>search[red || blue]</action>").actions == ["search[red || blue]"]


def test_missing_or_empty_answer_is_reported_not_raised():
    for text in ["I think I should go north.", "", "<action></action>", "<action>   </action>", "<answer>Up</answer>"]:
        p = parse_turn(text)
        assert not p.valid and p.error and p.actions == []


def test_unclosed_tag_at_end_counts_stop_strings_cut_it():
    assert parse_turn("<think>go</think><action>go north").actions == ["go north"]


def test_last_complete_answer_wins():
    assert parse_turn("<action>look</action> no wait <action>go east</action>").actions == ["go east"]


def test_control_characters_and_lone_surrogates_never_reach_an_env():
    assert parse_turn("<action>go\x00 north\x07</action>").actions == ["go north"]
    assert parse_turn("<action>take \ud800mug</action>").actions == ["take mug"]
    p = parse_turn("<action>\x00\x01</action>")  # nothing left: a format error, not an empty command
    assert not p.valid and p.error == "empty <action>"


def test_parsing_is_linear_on_hostile_text():
    # a lazy-group regex took 7.8 s on 8000 open tags (quadratic); this is ~1 MB of them
    assert parse_turn("<action>" * 125_000).actions == []
    assert parse_turn("<action>" * 125_000 + "look</action>").actions == ["look"]
    assert parse_turn("x</action>" * 100_000).actions == []
    assert parse_turn("<ACTION>Look</Action>").actions == ["Look"]


def test_missing_think_is_a_format_error_when_required():
    p = parse_turn("<action>look</action>", require_think=True)
    assert p.actions == ["look"] and not p.format_ok and "think" in p.error
    assert parse_turn("<action>look</action>").valid


def test_admissible_canonicalisation():
    p = parse_turn("<answer>up || JUMP</answer>", answer_tag="answer", max_actions=5,
                   admissible=["Up", "Down", "Left", "Right"])
    assert p.actions == ["Up", "JUMP"] and p.inadmissible == ["JUMP"]


def test_react_prompt_has_crps_parts():
    env = make("textworld")
    spec = env.prompt_spec()
    msgs = step_messages(spec, "put the mug in the box", "You see a mug.", [("o1", "a1"), ("o2", "a2"), ("o3", "a3")],
                         step=3, admissible=["take mug", "look"], history_len=2)
    text = msgs[-1]["content"]
    assert "Your task is to: put the mug in the box" in text
    assert "already taken 3 step(s)" in text and "most recent 2 observations" in text
    assert "'o2'" in text and "'o3'" in text and "'o1'" not in text  # window of 2
    assert "You are now at step 4" in text and "'take mug'" in text
    assert "<think> </think>" in text and "<action> </action>" in text


def test_ragen_prompt_has_legend_board_and_budget():
    env = make("sokoban")
    obs, info = env.reset("train/00000")
    msgs = step_messages(env.prompt_spec(), env.instruction(), obs, [], 0, info["admissible_actions"])
    assert msgs[0]["role"] == "system" and "<answer>" in msgs[0]["content"]
    user = msgs[1]["content"]
    assert "Sokoban" in user and "#: wall" in user and obs in user and "up to 5 actions" in user and "||" in user


def test_compact_prompt_keeps_the_content_and_drops_the_boilerplate():
    env = make("textworld")
    spec = env.prompt_spec()
    args = (spec, "put the mug in the box", "You see a mug.", [("o1", "a1"), ("o2", "a2"), ("o3", "a3")], 3,
            ["take mug", "look"])
    paper = step_messages(*args, history_len=2)[-1]["content"]
    text = step_messages(*args, history_len=2, prompt="compact")[-1]["content"]
    assert text.splitlines() == ["Task: put the mug in the box", "Step 4.", "Earlier actions: a1", "o2", "> a2", "o3",
                                 "> a3", "You see a mug.", "Actions: take mug | look",
                                 "Answer with <action>one action</action>."]
    assert len(text) < len(paper) / 2


def test_compact_tried_prompt_lists_tried_actions_apart_from_the_untried_ones():
    spec = make("textworld").prompt_spec()
    history = [("o1", "go to cabinet 1"), ("o2", "open cabinet 1"), ("o3", "go to cabinet 1"), ("o4", "go to desk 1")]
    text = step_messages(spec, "find a mug", "You see a pen.", history, 4,
                         ["go to cabinet 1", "go to cabinet 2", "take pen 1 from desk 1", "go to sofa 1"],
                         history_len=1, prompt="compact_tried")[-1]["content"]
    assert text.splitlines() == ["Task: find a mug", "Step 5.",
                                 "Tried: go to cabinet 1 | open cabinet 1 | go to desk 1",
                                 "o4", "> go to desk 1", "You see a pen.",
                                 "Actions: go to cabinet 2 | take pen 1 from desk 1 | go to sofa 1",
                                 "Answer with <action>one action</action>."]


def test_numbered_prompt_lists_untried_actions_first_and_a_number_answers_for_its_action():
    from agentrl.rollout.parsing import parse_turn
    from agentrl.rollout.prompts import listed_actions

    spec = make("textworld").prompt_spec()
    history = [("o1", "go to cabinet 1"), ("o2", "go to desk 1")]
    admissible = ["go to cabinet 1", "go to cabinet 2", "take pen 1 from desk 1"]
    text = step_messages(spec, "find a mug", "You see a pen.", history, 2, admissible, history_len=1,
                         prompt="numbered")[-1]["content"]
    assert "Actions: 1: go to cabinet 2 | 2: take pen 1 from desk 1 | 3: go to cabinet 1" in text
    assert text.endswith("Answer with <action>the number of one action</action>.")
    listed = listed_actions(admissible, history, "numbered")
    assert parse_turn("<action>3</action>", admissible=admissible, numbered=listed).actions == ["go to cabinet 1"]
    out = parse_turn("<action>9</action>", admissible=admissible, numbered=listed)
    assert out.actions == ["9"] and out.inadmissible == ["9"]  # out of range: an inadmissible action
    assert parse_turn("<action>go to cabinet 2</action>", admissible=admissible, numbered=listed).actions == [
        "go to cabinet 2"]


def test_a_demonstration_answers_with_the_number_the_rollout_reads_and_only_where_the_prompt_numbers():
    from agentrl.config import RolloutCfg
    from agentrl.rollout.parsing import parse_turn
    from agentrl.rollout.prompts import numbered_actions
    from agentrl.sft import _answer

    history = [("o1", "go to cabinet 1")]
    admissible = ["go to cabinet 1", "go to cabinet 2", "take pen 1 from desk 1"]
    cfg = RolloutCfg(prompt="numbered", show_admissible=True)
    listed = numbered_actions(cfg, admissible, history)
    assert listed == ["go to cabinet 2", "take pen 1 from desk 1", "go to cabinet 1"]
    taught = _answer("go to cabinet 1", listed)
    assert taught == "3"
    assert parse_turn(f"<action>{taught}</action>", admissible=admissible, numbered=listed).actions == [
        "go to cabinet 1"]
    for other in (RolloutCfg(prompt="numbered", show_admissible=False), RolloutCfg(prompt="compact_tried")):
        assert numbered_actions(other, admissible, history) is None  # no numbers shown: the action's text
        assert _answer("go to cabinet 1", numbered_actions(other, admissible, history)) == "go to cabinet 1"
