"""python scripts/cluster.py [--tiny] [--keep-running] ...: see rsd_tools/cluster.py (same as `rsd cluster`)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from rsd_tools.cluster import main

sys.exit(main())
