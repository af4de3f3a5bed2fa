"""The docs: every config key has an entry with a meaning in the generated reference; the README stays short."""
import dataclasses
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _hook():
    spec = importlib.util.spec_from_file_location("docs_reference_hook", ROOT / "docs/hooks/reference.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def _config_keys() -> set[str]:
    from agentrl.config import RecipeCfg

    keys = set()
    for f in dataclasses.fields(RecipeCfg):
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):
            keys |= {f"{f.name}.{g.name}" for g in dataclasses.fields(default)}
        else:
            keys.add(f.name)
    return keys


def test_every_config_key_has_a_row_with_a_meaning():
    hook = _hook()
    page = hook.config_page()
    documented = {k.key: k for k in hook.all_keys()}
    keys = _config_keys()
    assert keys - set(documented) == set(), "config keys missing from the reference"
    no_meaning = sorted(k for k, d in documented.items() if not d.meaning.strip())
    assert not no_meaning, f"give these fields a comment in the config source: {no_meaning}"
    for key in keys:
        assert f"| `{key}` |" in page, key


def test_cli_reference_lists_every_command():
    page = _hook().cli_page()
    for cmd in ("train", "eval", "plot", "envs", "serve", "bench", "view", "show", "reproduce"):
        assert f"`agentrl {cmd}`" in page, cmd


def test_the_committed_reference_pages_are_current():
    """docs/reference/config.md and cli.md are committed, so that links to them work on the repository's pages."""
    for path, text in _hook().committed_pages().items():
        assert path.exists() and path.read_text() == text, \
            f"{path.relative_to(ROOT)} is stale: run `.venv/bin/python docs/hooks/reference.py --write`"


def test_readme_is_at_most_200_lines():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200


def test_every_recipe_yaml_is_listed_on_the_recipes_page():
    index = (ROOT / "docs/recipes/index.md").read_text()
    names = sorted(p.stem for p in (ROOT / "recipes").glob("*.yaml") if p.stem != "base")
    assert names, "no recipe YAMLs found"
    missing = [n for n in names if f"`{n}`" not in index]
    assert not missing, f"recipes missing from docs/recipes/index.md: {missing}"
