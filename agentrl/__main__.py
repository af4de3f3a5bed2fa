"""``python -m agentrl ...``: the ``agentrl`` command, where the console script is not on PATH."""
import sys

from agentrl.cli import main

if __name__ == "__main__":  # a module walk that imports every module runs nothing
    sys.exit(main())
