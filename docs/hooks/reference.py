"""MkDocs hook: generates the config reference and the CLI reference at build time.

The config reference walks the config dataclasses (``RecipeCfg`` and its sections) and takes each key's
meaning from the comment at or just above its field in the source, so the page cannot drift from the
code; ``tests/test_docs.py`` fails when a key has no meaning. The CLI reference is ``agentrl --help`` and
each subcommand's help, as argparse prints them.
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import io
import re
import sys
import textwrap
import tokenize
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
CONFIG_PAGE = "reference/config.md"
CLI_PAGE = "reference/cli.md"

# Meanings of the keys whose field carries no comment in the source yet. A comment on the field wins over
# an entry here; tests/test_docs.py fails on a key with neither, and on an entry naming no key.
FALLBACK = {
    "recipe": "the recipe's name: a YAML in recipes/ (set from the file the run loads; not set by hand)",
    "env": "the env: a registered name (`agentrl envs list`), `module:Class`, `gymnasium:<id>`, `gem:<id>`, "
           "`textarena:<id>` or `rg:<dataset>`",
    "env_kwargs": "keyword arguments for the env's constructor (e.g. `data_dir`, `gym_kwargs`, `expert`)",
    "model.dtype": "the learner's parameter dtype (float32, bfloat16)",
    "model.lora_alpha": "LoRA's scaling alpha (with model.lora_r > 0)",
    "rollout.pool": "where env slots run: in the trainer's process, one worker process per env (restarted "
                    "and replayed when it dies), or Ray actors (trainer.ray_address)",
    "rollout.max_turns": "turns an episode may take before it is truncated",
    "rollout.history_len": "window mode: past turns shown in each prompt",
    "rollout.chat_mode": "window: a fresh prompt per turn with the last history_len turns; full: the whole "
                         "episode as one growing chat (RAGEN/StarPO)",
    "rollout.temperature": "sampling temperature of training rollouts",
    "rollout.top_p": "nucleus sampling threshold of training rollouts",
    "rollout.max_new_tokens": "tokens one response may generate",
    "rollout.require_think": "a response needs <think>...</think> before its answer, else it gets format_penalty",
    "rollout.format_penalty": "reward added to a turn without a valid answer",
    "rollout.show_admissible": "list the env's admissible actions in the prompt",
    "rollout.split": "the task split training rollouts draw from",
    "rollout.max_rounds": "dynamic sampling: the most rollout rounds in one step",
    "algo.estimator": "the advantage estimator, from agentrl.algos.advantages.ESTIMATORS: grpo | dr_grpo | "
                      "rloo | reinforce_pp | reinforce_pp_baseline | gae | gae_token | gigpo | gigpo_dr",
    "algo.reward": "what an episode is rewarded with: success (1 when won), score (the env's 0-1 score) or "
                   "env_return (the env's own step rewards)",
    "algo.gamma": "discount over turns (GAE)",
    "algo.lam": "GAE's lambda",
    "algo.gigpo_step_weight": "GiGPO: the weight of the step-level advantage added to the episode-level one",
    "algo.eps_low": "PPO clip range below 1 (the ratio's lower bound is 1 - eps_low)",
    "algo.eps_high": "PPO clip range above 1; above eps_low it is clip-higher (DAPO)",
    "algo.dual_clip": "dual-clip bound C on negative advantages (null: off)",
    "algo.agg": "how token losses are aggregated into the loss",
    "algo.kl_coef": "weight of the KL loss term (algo.kl)",
    "algo.entropy_coef": "weight of the entropy bonus",
    "algo.clip_cov_ratio": "Clip-Cov: the fraction of tokens of highest covariance left out of the gradient (0: off)",
    "algo.ppo_epochs": "passes over each step's batch",
    "algo.value_coef": "weight of the value loss (estimators with a critic)",
    "algo.value_clip": "clip range of the value loss (null: unclipped)",
    "algo.filters": "group and episode filters applied before the estimator, from agentrl.algos.filters.FILTERS: "
                    "dropped | zero_variance | variance | overlong | void_turn | invalid_format",
    "optim.lr": "the RL learning rate (AdamW)",
    "optim.weight_decay": "AdamW's weight decay",
    "optim.grad_clip": "gradient norm clip (null: none)",
    "optim.warmup_steps": "optimizer steps of linear lr warm-up",
    "optim.token_budget": "padded tokens per micro-batch on each rank",
    "sft.epochs": "SFT passes over the demonstrations",
    "sft.batch_size": "rows per SFT batch",
    "sft.lr": "the SFT learning rate",
    "sft.select_split": "the split SFT's pass selection reads (never eval.split)",
    "sft.select_tasks": "tasks read after each pass by the pass selection",
    "eval.tasks": "tasks per evaluation",
    "eval.split": "the split evaluations read",
    "eval.temperature": "sampling temperature of evaluations (0: greedy)",
    "trainer.steps": "RL steps of the run",
    "trainer.seed": "the run's seed (`--seed`)",
    "trainer.out_dir": "the run folder; {recipe}, {env} and {seed} are filled in",
    "trainer.checkpoint_every": "RL steps between checkpoints",
    "trainer.generator_url": "trainer.generator remote or vllm: the server URL, or a list of URLs, to attach to",
    "trainer.vllm_servers": "trainer.generator=vllm: the vllm serve processes rank 0 starts",
    "trainer.tensorboard": "write TensorBoard event files under RUN/tb",
    "trainer.wandb": "log to wandb (offline unless WANDB_MODE says otherwise)",
    "trainer.progress": "print a progress line per step",
}


@dataclass
class KeyDoc:
    key: str  # dotted, e.g. rollout.group_size
    type: str  # the annotation as written in the source
    default: str  # the default, as YAML would spell it
    meaning: str  # the field's comment in the source, one paragraph


def _config_module():
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from agentrl import config

    return config


def _field_comments(cls: type) -> dict[str, tuple[str, str]]:
    """Field name -> (annotation text, comment) for a dataclass, from its source: the comment on the
    field's line, else the block of comment lines right above it."""
    path = inspect.getsourcefile(cls)
    source = Path(path).read_text()
    lines = source.splitlines()
    trailing: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            row, col = tok.start
            if lines[row - 1][:col].strip():  # code before it on the line: a trailing comment
                trailing[row] = tok.string.lstrip("#").strip()
    node = next(n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ClassDef) and n.name == cls.__name__)
    out: dict[str, tuple[str, str]] = {}
    for stmt in node.body:
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        above: list[str] = []
        row = stmt.lineno - 1
        while row >= 1 and lines[row - 1].strip().startswith("#"):
            above.insert(0, lines[row - 1].strip().lstrip("#").strip())
            row -= 1
        comment = trailing.get(stmt.end_lineno or stmt.lineno) or trailing.get(stmt.lineno) or " ".join(above)
        out[stmt.target.id] = (ast.unparse(stmt.annotation), comment.replace("  (", " ("))
    return out


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return None


