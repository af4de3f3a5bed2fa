"""``python -m agentrl ...``: the ``agentrl`` command, where the console script is not on PATH."""
import sys

from agentrl.cli import main

sys.exit(main())
