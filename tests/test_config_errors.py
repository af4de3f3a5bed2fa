"""Hostile config and CLI input (issue 68, item 9; issue 71's preflight): each is one `error:` line naming
the key or argument, exit code 2, before any work."""
import json
import shutil
import sys

import pytest

from agentrl import cli
from agentrl.config import ConfigError
from agentrl.config_loader import load_config

BOMB = "".join(f"{c}: &{c} [{', '.join([f'*{p}'] * 9)}]\n" for p, c in zip("abcdefgh", "bcdefghi"))
BOMB = "a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n" + BOMB  # 9**9 leaves in ~400 bytes


def one_error_line(capsys, argv, *want):
    rc = cli.main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("error: "), (rc, err)
    for w in want:
        assert w in err[0], err[0]
    return err[0]


@pytest.mark.timeout(60)
def test_alias_bomb_yaml_is_refused_at_once(tmp_path, capsys):
    bomb = tmp_path / "bomb.yaml"
    # under a key the schema takes (env_kwargs), so nothing else stops it: 437 bytes ran > 60 s before the bound
    bomb.write_text("base: grpo\nenv_kwargs:\n" + "".join(f"  {line}\n" for line in BOMB.splitlines()))
    assert len(bomb.read_bytes()) < 600
    with pytest.raises(ConfigError, match="anchors and aliases expand it by more than"):
        load_config(str(bomb))
    one_error_line(capsys, ["train", str(bomb), "--print-config"], "bomb.yaml", "aliases")
    # the same through an override, whose value is parsed as YAML (env_kwargs={...})
    inline = "{" + BOMB.replace("\n", ", ").rstrip(", ").replace(": &", ": &") + "}"
    with pytest.raises(ConfigError, match="override 'env_kwargs': anchors and aliases"):
        load_config("grpo", overrides=[f"env_kwargs={inline}"])
    recursive = tmp_path / "loop.yaml"
    recursive.write_text("base: grpo\nenv_kwargs: &k {self: *k}\n")
    with pytest.raises(ConfigError, match="recursive anchor"):
        load_config(str(recursive))
    # a few anchors reused, as people write YAML, still load
    fine = tmp_path / "fine.yaml"
    fine.write_text("base: grpo\nenv_kwargs: {a: &v [1, 2], b: *v, c: *v}\n")
    assert load_config(str(fine)).env_kwargs == {"a": [1, 2], "b": [1, 2], "c": [1, 2]}
    ids = "[" + ", ".join(map(str, range(30_000))) + "]"  # a long list written out: no alias, no limit
    assert len(load_config("grpo", overrides=[f"env_kwargs={{ids: {ids}}}"]).env_kwargs["ids"]) == 30_000


@pytest.mark.parametrize("override", ["rollout.temperature=nan", "rollout.temperature=inf", "rollout.temperature=.nan",
                                      "rollout.temperature=-1", "optim.lr=nan", "optim.lr=-inf", "optim.lr=0",
                                      "eval.temperature=nan", "algo.eps_high=nan", "sft.lr=1e400"])
def test_non_finite_or_negative_numbers_are_refused(override):
    key = override.split("=")[0]
    with pytest.raises(ConfigError, match=f"bad value for '{key}'") as e:
        load_config("grpo", env="sokoban", overrides=[override])
    assert "\n" not in str(e.value)


def test_a_base_that_is_not_a_name(tmp_path, capsys):
    y = tmp_path / "mine.yaml"
    y.write_text("base: 5\n")
    one_error_line(capsys, ["train", str(y), "--print-config"], "bad value for 'base': 5")


def test_an_env_spec_that_does_not_import(capsys, tmp_path):
    one_error_line(capsys, ["train", "grpo", "--env", "os:Typo", "--out", str(tmp_path / "a")],
                   "'os:Typo'", "no 'Typo'")
    one_error_line(capsys, ["train", "grpo", "--env", "no_such_pkg.mod:Env", "--out", str(tmp_path / "b")],
                   "'no_such_pkg.mod' cannot be imported")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()  # nothing was started


