"""Paper suites (recipes/suites/): each paper's table resolves on a model folder with the settings its runs share,
every recipe on its papers' envs gets the papers' (or the field's) values rather than demo-sized defaults, the
horizon covers the env's expert, and the recipe pages' checked deviation rows agree with --print-config."""
import json
import re
from pathlib import Path

import pytest
import yaml

from agentrl import suites
from agentrl.cli import main
from agentrl.config_loader import config_sources, flat_config, load_config

ROOT = Path(__file__).resolve().parent.parent
EXPERT = json.loads((Path(__file__).with_name("expert_lengths.json")).read_text())
# a Qwen2.5-1.5B-shaped config.json: the plan's GPU-hours read the shape, no weights
QWEN15B = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 1536,
           "intermediate_size": 8960, "num_hidden_layers": 28, "num_attention_heads": 12, "num_key_value_heads": 2,
           "vocab_size": 151936, "tie_word_embeddings": True, "max_position_embeddings": 32768}
# the sizes a demo-sized default or a demo overlay must not give a real model on a paper's env
SIZE_KEYS = ("rollout.max_turns", "rollout.max_new_tokens", "rollout.groups", "rollout.group_size", "optim.lr",
             "trainer.steps", "eval.tasks")
# actions one turn may take on these envs (their parsers take up to 5), so a turn covers several expert moves
ACTIONS_PER_TURN = {"sokoban": 5, "frozenlake": 5}
# the paper's own horizon below the expert's p90: RAGEN caps an episode at 10 actions (B.2) on a slippery
# FrozenLake whose expert needs ~24 (its success there is ~20%)
PAPER_HORIZON = {("frozenlake", "RAGEN")}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen")
    (d / "config.json").write_text(json.dumps(QWEN15B))
    return str(d)


@pytest.fixture(scope="module")
def plans(folder, tmp_path_factory):
    out = tmp_path_factory.mktemp("suites")
    return {name: (suites.load(name), suites.plan(suites.load(name), folder, seeds=1, out=out / name))
            for name in suites.names()}


def test_every_paper_has_a_suite():
    assert {suites.load(n).paper for n in suites.names()} == {"CRPS", "SPEAR", "RAGEN", "LEAFE", "RRO"}


def test_reproduce_lists_the_suites(capsys):
    assert main(["reproduce", "--list"]) == 0
    out = capsys.readouterr().out
    for name in ("crps-table1", "spear-table1", "ragen-fig9", "leafe-table1", "rro-table1"):
        assert out.count(f"{name}:") == 1


