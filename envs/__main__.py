"""`python -m agentrl.envs ...` is `agentrl envs ...`."""
import sys

from agentrl.commands.envs import main

if __name__ == "__main__":
    sys.exit(main())