def test_eval_tasks_and_samples_must_be_positive(capsys):
    one_error_line(capsys, ["eval", "--tasks", "0"], "'--tasks': 0")
    one_error_line(capsys, ["eval", "--samples", "0"], "'--samples': 0")


def test_eval_on_a_folder_of_another_model_type(tmp_path, capsys, tiny_model_dir):
    vit = tmp_path / "vit"
    vit.mkdir()
    (vit / "config.json").write_text(json.dumps({"model_type": "vit"}))
    one_error_line(capsys, ["eval", "--model", str(vit), "--out", str(tmp_path / "o")], "'vit' is not a causal")
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "config.json").write_text("{not json")
    one_error_line(capsys, ["eval", "--model", str(junk), "--out", str(tmp_path / "o")], "not readable JSON")
    (junk / "config.json").write_text(json.dumps({"hidden_size": 8}))
    one_error_line(capsys, ["eval", "--model", str(junk), "--out", str(tmp_path / "o")], "no 'model_type'")
    (junk / "config.json").write_text(json.dumps({"model_type": "no-such-arch"}))
    one_error_line(capsys, ["eval", "--model", str(junk), "--out", str(tmp_path / "o")], "unknown to this transformers")
    bare = tmp_path / "bare"  # a causal LM's config and tokenizer, no weights
    shutil.copytree(tiny_model_dir, bare, ignore=shutil.ignore_patterns("*.safetensors", "*.bin"))
    one_error_line(capsys, ["eval", "--model", str(bare), "--out", str(tmp_path / "o")], "holds no weights")


SMALL = ["trainer.steps=0", "sft.enabled=false", "eval.tasks=0", "trainer.tensorboard=false"]


def test_preflight_cuda_without_cuda(capsys, tmp_path, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    one_error_line(capsys, ["train", "grpo", "--out", str(tmp_path / "r"), "trainer.device=cuda", *SMALL],
                   "trainer.device=cuda but", "trainer.device=cpu")
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("override,module,hint", [("trainer.wandb=true", "wandb", "pip install wandb"),
                                                  ("rollout.pool=ray", "ray", 'pip install -e ".[ray]"')])
def test_preflight_missing_package(override, module, hint, capsys, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, module, None)  # import fails as when the package is absent
    one_error_line(capsys, ["train", "grpo", "--out", str(tmp_path / "r"), override, *SMALL],
                   f"{override} needs the {module} package", hint)
    assert not (tmp_path / "r").exists()


def test_duplicate_keys_and_yaml_syntax_errors_name_their_lines(tmp_path, capsys):
    """PyYAML keeps the last of two equal keys: `trainer: {steps: 3, steps: 5}` ran 5 steps, and a second top-level
    `trainer:` block dropped the first whole. Each is one line naming the key and both places."""
    inline = tmp_path / "inline.yaml"
    inline.write_text("base: grpo\ntrainer: {steps: 3, steps: 5}\n")
    with pytest.raises(ConfigError, match=r"duplicate key 'trainer\.steps': line 2, column 11 and line 2, column 21"):
        load_config(str(inline))
    blocks = tmp_path / "blocks.yaml"
    blocks.write_text("base: grpo\ntrainer:\n  steps: 3\nrollout:\n  groups: 2\ntrainer:\n  seed: 4\n")
    one_error_line(capsys, ["train", str(blocks), "--print-config"], "blocks.yaml", "duplicate key 'trainer'",
                   "line 2, column 1 and line 6, column 1")
    with pytest.raises(ConfigError, match="override 'env_kwargs': duplicate key 'a'"):
        load_config("grpo", overrides=["env_kwargs={a: 1, a: 2}"])
    # a merge key's keys may be overridden, as YAML means them to be
    merged = tmp_path / "merged.yaml"
    merged.write_text("base: grpo\nenv_kwargs:\n  d: &d {x: 1, y: 2}\n  e: {<<: *d, x: 3}\n")
    assert load_config(str(merged)).env_kwargs["e"] == {"x": 3, "y": 2}
    tab = tmp_path / "tab.yaml"
    tab.write_text("base: grpo\ntrainer:\n\tsteps: 3\n")
    one_error_line(capsys, ["train", str(tab), "--print-config"], "tab.yaml", "line 3, column 1", "'\\t'")