def test_a_dry_run_resolves_every_run_and_estimates_gpu_hours(folder, capsys):
    assert main(["reproduce", "crps-table1", "--model", folder, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "runs: 36" in out and "-- run +CRPS: recipe crps" in out and "rollout.max_turns: 50  (ours)" in out
    assert re.search(r"GPU-hours estimate: \d+ H100-hours for 36 runs", out)
    assert main(["reproduce", "nope", "--model", folder, "--dry-run"]) == 2  # one line naming the suites


def test_shared_settings_are_identical_across_a_tables_runs(plans, folder):
    """Within a suite and env, every run resolves every key alike, except the keys the paper varies between its
    runs (the suite's ``varies``) and those a run's own overrides set."""
    problems = []
    for name, (suite, planned) in plans.items():
        for env in suite.envs:
            here = [p for p in planned if p.env == env]
            cfgs = [flat_config(suites.preview(p, folder)) for p in here]
            for key in sorted(set().union(*cfgs)):
                values = {json.dumps(c.get(key), sort_keys=True) for c in cfgs}
                if len(values) == 1 or key in ("trainer.out_dir", "trainer.seed"):
                    continue
                if any(key == v or (v.endswith(".") and key.startswith(v)) for v in suite.varies):
                    continue
                own = [p for p, c in zip(here, cfgs) if key in suites.flatten(p.run.overrides)]
                rest = {json.dumps(c.get(key), sort_keys=True) for p, c in zip(here, cfgs) if p not in own}
                if len(rest) > 1:
                    problems.append(f"{name} on {env}: '{key}' differs across runs: " + ", ".join(
                        f"{p.run.name}={c.get(key)!r}" for p, c in zip(here, cfgs)))
    assert not problems, "\n".join(problems)


def test_a_suites_shared_settings_reach_every_run(plans, folder):
    for name, (suite, planned) in plans.items():
        for p in planned:
            cfg = flat_config(suites.preview(p, folder))
            for key, value in suites.suite_shared(suite, p.env, demo=False).items():
                if key in suites.flatten(p.run.overrides):
                    continue
                assert cfg[key] == value, f"{name}: {p.run.name} on {p.env}: {key}={cfg[key]!r}, shared {value!r}"


def paper_recipes():
    """(recipe, env, paper) for every recipe of a suite on each of its paper's envs."""
    out = set()
    for name in suites.names():
        s = suites.load(name)
        out |= {(r.recipe, env, s.paper) for r in s.runs for env in s.envs}
    return sorted(out)


def test_every_recipe_on_its_papers_envs_gets_no_demo_value_and_covers_the_expert(folder):
    problems = []
    for recipe, env, paper in paper_recipes():
        sources = config_sources(recipe, env=env, model=folder)
        cfg = load_config(recipe, env=env, model=folder)
        for key in SIZE_KEYS:
            if sources[key] in ("default", "demo overlay"):
                problems.append(f"{recipe} on {env}: {key} from the {sources[key]}")
        if cfg.sft.enabled and sources["sft.lr"] == "default":
            problems.append(f"{recipe} on {env}: sft.lr from the default (sized for the tiny model)")
        assert not [k for k, v in sources.items() if v == "demo overlay"], (recipe, env)
        r = cfg.rollout
        reach = r.max_turns * (r.max_actions_per_turn or ACTIONS_PER_TURN.get(env, 1))
        if r.max_episode_actions:
            reach = min(reach, r.max_episode_actions)
        if reach < EXPERT[env]["p90"] and (env, paper) not in PAPER_HORIZON:
            problems.append(f"{recipe} on {env}: an episode reaches {reach} actions, the expert's p90 is "
                            f"{EXPERT[env]['p90']}")
    assert not problems, "\n".join(problems)


def test_spear_runs_its_schedules_to_the_end(folder):
    """SPEAR's run is the paper's length, so gamma's warm-up and mu's decay complete as Table 8 has them."""
    for recipe in ("spear", "spear_dr_bot", "spear_gigpo"):
        for env, steps in (("sokoban", 200), ("alfworld", 200), ("webshop", 350)):
            cfg = load_config(recipe, env=env, model=folder)
            sources = config_sources(recipe, env=env, model=folder)
            warm = cfg.extra.get("warmup_steps", 200 if env == "webshop" else 100)
            assert cfg.trainer.steps == steps and warm <= steps and sources["trainer.steps"] == "recipe"


def test_print_sources_lists_every_key_with_defaults(folder, capsys):
    assert main(["train", "spear", "--env", "alfworld", "--model", folder, "--print-sources"]) == 0
    lines = dict(line.split(": ", 1) for line in capsys.readouterr().out.splitlines())
    assert lines["extra.warmup_steps"] == "100  # default" and lines["rollout.max_turns"] == "50  # recipe"
    assert lines["trainer.keep_checkpoints"] == "2  # default"
    assert main(["train", "spear", "--env", "alfworld", "--model", folder, "--print-sources",
                 "--changed-only"]) == 0
    assert "# default" not in capsys.readouterr().out


# ------------------------------------------------------------------------------------------------------
# the recipe pages' checked deviation rows

ROW = re.compile(r"^\| `(?P<recipe>[\w.]+)` \| `(?P<env>[\w:-]+)` \| `(?P<key>[\w.@]+)` \| (?P<paper>[^|]*) \| "
                 r"`(?P<here>[^`]*)` \|")


def checked_rows():
    rows = []
    for page in sorted((ROOT / "docs/recipes").glob("*.md")):
        text = page.read_text()
        if "<!-- checked-deviations -->" not in text:
            continue
        block = text.split("<!-- checked-deviations -->", 1)[1]
        rows += [(page.name, m) for m in map(ROW.match, block.splitlines()) if m]
    return rows


def test_every_paper_recipe_page_has_checked_deviation_rows():
    pages = {name for name, _ in checked_rows()}
    assert pages >= {"crps.md", "spear.md", "starpo.md", "leafe.md", "rro.md", "grpo.md", "gigpo.md", "ppo.md"}


def test_the_deviation_tables_agree_with_print_config(folder):
    rows = checked_rows()
    assert len(rows) >= 30
    for page, m in rows:
        cfg = load_config(m["recipe"], env=m["env"], model=folder)
        values = flat_config(cfg)
        from agentrl.config_loader import resolved_values

        values = resolved_values(cfg)
        assert m["key"] in values, f"{page}: {m['key']} is not a key of {m['recipe']}"
        want = yaml.safe_load(m["here"])
        assert values[m["key"]] == want, (f"{page}: `{m['recipe']}` on `{m['env']}` says {m['key']} = {want!r}, "
                                          f"--print-config gives {values[m['key']]!r}")


def test_the_expert_lengths_are_data_with_their_command():
    for env in ("sokoban", "frozenlake", "bandit", "alfworld", "webshop", "scienceworld"):
        assert EXPERT[env]["command"].startswith("python scripts/expert_lengths.py") and env in EXPERT[env]["command"]
        assert EXPERT[env]["solved"] > 0 and EXPERT[env]["p90"] >= EXPERT[env]["median"]


def test_on_the_tiny_model_a_suite_is_its_cpu_demo(tmp_path):
    """Every suite plans its demo on the tiny model: a warm start a seed first, every run starting from it, the
    demo's shared settings in every run."""
    for name in suites.names():
        suite = suites.load(name)
        planned = suites.plan(suite, "tiny", seeds=1, out=tmp_path / name)
        assert planned[0].run.name == suites.WARM_START and {p.env for p in planned} == set(suite.demo.envs)
        for p in planned[1:]:
            start = p.run.warm_start_from
            assert p.cfg is None and p.waits_for == next(q.out_dir for q in planned if q.run.name == start and
                                                         q.env == p.env) / "checkpoint" / "model"
            cfg = flat_config(suites.preview(p, "tiny"))
            for key, value in suites.suite_shared(suite, p.env, demo=True).items():
                assert cfg[key] == value or key in suites.flatten(p.run.overrides), (name, p.run.name, key)


def test_a_folder_holding_the_demo_model_gets_its_model_overlays_too(tmp_path):
    """A tiny build's export (config.json names agentrl_model) takes the demo overlays and the tiny model's
    overlays alike, not a mix of the demo's and the paper's."""
    (tmp_path / "config.json").write_text(json.dumps({"agentrl_model": "tiny"}))
    cfg = load_config("spear", env="sokoban", model=str(tmp_path))
    assert cfg.extra["warmup_steps"] == 10 and cfg.optim.lr == 5e-5  # model_overlays.tiny, demo overlay


def test_the_table_gives_mean_and_range_over_seeds_and_the_papers_number(folder, tmp_path):
    suite = suites.load("crps-table1")
    planned = suites.plan(suite, folder, seeds=2, out=tmp_path, envs=["alfworld"], only=["GRPO", "+CRPS"])
    assert [p.run.name for p in planned] == ["GRPO", "GRPO", "+CRPS", "+CRPS"]
    for p, success in zip(planned, (0.70, 0.76, 0.80, None)):  # +CRPS seed 1 not done yet
        if success is not None:
            p.out_dir.mkdir(parents=True)
            (p.out_dir / "final.json").write_text(json.dumps({"eval/success": success}))
    table = suites.table(suite, planned, folder)
    assert "| GRPO | 0.730 (0.700-0.760) (0.730) |" in table
    assert "| +CRPS | 0.800 [1/2 seeds] (0.830) |" in table
    with pytest.raises(suites.ConfigError, match="has no run 'CRPS'; allowed: RFT, PPO"):
        suites.plan(suite, folder, only=["CRPS"])
    # a done run is skipped by the next launch: its folder holds final.json
    assert [p.done for p in planned] == [True, True, True, False]


# ------------------------------------------------------------------------------------------------------
# the results page's suite tables, written by `agentrl reproduce --results`

# the command docs/results.md quotes for its RAGEN block (its folder aside)
RAGEN_CHECK = ["reproduce", "ragen-fig9", "--model", "tiny", "--seeds", "2", "--run", "StarPO (GRPO)", "--run",
               "StarPO-S (GRPO)", "eval.tasks=64", "trainer.steps=2"]


def _finish(out, success):
    """The RAGEN check's run folders as finished runs leave them: final.json with each seed's success."""
    planned = suites.plan(suites.load("ragen-fig9"), "tiny", seeds=2, out=out,
                          only=["StarPO (GRPO)", "StarPO-S (GRPO)"])
    for p in planned:
        p.out_dir.mkdir(parents=True, exist_ok=True)
        (p.out_dir / "final.json").write_text(json.dumps({"eval/success": success[p.run.name][p.seed]}))


def test_reproduce_regenerates_the_results_pages_suite_table(tmp_path, capsys):
    original = (ROOT / "docs/results.md").read_text()
    page, out = tmp_path / "results.md", tmp_path / "out"
    page.write_text(original)
    begin, end = suites.markers("ragen-fig9")
    block = lambda text: text.split(begin, 1)[1].split(end, 1)[0]  # noqa: E731
    command = RAGEN_CHECK + ["--out", str(out), "--table", "--results", str(page)]
    # from folders holding the recorded readings, the page comes back as committed: its block is the command's
    _finish(out, {suites.WARM_START: [0.0625, 0.03125], "StarPO (GRPO)": [0.125, 0.046875],
                  "StarPO-S (GRPO)": [0.125, 0.109375]})
    assert main(command) == 0
    assert page.read_text() == original
    # new readings replace the table and nothing else on the page
    _finish(out, {suites.WARM_START: [0.25, 0.5], "StarPO (GRPO)": [0.5, 0.75], "StarPO-S (GRPO)": [0.75, 1.0]})
    assert main(command) == 0
    text = page.read_text()
    assert block(text) == (
        "\nRAGEN Figure 9: StarPO against StarPO-S, PPO and GRPO forms (success)\n\n"
        "Command: `agentrl reproduce ragen-fig9 --model tiny --seeds 2 --run \"StarPO (GRPO)\" --run \"StarPO-S "
        "(GRPO)\" eval.tasks=64 trainer.steps=2`\n\n"
        "| run | sokoban success |\n| --- | --- |\n| warm start | 0.375 (0.250-0.500) |\n"
        "| StarPO (GRPO) | 0.625 (0.500-0.750) |\n| StarPO-S (GRPO) | 0.875 (0.750-1.000) |\n")
    assert text.replace(block(text), "") == original.replace(block(original), "")
    assert (out / "table.md").read_text().strip() == block(text).strip()


def test_a_results_page_without_the_suites_block_is_refused_before_anything_runs(tmp_path, capsys):
    page = tmp_path / "results.md"
    page.write_text("# Results\n\n<!-- reproduce crps-table1 -->\n<!-- /reproduce crps-table1 -->\n")
    for extra in (["--dry-run"], []):  # what a run refuses, its dry run refuses too
        assert main(RAGEN_CHECK + ["--out", str(tmp_path / "out"), "--results", str(page)] + extra) == 2
        err = capsys.readouterr().err.strip()
        assert "'--results'" in err and "<!-- reproduce ragen-fig9 -->" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "out").exists()
    assert page.read_text().count("reproduce") == 2  # the page is left alone


def test_the_command_lines_overrides_reach_the_warm_start_unless_it_sets_the_key_itself(tmp_path, capsys):
    """A short check's sft.demos reaches the demo's warm start (the suite shares its SFT keys); a key the warm
    start sets itself (trainer.steps 0) keeps its value, and the command says so in one line."""
    check = ["reproduce", "ragen-fig9", "--model", "tiny", "--seeds", "1", "--run", "StarPO (GRPO)", "sft.demos=200",
             "trainer.steps=2", "--out", str(tmp_path), "--dry-run"]
    assert main(check) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["note: run 'warm start' sets trainer.steps=0 itself; the command line's trainer.steps=2 does not "
                   "reach it"]
    planned = suites.plan(suites.load("ragen-fig9"), "tiny", seeds=1, out=tmp_path, user=["sft.demos=200",
                                                                                        "trainer.steps=2"])
    warm = planned[0]
    assert warm.run.name == suites.WARM_START and warm.cfg.sft.demos == 200 and warm.cfg.trainer.steps == 0


@pytest.mark.timeout(300)  # a warm start, two one-step runs and the table: ~10 s
def test_a_suite_runs_end_to_end_on_a_tiny_model_and_writes_its_table(tiny_model_dir, tmp_path, capsys):
    """RAGEN's demo on a tiny model folder: the warm start, each form from it, the table from their final.json
    (the warm start's reading is its step-0 evaluation); a second launch skips the runs done."""
    out = tmp_path / "out"
    check = ["reproduce", "ragen-fig9", "--model", str(tiny_model_dir), "--seeds", "1", "--run", "StarPO (GRPO)",
             "--run", "StarPO-S (GRPO)", "--out", str(out), "sft.demos=4", "sft.epochs=1", "eval.tasks=4",
             "trainer.steps=1", "rollout.groups=2", "rollout.slots=8", "rollout.max_turns=2",
             "rollout.max_new_tokens=8", "trainer.progress=false", "trainer.tensorboard=false"]
    assert main(check) == 0
    table = (out / "table.md").read_text()
    rows = [line for line in table.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert [r.split(" | ")[0] for r in rows] == ["| warm start", "| StarPO (GRPO)", "| StarPO-S (GRPO)"]
    assert all(re.fullmatch(r"\| [^|]+ \| \d\.\d{3} \|", r) for r in rows), table  # one seed each, read back
    for run in (suites.WARM_START, "StarPO (GRPO)", "StarPO-S (GRPO)"):
        assert "eval/success" in json.loads((out / "sokoban" / f"{suites.slug(run)}-s0" / "final.json").read_text())
    capsys.readouterr()
    assert main(check) == 0
    assert capsys.readouterr().out.count("done, skipped") == 3
