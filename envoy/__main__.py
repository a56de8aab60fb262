"""`python -m moe_cluster.envoy`: run one envoy (normally started by its node; see main.py)."""

import sys

from .main import main

sys.exit(main())