def _yaml_value(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return f'"{v}"' if v == "" else v
    if isinstance(v, list):
        return "[" + ", ".join(_yaml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {_yaml_value(x)}" for k, x in v.items()) + "}"
    return repr(v)


def sections() -> list[tuple[str, type, list[KeyDoc]]]:
    """(section name, dataclass, its keys) for the top level ("") and each section of RecipeCfg."""
    config = _config_module()
    root = config.RecipeCfg
    out: list[tuple[str, type, list[KeyDoc]]] = []
    top: list[KeyDoc] = []
    comments = _field_comments(root)
    nested: list[tuple[str, type]] = []
    for f in dataclasses.fields(root):
        d = _default(f)
        if dataclasses.is_dataclass(d):
            nested.append((f.name, type(d)))
            continue
        ann, meaning = comments.get(f.name, ("", ""))
        top.append(KeyDoc(f.name, ann, _yaml_value(d), meaning or FALLBACK.get(f.name, "")))
    out.append(("", root, top))
    for name, cls in nested:
        comments = _field_comments(cls)
        keys = []
        for f in dataclasses.fields(cls):
            ann, meaning = comments.get(f.name, ("", ""))
            key = f"{name}.{f.name}"
            keys.append(KeyDoc(key, ann, _yaml_value(_default(f)), meaning or FALLBACK.get(key, "")))
        out.append((name, cls, keys))
    return out


def all_keys() -> list[KeyDoc]:
    return [k for _, _, keys in sections() for k in keys]


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


DOC_PATH = re.compile(r"docs/([A-Za-z0-9_/.-]+\.md)")


def _link_docs(text: str, page_dir: str = "reference") -> str:
    """``docs/x.md`` named in a source comment becomes a link from the generated page (a study write-up
    moved under studies/ is found there); a path that names no page stays text."""
    def link(m: re.Match) -> str:
        rel = m.group(1)
        if not (ROOT / "docs" / rel).is_file() and (ROOT / "docs/studies" / Path(rel).name).is_file():
            rel = f"studies/{Path(rel).name}"
        if not (ROOT / "docs" / rel).is_file():
            return m.group(0)
        up = "../" * len(Path(page_dir).parts)
        return f"[{rel}]({up}{rel})"
    return DOC_PATH.sub(link, text)


def config_page() -> str:
    parts = [
        "# Config reference",
        "",
        "Every key of a recipe config, generated from the config dataclasses (`agentrl/config.py`) when the",
        "site is built: the type, the default a key has when no YAML sets it, and the meaning written next to",
        "the field in the source. A recipe YAML (`recipes/NAME.yaml`) and its env and model overlays set",
        "many of these; `agentrl train RECIPE --env ENV --print-config` prints the values a run will use,",
        "and `section.key=value` on the command line overrides any of them",
        "([the config system](../concepts/config.md)).",
        "",
        "Keys a recipe YAML may carry besides these: `base` (the recipe it inherits from), `env_overlays`",
        "(`{env name: sections}`, merged when that env is chosen), `model_overlays` (`{model name: sections}`,",
        "merged when that model is chosen). `extra` holds a recipe's own knobs, checked against the recipe",
        "class's `Params` dataclass: they are listed on each [recipe's page](../recipes/index.md).",
        "",
    ]
    for name, cls, keys in sections():
        title = f"`{name}`" if name else "Top level"
        doc = (inspect.getdoc(cls) or "").splitlines()
        parts += [f"## {title}", ""]
        if name and doc and not doc[0].startswith(cls.__name__ + "("):
            parts += [doc[0], ""]
        parts += ["| key | type | default | meaning |", "| --- | --- | --- | --- |"]
        for k in keys:
            parts.append(f"| `{k.key}` | `{_cell(k.type)}` | `{_cell(k.default)}` | {_link_docs(_cell(k.meaning))} |")
        parts.append("")
    return "\n".join(parts)


def params_table(recipe: str) -> str:
    """The ``extra:`` keys of a registered recipe: its ``Params`` dataclass as a table, meanings from the
    field comments in its source."""
    config = _config_module()  # noqa: F841  (puts the repo on the path)
    import agentrl.recipes  # noqa: F401  (fills the registry)
    from agentrl.recipe import RECIPES

    params = getattr(RECIPES.get(recipe), "Params", None)
    if params is None:
        return f"`{recipe}` takes no `extra:` keys."
    comments = {}
    for cls in reversed(params.__mro__):  # a subclass's fields are commented in its own source
        if dataclasses.is_dataclass(cls):
            comments.update(_field_comments(cls))
    rows = ["| key | type | default | meaning |", "| --- | --- | --- | --- |"]
    for f in dataclasses.fields(params):
        ann, meaning = comments.get(f.name, ("", ""))
        rows.append(f"| `extra.{f.name}` | `{_cell(ann)}` | `{_cell(_yaml_value(_default(f)))}` | "
                    f"{_link_docs(_cell(meaning), 'recipes')} |")
    return "\n".join(rows)


PARAMS_MARK = re.compile(r"<!-- extra-keys: ([a-z_]+) -->")


def on_page_markdown(markdown, page, config, files):  # noqa: ANN001  (mkdocs hook signature)
    """Replace ``<!-- extra-keys: RECIPE -->`` with that recipe's ``extra:`` keys."""
    return PARAMS_MARK.sub(lambda m: params_table(m.group(1)), markdown)


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:  # argparse keeps its subcommands here and nowhere public
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _help(parser: argparse.ArgumentParser) -> str:
    # a fixed width, so the page does not depend on the terminal that builds it
    parser.formatter_class = lambda prog: argparse.HelpFormatter(prog, width=100)
    return parser.format_help()


def cli_page() -> str:
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from agentrl.cli import build_parser

    parser = build_parser()
    parser.prog = "agentrl"
    parts = [
        "# CLI reference",
        "",
        "`agentrl` (installed by `make setup` as `.venv/bin/agentrl`; `python -m agentrl.cli` is the same) and",
        "its commands, as `--help` prints them. This page is generated from the argument parser when the",
        "site is built. A dotted `section.key=value` after `agentrl train` or `agentrl eval` overrides any",
        "[config key](config.md).",
        "",
        "```text",
        _help(parser).rstrip(),
        "```",
        "",
    ]

    def walk(p: argparse.ArgumentParser, path: str, depth: int) -> None:
        for name, sub in _subparsers(p).items():
            full = f"{path} {name}"
            parts.extend([f"{'#' * depth} `{full}`", "", "```text", _help(sub).rstrip(), "```", ""])
            walk(sub, full, depth + 1)

    walk(parser, "agentrl", 2)
    return "\n".join(parts)


def on_files(files, config):  # noqa: ANN001  (mkdocs hook signature)
    from mkdocs.structure.files import File

    for uri, text in ((CONFIG_PAGE, config_page()), (CLI_PAGE, cli_page())):
        existing = files.get_file_from_path(uri)
        if existing is not None:
            files.remove(existing)
        files.append(File.generated(config, uri, content=text))
    return files


if __name__ == "__main__":  # print a page: python docs/hooks/reference.py config|cli
    print(textwrap.dedent(config_page() if sys.argv[1:] == ["config"] else cli_page()))
