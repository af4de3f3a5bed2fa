"""`python -m agentrl.envs ...` is `agentrl envs ...`."""
import sys

from agentrl.envs_cmd import main

if __name__ == "__main__":
    sys.exit(main())
