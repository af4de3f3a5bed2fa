"""What a run refuses, `agentrl train --print-config` and `--dry-run` refuse too, with the same one line and
before any run folder is made: value rules in the loader, a recipe's own in its ``check_config``, the rest
in the one preflight (agentrl/preflight.py) all three call."""
import pytest

from agentrl import cli

VLLM = ["trainer.generator=vllm"]
REFUSALS = {
    "colocated servers over NCCL": (VLLM + ["vllm.colocate=true", "vllm.gpu_memory_utilization=0.3",
                                            "trainer.vllm_sync=nccl"], "NCCL refuses two ranks on one GPU"),
    "compile under DeepSpeed": (["trainer.engine=deepspeed", "model.compile=true"],
                                "model.compile under trainer.engine=deepspeed"),
    "a bad DeepSpeed config file": (["trainer.engine=deepspeed", "trainer.deepspeed_config=no/such.json"],
                                    "no/such.json is not a file"),
    "a remote generator without a URL": (["trainer.generator=remote"], "trainer.generator=remote needs"),
    "vLLM without servers or a URL": (VLLM + ["trainer.vllm_servers=0"], "trainer.vllm_servers >= 1"),
    "a LoRA rank vLLM cannot serve": (VLLM + ["model.lora_r=1024"], "bad value for 'model.lora_r': 1024"),
    "a recipe's extra range (crps)": (["--recipe=crps", "extra.p_replay=2"], "bad value for 'extra.p_replay': 2"),
    "a recipe's extra range (spear)": (["--recipe=spear", "extra.cov_bounds=[1, 0]"],
                                       "bad value for 'extra.cov_bounds'"),
    "a task sampler the recipe does not feed": (["--recipe=leafe", "rollout.task_sampler=learnability"],
                                                "leafe draws its tasks itself"),
}
MODES = {"run": [], "--print-config": ["--print-config"],
         "--dry-run": ["--dry-run", "--nodes", "1", "--gpus-per-node", "2"]}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_the_run_print_config_and_dry_run_refuse_alike(case, tmp_path, capsys):
    overrides, want = REFUSALS[case]
    recipe = next((o.split("=", 1)[1] for o in overrides if o.startswith("--recipe=")), "grpo")
    overrides = [o for o in overrides if not o.startswith("--recipe=")]
    lines = {}
    for mode, flags in MODES.items():
        out = tmp_path / mode.strip("-")
        rc = cli.main(["train", recipe, "--env", "bandit", "--out", str(out), "sft.enabled=false", "eval.tasks=0",
                       "trainer.tensorboard=false", *overrides, *flags])
        got = capsys.readouterr()
        errors = [x for x in got.err.splitlines() if x.startswith("error: ")]
        assert rc == 2 and len(errors) == 1, (mode, rc, got.err[-2000:], got.out[-2000:])
        assert want in errors[0], (mode, errors[0])
        assert not out.exists(), mode  # refused before any run folder is made
        lines[mode] = errors[0]
    assert len(set(lines.values())) == 1, lines


def test_an_agent_program_in_the_launching_script_is_refused_alike(tmp_path, capsys):
    """Agent programs run in worker processes, whose __main__ is not the user's script: refused at load, in one
    line, by the run, --print-config and --dry-run alike (before, every episode failed in its worker)."""
    for mode, flags in MODES.items():
        out = tmp_path / mode.strip("-")
        rc = cli.main(["train", "grpo", "--env", "agent:__main__:my_agent", "--out", str(out), *flags])
        errors = [x for x in capsys.readouterr().err.splitlines() if x.startswith("error: ")]
        assert rc == 2 and len(errors) == 1 and "cannot import the launching script's __main__" in errors[0], mode
        assert not out.exists(), mode
