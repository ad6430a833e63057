"""`python -m agent_server.cli`: the same as the `oss-agent` command."""

import sys

from agent_server.cli.main import main

sys.exit(main())
