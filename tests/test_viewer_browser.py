"""`agentrl view` in a real headless Chromium (the OS's, driven by Playwright) on a short real run: the curves
render, a step's groups list, an episode's turns show the actions the records hold, a filter narrows the
list, the tokens are coloured. AGENTRL_VIEWER_SCREENSHOTS=DIR saves the pages (docs/assets holds them)."""
import os
import shutil
from pathlib import Path

import pytest

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def _chromium_or_skip():
    if not Path(CHROMIUM).exists():
        if os.environ.get("CI"):
            pytest.fail("no chromium: .ci/run installs it (apt-get install chromium chromium-driver)")
        pytest.skip("no chromium (apt-get install chromium chromium-driver)")
    return pytest.importorskip("playwright.sync_api")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_view_in_a_real_browser(tiny_model_dir, tmp_path):
    sync_api = _chromium_or_skip()
    from agentrl import Trainer
    from agentrl.config_loader import load_config

    run_dir = tmp_path / "run"
    # the untrained tiny model answers among the admissible moves (constrained decoding): episodes with actions
    # and no SFT warm start
    cfg = load_config("grpo", env="sokoban", overrides=[
        f"model.name={tiny_model_dir}", f"trainer.out_dir={run_dir}", "trainer.steps=2",
        "trainer.tensorboard=false", "trainer.progress=false", "rollout.groups=3", "rollout.group_size=2",
        "rollout.slots=6", "rollout.max_turns=3", "rollout.max_new_tokens=16", "rollout.constrain_actions=true",
        "eval.tasks=2", "eval.every=0", "sft.enabled=false", "trainer.checkpoint_every=2", "algo.filters=[dropped]",
        "rollout.fill_groups=0"])
    t = Trainer.from_config(cfg)
    try:
        t.train()
    finally:
        t.close()
    shots = Path(os.environ.get("AGENTRL_VIEWER_SCREENSHOTS") or tmp_path / "shots")
    check_in_browser(sync_api, run_dir, shots, tmp_path / "profile")


def check_in_browser(sync_api, run_dir, shots, profile):
    """The viewer on ``run_dir`` in a fresh Chromium profile; the pages' screenshots into ``shots``."""
    import agentrl.runs
    from agentrl.viewer.serve import start_viewer

    run = agentrl.runs.open(run_dir)
    step = run.step(run.steps()[-1])
    server = start_viewer([run], "127.0.0.1", 0)
    shots.mkdir(parents=True, exist_ok=True)
    url = f"http://127.0.0.1:{server.server_address[1]}/"
    try:
        with sync_api.sync_playwright() as p:
            # a fresh profile (--user-data-dir): nothing from another run of the browser
            browser = p.chromium.launch_persistent_context(str(profile), executable_path=CHROMIUM, headless=True,
                                                           args=FLAGS, viewport={"width": 1400, "height": 1000})
            page = browser.new_page()
            page.goto(url + f"#run=0&step={step.step}")
            page.wait_for_selector("body[data-ready='1']")
            # the curves: one path per run, a point per logged step
            assert page.locator("#chart path.curve").count() == 1
            assert page.locator("#chart circle.pt").count() == len([r for r in run.metrics() if "success" in r])
            page.screenshot(path=str(shots / "viewer-curves.png"))
            # the step's groups, each with its episodes side by side
            assert page.locator("#groups .group").count() == len(step.groups())
            assert page.locator(".episode-card").count() == len(step.episodes)
            # an episode with actions: its turns show exactly the records' actions
            k = next(i for i, e in enumerate(step.episodes) if any(t["actions"] for t in e["turns"]))
            page.click(f".episode-card[data-ep='{k}']")
            page.wait_for_selector("#episode .turn")
            turns = step.episodes[k]["turns"]
            assert page.locator("#episode .turn").count() == len(turns)
            for i, t in enumerate(turns):
                assert page.locator(f"#episode .turn[data-turn='{i}'] .action").all_inner_texts() == t["actions"]
            # token colouring by log-prob, then by advantage: every token gets a background
            toks = page.locator("#episode .turn .tok")
            assert toks.count() == sum(len(t["tokens"]) for t in turns)
            by_logprob = toks.first.evaluate("e => getComputedStyle(e).backgroundColor")
            assert by_logprob not in ("", "rgba(0, 0, 0, 0)")
            page.screenshot(path=str(shots / "viewer-episode.png"))
            page.select_option("#colour", "advantage")
            page.wait_for_function("() => location.hash.includes('colour=advantage')")
            assert "rgba(0, 0, 0, 0)" != toks.first.evaluate("e => getComputedStyle(e).backgroundColor")
            # a filter narrows the list: search one episode's action that not every episode took
            acts = [{a for t in e["turns"] for a in t["actions"]} for e in step.episodes]
            q = next((a for s in acts for a in s if not all(a in o for o in acts)), "no-such-action")
            want = sum(any(q.lower() in a.lower() for a in s) or any(q.lower() in t["text"].lower()
                       for t in e["turns"]) for s, e in zip(acts, step.episodes))
            page.fill("#f-search", q)
            page.wait_for_function(f"() => document.querySelectorAll('.episode-card').length === {want}")
            assert want < len(step.episodes)
            page.screenshot(path=str(shots / "viewer-filter.png"))
            # a link opens the same episode
            page2 = browser.new_page()
            page2.goto(page.url)
            page2.wait_for_selector("#episode .turn")
            assert page2.locator("#episode .turn").count() == len(turns)
            browser.close()
    finally:
        server.shutdown()
