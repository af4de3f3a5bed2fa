"""Progress lines during long preparation, and diagnostics through ``logging`` (one line each, level chosen
by argument or AGENTRL_LOG_LEVEL)."""
import logging

import pytest

from agentrl.logs import setup_logging
from agentrl.progress import Progress
from agentrl.schema import ConfigError


def test_plain_progress_prints_a_line_every_few_seconds_and_one_at_the_end(capsys):
    with Progress("games", 4, every_s=0.0) as p:
        for i in range(4):
            p.advance(info=f"last {i}")
    lines = capsys.readouterr().out.splitlines()
    assert [ln.split(",")[0] for ln in lines] == ["games: 1/4 (25%)", "games: 2/4 (50%)", "games: 3/4 (75%)",
                                                  "games: 4/4 (100%)"]
    assert lines[-1].endswith("last 3")
    with Progress("games", 4, every_s=3600.0) as p:  # quick work: the closing line only
        p.advance(4)
    assert capsys.readouterr().out.startswith("games: 4/4 (100%), 0 s")
    with Progress("games", 4, enabled=False) as p:  # other ranks: silent
        p.advance(4)
    assert capsys.readouterr().out == ""


def test_expert_demonstrations_report_their_progress(capsys):
    from agentrl.envs import make
    from agentrl.sft import expert_demos

    tasks = [t.task_id for t in make("bandit").tasks("train")[:3]]
    demos = expert_demos("bandit", {}, [(t, i) for i, t in enumerate(tasks)], show=True)
    assert len(demos) == 3
    out = capsys.readouterr().out
    assert out.startswith("bandit demonstrations: 3/3 (100%)") and "expert success" in out


@pytest.fixture
def agentrl_logger():
    logger = logging.getLogger("agentrl")
    saved = logger.handlers[:], logger.level, logger.propagate
    yield logger
    logger.handlers[:], logger.level, logger.propagate = saved


def test_setup_logging_prints_one_line_per_record_at_the_chosen_level(agentrl_logger, capsys, monkeypatch):
    monkeypatch.delenv("AGENTRL_LOG_LEVEL", raising=False)
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "0")  # a user's setting wins over ours
    assert setup_logging() == logging.INFO  # the default
    setup_logging()  # a second call replaces its handler: no line twice
    log = logging.getLogger("agentrl.envs.alfworld_env")
    log.debug("hidden")
    log.info("built %d games", 3)
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].endswith("INFO agentrl.envs.alfworld_env: built 3 games")
    monkeypatch.setenv("AGENTRL_LOG_LEVEL", "debug")
    assert setup_logging() == logging.DEBUG
    log.debug("shown")
    assert capsys.readouterr().err.rstrip().endswith("DEBUG agentrl.envs.alfworld_env: shown")
    assert setup_logging("warning") == logging.WARNING  # the argument (--log-level) beats the variable
    with pytest.raises(ConfigError, match="bad log level 'loud' .*allowed: debug, info, warning, error"):
        setup_logging("loud")
