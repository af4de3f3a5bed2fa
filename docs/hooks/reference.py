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
        top.append(KeyDoc(f.name, ann, _yaml_value(d), meaning))
    out.append(("", root, top))
    for name, cls in nested:
        comments = _field_comments(cls)
        keys = []
        for f in dataclasses.fields(cls):
            ann, meaning = comments.get(f.name, ("", ""))
            key = f"{name}.{f.name}"
            keys.append(KeyDoc(key, ann, _yaml_value(_default(f)), meaning))
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


def committed_pages() -> dict[Path, str]:
    """The generated pages as committed under docs/ (so links to them work on the repository's own pages
    too); tests/test_docs.py fails when they are stale, and ``--write`` renews them."""
    return {ROOT / "docs" / CONFIG_PAGE: config_page() + "\n", ROOT / "docs" / CLI_PAGE: cli_page() + "\n"}


if __name__ == "__main__":  # python docs/hooks/reference.py config|cli (print a page) | --write (renew both)
    if sys.argv[1:] == ["--write"]:
        for path, text in committed_pages().items():
            path.write_text(text)
            print(f"wrote {path.relative_to(ROOT)}")
    else:
        print(textwrap.dedent(config_page() if sys.argv[1:] == ["config"] else cli_page()))
