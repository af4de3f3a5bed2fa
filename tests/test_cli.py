"""`agentrl envs` from a user's terminal: list, play by hand, check, and clear errors."""
import json
import subprocess
import sys


def run(*args, stdin=""):
    return subprocess.run([sys.executable, "-m", *args], input=stdin, capture_output=True, text=True, timeout=300)


def test_help_lists_commands():
    r = run("agentrl.cli", "--help")
    assert r.returncode == 0 and "envs" in r.stdout
    r = run("agentrl", "--help")  # python -m agentrl, the same command
    assert r.returncode == 0 and "envs" in r.stdout
    r = run("agentrl.cli", "envs", "play", "--help")
    assert r.returncode == 0 and ":expert" in r.stdout and ":undo" in r.stdout


def test_list_json_counts():
    r = run("agentrl.envs", "list", "--json", "--only", "sokoban", "bandit", "frozenlake")
    rows = {row["env"]: row for row in json.loads(r.stdout)}
    assert rows["sokoban"]["train"] == 10000 and rows["bandit"]["test"] == 36
    assert rows["frozenlake"]["restore"] == "snapshot, replay"


def test_play_by_hand_to_the_end():
    keys = "\n".join([":a", "Up", ":undo"] + [":e"] * 12 + [":q"]) + "\n"
    r = run("agentrl.envs", "play", "sokoban", "--task", "train/00021", stdin=keys)
    assert r.returncode == 0, r.stderr
    assert "Left" in r.stdout and "restored to step 0" in r.stdout
    assert "expert: " in r.stdout and "episode over: won=True" in r.stdout


def test_check_command_and_errors():
    r = run("agentrl.envs", "check", "sokoban", "bandit", "--tasks", "5", "--replay-tasks", "3")
    assert r.returncode == 0 and "sokoban: expert success 5/5" in r.stdout
    r = run("agentrl.envs", "play", "sokobon")
    assert r.returncode == 2 and "unknown env 'sokobon'" in r.stderr and "sokoban" in r.stderr
    r = run("agentrl.envs", "play", "sokoban", "--task", "train/xx")
    assert r.returncode == 2 and "malformed task id" in r.stderr
