"""The `agentrl` subcommands, one module each (``train``, ``envs``, ``serve``, ``bench``), and the benchmarks
``agentrl bench`` runs. Each module's ``add_parser`` registers its command with ``agentrl.cli``."""
